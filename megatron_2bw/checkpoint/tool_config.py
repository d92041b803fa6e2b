"""The configuration of a tool that reads a checkpoint: the shared pretraining flags, with every flag
the user left unset taken from the configuration saved in the checkpoint.

The parallel layout is the tool's own (it is not inherited from the training run), and flags that
fix the model's shape must agree with the checkpoint.
"""
from __future__ import annotations

import argparse
import os

from megatron_2bw.arguments import ConfigError, config_from_args, explicit_fields
from megatron_2bw.checkpoint.save_load import (ARCHITECTURE_FIELDS, MARKER, has_checkpoint,
                                               saved_config)
from megatron_2bw.config import CheckpointConfig, Config, ParallelConfig
from megatron_2bw.data.tokenizers import tokenizer_files


def check_architecture_flags(args: argparse.Namespace, base: Config, source: str) -> None:
    """A typed flag such as --hidden-size must match the model held by `source`. (--vocab-size
    sizes a NullTokenizer, which adds its eod id: tools check the tokenizer against the model.)"""
    for section, field in explicit_fields(args):
        if section == "model" and field in ARCHITECTURE_FIELDS and field != "vocab_size":
            typed, saved = getattr(args, field), getattr(base.model, field)
            if typed != saved:
                raise ConfigError(f"--{field.replace('_', '-')} {typed} contradicts {source}, whose "
                                  f"model has {field} = {saved}")


def config_with_base(args: argparse.Namespace, base: Config, source: str,
                     require_data: bool = False, checkpoint: str | None = None) -> Config:
    """config_from_args over `base` (a checkpoint's or an imported model's configuration). A tool
    that builds the tokenizer passes the `checkpoint` directory: the tokenizer files it names are
    then found from any folder (locate_tokenizer_files)."""
    check_architecture_flags(args, base, source)
    base = Config.from_dict(base.to_dict())
    base.parallel, base.checkpoint = ParallelConfig(), CheckpointConfig()
    config = config_from_args(args, base.model.model_type, base=base, require_data=require_data)
    if checkpoint is not None:
        locate_tokenizer_files(config, checkpoint, explicit_fields(args))
    return config


def locate_tokenizer_files(config: Config, root: str, typed: set) -> None:
    """The tokenizer files a checkpoint's configuration names, each where it is: the path as
    recorded (training records it absolute), else that path under the checkpoint directory, else
    a file of its name there (a checkpoint moved with its tokenizer beside it). A file found
    nowhere is a ConfigError naming the flag that gives it; typed flags are the user's own."""
    data = config.data
    for field, flag in tokenizer_files(data.tokenizer_type):
        path = getattr(data, field)
        if not path or ("data", field) in typed or os.path.exists(path):
            continue
        found = next((candidate for candidate in (os.path.join(root, path),
                                                  os.path.join(root, os.path.basename(path)))
                      if os.path.exists(candidate)), None)
        if found is None:
            raise ConfigError(f"checkpoint {root} was trained with {flag} {path}, which is not "
                              f"found (from {os.getcwd()}, nor in {root}): pass {flag} with "
                              f"its path")
        setattr(data, field, os.path.abspath(found))


def with_checkpoint_model(args: argparse.Namespace, config: Config) -> Config:
    """--use-checkpoint-args (Megatron-LM's): the model of the --load checkpoint for every model
    flag left unset; typed ones must agree with it. Sequence parallelism stays this run's choice."""
    root = config.checkpoint.load
    if not root or not has_checkpoint(root):
        raise ConfigError(f"--use-checkpoint-args takes the model flags from the --load checkpoint, "
                          f"but --load {root} holds none ({MARKER} is missing)")
    base = Config.from_dict(config.to_dict())
    base.model = saved_config(root).model
    base.model.sequence_parallel = config.model.sequence_parallel
    check_architecture_flags(args, base, f"the checkpoint in --load {root}")
    return config_from_args(args, config.model.model_type, base=base)
