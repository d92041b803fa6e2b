"""GPT with Megatron-LM's document flags, against independent references:
- the loss with a loss_mask (--eod-mask-loss) is the masked mean of torch's cross entropy;
- with --reset-position-ids and --reset-attention-mask a document packed after another in one
  sample gets exactly the losses it gets alone."""
import numpy as np
import torch
import torch.nn.functional as F

from megatron_2bw.config import ModelConfig
from megatron_2bw.data.gpt_dataset import DocumentBoundaries
from megatron_2bw.models import build_stage_model

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=101, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
EOD = 100


def whole_model():
    return build_stage_model(MODEL, None, 1, range(MODEL.num_layers), True, True, 1234)


def per_token_losses(model, tokens):
    with torch.no_grad():
        return F.cross_entropy(model.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(),
                               reduction="none")


def test_masked_loss_is_the_mean_over_the_kept_targets():
    model = whole_model()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (3, MODEL.seq_length + 1), generator=generator)
    loss_mask = (torch.rand(3, MODEL.seq_length, generator=generator) > 0.3).float()
    loss, metrics = model(None, {"tokens": tokens, "loss_mask": loss_mask})
    per_token = per_token_losses(model, tokens)
    expected = (per_token * loss_mask.flatten()).sum() / loss_mask.sum()
    assert torch.allclose(loss, expected, atol=1e-5)
    assert not torch.allclose(loss, per_token.mean(), atol=1e-3)  # the mask changed it
    assert metrics["lm loss"] == loss.detach()


def packed_batch(first: list[int], second: list[int], resets: bool) -> dict:
    sample = {"tokens": np.array(first + [EOD] + second)}
    boundaries = DocumentBoundaries([sample], EOD, position_ids=resets, document_ids=resets)
    return {key: torch.from_numpy(value)[None] for key, value in boundaries[0].items()}


def test_a_packed_document_learns_as_if_alone():
    """A 6-token document, its end-of-document token, then a 10-token one: with both resets the
    second document's 9 targets get the losses that document gets on its own; without, not."""
    model = whole_model()
    rng = np.random.RandomState(3)
    first, second = rng.randint(0, EOD, 6).tolist(), rng.randint(0, EOD, 10).tolist()
    alone = per_token_losses(model, torch.tensor([second]))
    for resets in (True, False):
        batch = packed_batch(first, second, resets)
        assert batch["tokens"].shape == (1, MODEL.seq_length + 1)
        kept = torch.zeros(1, MODEL.seq_length)
        kept[0, 7:] = 1.0  # inputs second[0..8], targets second[1..9]
        loss, _ = model(None, {**batch, "loss_mask": kept})
        assert torch.allclose(loss, alone.mean(), atol=1e-6) == resets
    # the first document, whose positions and context are unchanged, is unaffected by the resets
    with_resets, without = (model(None, {**packed_batch(first, second, r),
                                         "loss_mask": (torch.arange(16) < 6).float()[None]})[0]
                            for r in (True, False))
    assert torch.allclose(with_resets, without, atol=1e-6)
