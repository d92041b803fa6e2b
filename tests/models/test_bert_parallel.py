"""BERT through the full parallel stack against independent references (dropout 0):
- t=2 x p=2 with Flush reaches the loss and weights of one process after 3 steps (fp32);
- t=2 x p=2 with 2BW reaches the weights of the single-process delayed-update reference;
- p=2 x d=2 with GPipe and full recomputation, and p=2 without the binary head, match one process;
- t=2 in bf16 with selective recomputation tracks the fp32 losses (bf16 rounding only).
Samples come from MockBERTDataset in Megatron's sample order (tests/pipeline/harness.py).
The model itself is checked against transformers' MegatronBertForPreTraining (same weights)."""
import functools

import torch
from torch.utils.data import default_collate

from megatron_2bw.config import Config
from megatron_2bw.data.bert_dataset import BertSampleSettings
from megatron_2bw.data.builder import MOCK_BERT_SPECIAL
from megatron_2bw.data.mock import MockBERTDataset
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.models import build_stage_model
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import (full_weights, max_difference, microbatch_samples, tiny_config,
                                    train_on_ranks)
from tests.pipeline.reference import delayed_update_reference

VOCAB = 101


def to_transformers_names(weights: dict, num_layers: int, heads: int) -> dict:
    """Our parameters under MegatronBertForPreTraining's names (qkv rows are (head, q/k/v, dim))."""
    embeddings = "bert.embeddings."
    word_embeddings = weights["embedding.word_embeddings.weight"][:VOCAB]
    out = {embeddings + "word_embeddings.weight": word_embeddings,
           embeddings + "position_embeddings.weight": weights["embedding.position_embeddings"],
           embeddings + "token_type_embeddings.weight": weights["embedding.tokentype_embeddings"],
           "cls.predictions.bias": weights["heads.lm_bias"][:VOCAB],
           # the decoder is tied to the word embeddings and shares the bias
           "cls.predictions.decoder.weight": word_embeddings,
           "cls.predictions.decoder.bias": weights["heads.lm_bias"][:VOCAB]}
    renames = {"heads.final_norm": "bert.encoder.ln", "heads.pooler": "bert.pooler.dense",
               "heads.lm_transform": "cls.predictions.transform.dense",
               "heads.lm_norm": "cls.predictions.transform.LayerNorm",
               "heads.binary_head": "cls.seq_relationship"}
    for i in range(num_layers):
        ours, theirs = f"transformer.layers.{i}", f"bert.encoder.layer.{i}"
        renames.update({f"{ours}.input_norm": f"{theirs}.attention.ln",
                        f"{ours}.attention.dense": f"{theirs}.attention.output.dense",
                        f"{ours}.post_attention_norm": f"{theirs}.ln",
                        f"{ours}.mlp.fc1": f"{theirs}.intermediate.dense",
                        f"{ours}.mlp.fc2": f"{theirs}.output.dense"})
        for kind in ("weight", "bias"):
            qkv = weights[f"{ours}.attention.qkv.{kind}"]
            per_head = qkv.reshape(heads, 3, -1, *qkv.shape[1:])
            for j, name in enumerate(("query", "key", "value")):
                out[f"{theirs}.attention.self.{name}.{kind}"] = per_head[:, j].reshape(
                    -1, *qkv.shape[1:])
    for ours, theirs in renames.items():
        for kind in ("weight", "bias"):
            out[f"{theirs}.{kind}"] = weights[f"{ours}.{kind}"]
    return out


def test_model_equals_transformers_megatron_bert():
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    c = config(model={"num_layers": 2})
    m = c.model
    ours = build_stage_model(m, None, 1, range(m.num_layers), True, True, seed=3)
    theirs = MegatronBertForPreTraining(MegatronBertConfig(
        vocab_size=VOCAB, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size,
        max_position_embeddings=m.max_position_embeddings, type_vocab_size=2,
        layer_norm_eps=m.layernorm_epsilon, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).eval()
    weights = dict(ours.named_parameters())
    theirs.load_state_dict(to_transformers_names(weights, m.num_layers, m.num_attention_heads),
                           strict=True)
    batch = bert_feed(c, ParallelLayout(1, 1, 1))(0)
    assert (batch["padding_mask"] == 0).any() and (batch["types"] == 1).any()
    with torch.no_grad():
        loss, metrics = ours.eval()(None, batch)
        reference = theirs(input_ids=batch["text"], token_type_ids=batch["types"],
                           attention_mask=batch["padding_mask"],
                           labels=batch["labels"].masked_fill(batch["loss_mask"] == 0, -100),
                           next_sentence_label=batch["is_random"])
        assert abs(loss.item() - reference.loss.item()) < 1e-5
        # padding positions are invisible: changing their ids changes nothing
        changed = dict(batch, text=batch["text"].masked_fill(batch["padding_mask"] == 0, 50))
        assert abs(ours(None, changed)[0].item() - loss.item()) < 1e-6


def shortened(sample: dict, index: int) -> dict:
    """Mock samples fill the whole sequence: pad the tail of every other one (Megatron's BERT data
    has padding too), so the padding mask is exercised."""
    if index % 2 == 0:
        return sample
    sample = {key: value.copy() for key, value in sample.items()}
    tail = slice(-3, None)
    sample["text"][tail] = MOCK_BERT_SPECIAL.pad
    sample["types"][tail] = 0
    sample["labels"][tail] = -1
    sample["loss_mask"][tail] = 0.0
    sample["padding_mask"][tail] = 0
    return sample


def bert_feed(config: Config, layout: ParallelLayout):
    """Microbatch k of this data-parallel rank, as the training data iterator would collate it."""
    tr, model = config.training, config.model
    m = tr.global_batch_size // (tr.micro_batch_size * layout.data)
    settings = BertSampleSettings(model.seq_length, model.vocab_size, MOCK_BERT_SPECIAL,
                                  binary_head=model.bert_binary_head)
    dataset = MockBERTDataset(10_000, settings, seed=7)

    def feed(k: int) -> dict:
        idx = microbatch_samples(k, m, tr.micro_batch_size, layout.data, layout.coords.dp,
                                 tr.global_batch_size)
        return default_collate([shortened(dataset[i], i) for i in idx])
    return feed


def config(t=1, p=1, schedule="flush", binary_head=True, **overrides) -> Config:
    c = tiny_config(t=t, p=p, schedule=schedule, optimizer="adam", lr=0.01, clip=0.5, seq_length=16,
                    model_type="bert", num_tokentypes=2, bert_binary_head=binary_head)
    for section, values in overrides.items():
        for name, value in values.items():
            setattr(getattr(c, section), name, value)
    return c


@functools.lru_cache(maxsize=None)
def one_process(binary_head: bool = True):
    return run_ranks(1, train_on_ranks, config(binary_head=binary_head), 3, bert_feed)


def last_stage_losses(results) -> torch.Tensor:
    """[steps, losses] (lm loss, then sop loss when present) reported by tp 0 of the last stage."""
    last_stage = max(r["coords"][2] for r in results)
    last = next(r for r in results if r["coords"] == (0, 0, last_stage))
    return torch.tensor([[m[k] for k in ("lm loss", "sop loss") if k in m]
                         for _, _, _, m in last["results"]])


def test_t2_p2_flush_matches_one_process():
    results = run_ranks(4, train_on_ranks, config(t=2, p=2), 3, bert_feed)
    single = one_process()
    assert max_difference(full_weights(results), full_weights(single), VOCAB) < 1e-5
    losses = last_stage_losses(results)
    assert losses.shape == (3, 2)
    assert torch.allclose(losses, last_stage_losses(single), atol=1e-5)
    # training moved the weights: the comparison is not between two initialisations
    c = config()
    initial = dict(build_stage_model(c.model, None, 1, range(c.model.num_layers), True, True,
                                     c.training.seed).named_parameters())
    assert max_difference(full_weights(single), initial, VOCAB) > 1e-3


def test_t2_p2_2bw_matches_the_delayed_update_reference():
    c = config(t=2, p=2, schedule="2bw")
    weights = full_weights(run_ranks(4, train_on_ranks, c, 4, bert_feed))
    reference = delayed_update_reference(c, 4, bert_feed(c, ParallelLayout(1, 1, 1)), 4)
    assert max_difference(weights, reference, VOCAB) < 1e-5
    assert torch.equal(weights["tied_copy:output_embedding"],
                       weights["embedding.word_embeddings.weight"])


def test_p2_d2_gpipe_with_full_recomputation_matches_one_process():
    c = config(p=2, schedule="gpipe",
               recompute={"granularity": "full", "method": "uniform", "num_layers": 1})
    results = run_ranks(4, train_on_ranks, c, 3, bert_feed)
    assert max_difference(full_weights(results), full_weights(one_process()), VOCAB) < 1e-5
    assert torch.allclose(last_stage_losses(results), last_stage_losses(one_process()), atol=1e-5)


def test_t2_p2_sequence_parallel_with_full_recomputation_matches_one_process():
    """--sequence-parallel under BERT (padding masks, token types, the heads on the gathered
    sequence) with recomputation, which re-runs the gathers in the backward."""
    c = config(t=2, p=2, model={"sequence_parallel": True},
               recompute={"granularity": "full", "method": "uniform", "num_layers": 1})
    results = run_ranks(4, train_on_ranks, c, 3, bert_feed)
    assert max_difference(full_weights(results), full_weights(one_process()), VOCAB) < 1e-5
    assert torch.allclose(last_stage_losses(results), last_stage_losses(one_process()), atol=1e-5)


def test_t2_bf16_with_selective_recomputation_tracks_fp32():
    c = config(t=2, precision={"bf16": True}, recompute={"granularity": "selective"})
    losses = last_stage_losses(run_ranks(2, train_on_ranks, c, 3, bert_feed))
    assert torch.allclose(losses, last_stage_losses(one_process()), rtol=2e-2)


def test_no_binary_head_p2_flush_matches_one_process():
    single = one_process(binary_head=False)
    results = run_ranks(2, train_on_ranks, config(p=2, binary_head=False), 3, bert_feed)
    weights = full_weights(results)
    assert not any(name.startswith(("heads.binary_head", "heads.pooler")) for name in weights)
    assert max_difference(weights, full_weights(single), VOCAB) < 1e-5
    losses = last_stage_losses(results)
    assert losses.shape == (3, 1)  # the lm loss only: no sentence-order loss
    assert torch.allclose(losses, last_stage_losses(single), atol=1e-5)
