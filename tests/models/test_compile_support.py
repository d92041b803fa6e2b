"""Which torch --torch-compile accepts (the compiled runs themselves: test_compile.py)."""
import types

import pytest
import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.models.compile import check_compile_supported


@pytest.mark.parametrize("dynamo_config,has_stance,accepted", [
    ({"inline_inbuilt_nn_modules": True}, True, True),
    ({}, True, True),  # a later torch that dropped the setting always inlines
    ({"inline_inbuilt_nn_modules": False}, True, False),  # parameter swaps would recompile
    ({"inline_inbuilt_nn_modules": True}, False, False),  # before torch 2.6
], ids=["inlined", "setting-dropped", "not-inlined", "no-set-stance"])
def test_torch_compile_needs_inlined_modules(dynamo_config, has_stance, accepted, monkeypatch):
    monkeypatch.setattr(torch, "_dynamo", types.SimpleNamespace(
        config=types.SimpleNamespace(**dynamo_config)))
    compiler = types.SimpleNamespace(set_stance=lambda *_: None) if has_stance else \
        types.SimpleNamespace()
    monkeypatch.setattr(torch, "compiler", compiler)
    if accepted:
        check_compile_supported()
    else:
        with pytest.raises(ConfigError, match="--torch-compile needs torch >= 2.6"):
            check_compile_supported()
