"""Tiny GPT runs for the training package's tests: pretrain_gpt.py's flags and pretrain() on a
forked gloo rank, optionally recording what happened in order."""
import gc
import os

import torch

from megatron_2bw.arguments import parse_config
from megatron_2bw.training import loop, progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
         "16", "--micro-batch-size", "2", "--train-iters", "2"]

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "16", "--micro-batch-size", "2", "--mock-data", "--vocab-size", "64", "--eval-iters", "1",
        "--train-iters", "6", "--eval-interval", "3", "--log-interval", "1"]


def pretrain_on_rank(rank, world, flags):
    loop.pretrain(parse_config(flags)[0])


def pretrain_recording(rank, world, flags):
    """pretrain(flags) on this forked rank, recording in order each collection, each step (its
    iteration, whether the collector and deterministic algorithms are on) and each evaluation;
    returns the events and whether the collector is on afterwards."""
    gc.freeze()  # collections leave out the heap inherited from pytest: seconds each otherwise
    events = []
    collect, step, evaluate = gc.collect, progress.ProgressLog.__call__, loop.evaluate

    def recording_collect(generation=2):
        events.append(("collect", generation))
        return collect(generation)

    def recording_step(log, result):
        events.append(("step", result.batch + 1, gc.isenabled(),
                       torch.are_deterministic_algorithms_enabled()))
        step(log, result)

    def recording_evaluate(*args, **kwargs):
        events.append(("evaluate", gc.isenabled()))
        return evaluate(*args, **kwargs)

    gc.collect = recording_collect  # the forked rank's own modules: nothing to restore
    progress.ProgressLog.__call__ = recording_step
    loop.evaluate = recording_evaluate
    pretrain_on_rank(rank, world, flags)
    return events, gc.isenabled()


def steps(gc_on: bool, *iterations: int) -> list:
    return [("step", i, gc_on, False) for i in iterations]
