import os
import sys

import pytest
import torch

# The tests run from a checkout without an install: this process imports the package from the
# repository root, and so do the tools and entry points it starts as subprocesses.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPO_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
torch.set_num_threads(1)
# Every rank the tests start (forked or launched) keeps NCCL's point-to-point rules on gloo:
# one form per transfer pair, posting-order matching, sends that wait for their receive
# (megatron_2bw/distributed/strict_p2p.py)
os.environ.setdefault("MEGATRON_2BW_STRICT_P2P", "1")


@pytest.fixture
def reduced_precision_math_attention():
    """scaled_dot_product_attention's math kernel allowed fp16/bf16 softmaxes (not the default):
    then the fp32-softmax flags take Megatron-LM's unfused attention (models/transformer.py)."""
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    yield
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


# A hung test ends the run (pytest.ini's test_timeout)
from tests.hang_timeout import (pytest_addoption, pytest_configure,  # noqa: E402,F401
                                pytest_runtest_protocol)
