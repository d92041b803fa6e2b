"""Ranks that train and save a checkpoint, or load one and train on: for the tests that hold a
converted or resharded checkpoint to one process."""
from __future__ import annotations

from megatron_2bw.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_2bw.training.segments import run_segment
from tests.pipeline.harness import gpt_feed, rank_weights, stage_on_rank


def train_and_save(rank: int, world: int, config, batches: int, save: str) -> dict:
    layout, stage = stage_on_rank(rank, world, config)
    run_segment(stage, 0, batches, gpt_feed(config, layout))
    stage.iteration, stage.consumed_samples = batches, batches * config.training.global_batch_size
    stage.config.checkpoint.save = save
    save_checkpoint(stage)
    return rank_weights(layout, stage)


def load_and_train(rank: int, world: int, config, load: str, batches: int) -> dict:
    """This rank's weights after `batches` more batches, or {"refused": the loader's message}."""
    layout, stage = stage_on_rank(rank, world, config)
    try:
        load_checkpoint(stage, load)
    except CheckpointError as error:
        return {"refused": str(error)}
    run_segment(stage, stage.iteration, batches, gpt_feed(config, layout))
    return rank_weights(layout, stage)


def true_vocabulary(weights: dict, vocab: int) -> dict:
    """Vocabulary-sized tensors cut to the true vocabulary: a conversion pads with zeros."""
    padded = weights["embedding.word_embeddings.weight"].shape[0]
    return {k: w[:vocab] if w.shape[0] == padded else w for k, w in weights.items()}
