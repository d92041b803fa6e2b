"""Sampling rules against hand-computed distributions, and generation from a sharded checkpoint
against the unsharded weights' own argmax loop."""
import argparse
import re

import pytest
import torch

from megatron_2bw.arguments import build_parser
from megatron_2bw.inference.cli import add_generate_arguments
from megatron_2bw.inference.loading import load_text_model
from megatron_2bw.inference.sampling import SamplingConfig, filter_logits, generate, next_tokens
from tests.checkpoint.helpers import VOCAB, save_random_checkpoint, whole_model


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    kept = filter_logits(logits, top_k=2, top_p=0.0)
    assert torch.isinf(kept).tolist() == [[True, False, False, True]]
    assert kept[0, 1] == 4.0 and kept[0, 2] == 3.0


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probabilities = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probabilities.log()
    assert torch.isfinite(filter_logits(logits, 0, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.0)).all()  # 0: no limit


def test_sampling_frequencies_follow_the_tempered_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=2.0, top_k=3)
    counts = torch.bincount(next_tokens(logits, sampling, generator), minlength=4).float()
    expected = torch.tensor([2.0, 1.0, 0.0]).div(2.0).softmax(0)
    assert counts[3] == 0
    assert torch.allclose(counts[:3] / counts.sum(), expected, atol=0.015)


@pytest.mark.parametrize("bad, message", [
    (SamplingConfig(temperature=0.0), "--temperature must be > 0"),
    (SamplingConfig(top_k=-1), "--top-k must be >= 0"),
    (SamplingConfig(top_p=1.5), "--top-p must be in [0, 1]"),
    (SamplingConfig(top_k=5, top_p=0.9), "give --top-k or --top-p, not both (as in Megatron-LM; "
                                         "0 turns one off), got 5 and 0.9")])
def test_bad_sampling_settings_name_their_flag(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        bad.validate()


def _args(root, *extra) -> argparse.Namespace:
    return build_parser("", add_generate_arguments).parse_args(["--load", str(root), *extra])


def test_greedy_generation_of_a_t2_p2_checkpoint_matches_the_unsharded_model(tmp_path):
    state = save_random_checkpoint(tmp_path, "gpt", t=2, p=2)
    loaded = load_text_model(_args(tmp_path), device=torch.device("cpu"), show_progress=False)
    assert loaded.max_positions == 16 and loaded.stop_id == VOCAB - 1
    prompt = [5, 9, 13]
    new = generate(loaded.model, prompt, 20, SamplingConfig(greedy=True), loaded.max_positions)

    reference, expected = whole_model(state), list(prompt)
    with torch.no_grad():
        for _ in range(20):  # beyond 16 positions the model sees the last 16 tokens
            expected.append(int(reference.logits(torch.tensor([expected[-16:]]))[0, -1].argmax()))
    assert new == expected[len(prompt):]
    # top-k 1 and a tiny nucleus are greedy too, whatever the temperature
    for sampling in (SamplingConfig(top_k=1, temperature=3.0), SamplingConfig(top_p=1e-6)):
        assert generate(loaded.model, prompt, 20, sampling, 16,
                        generator=torch.Generator().manual_seed(1)) == new


def test_generation_stops_at_the_end_of_document_token(tmp_path):
    save_random_checkpoint(tmp_path, "gpt", t=1, p=1)
    loaded = load_text_model(_args(tmp_path), device=torch.device("cpu"), show_progress=False)
    first = generate(loaded.model, [5, 9, 13], 1, SamplingConfig(greedy=True), 16)
    assert generate(loaded.model, [5, 9, 13], 8, SamplingConfig(greedy=True), 16,
                    stop_id=first[0]) == []
