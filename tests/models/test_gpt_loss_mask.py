"""GPT's loss with a loss_mask (--eod-mask-loss) is the masked mean of the per-token cross entropy,
checked against torch's own cross entropy on the full logits."""
import torch
import torch.nn.functional as F

from megatron_2bw.config import ModelConfig
from megatron_2bw.models import build_stage_model

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=101, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)


def test_masked_loss_is_the_mean_over_the_kept_targets():
    model = build_stage_model(MODEL, None, 1, range(MODEL.num_layers), True, True, 1234)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (3, MODEL.seq_length + 1), generator=generator)
    loss_mask = (torch.rand(3, MODEL.seq_length, generator=generator) > 0.3).float()
    loss, metrics = model(None, {"tokens": tokens, "loss_mask": loss_mask})
    with torch.no_grad():
        per_token = F.cross_entropy(model.logits(tokens[:, :-1]).flatten(0, 1),
                                    tokens[:, 1:].flatten(), reduction="none")
    expected = (per_token * loss_mask.flatten()).sum() / loss_mask.sum()
    assert torch.allclose(loss, expected, atol=1e-5)
    assert not torch.allclose(loss, per_token.mean(), atol=1e-3)  # the mask changed it
    assert metrics["lm loss"] == loss.detach()
