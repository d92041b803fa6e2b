"""Before the first step: the flags' files and tokenizer checked (one line naming the flag on a
mistake), the processes and groups started, --auto-parallel's plan applied, the data built."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_2bw.config_checks import validate_for_world
from megatron_2bw.batch_schedule import batch_schedule
from megatron_2bw.config import Config, ConfigError
from megatron_2bw.cpu_threads import busy_machine_note, set_single_process_threads
from megatron_2bw.distributed.launch import init_distributed, local_world_size, usable_cores
from megatron_2bw.distributed.layout import ParallelLayout


def set_cpu_threads(bound: bool) -> None:
    """Threads per rank: its bound cores, or else its share of the node's cores (torch would start
    a thread per core in every rank); a process alone (fine-tuning, a one-process run) leaves out
    the cores other processes keep busy."""
    if torch.cuda.is_available():
        return
    if not bound and local_world_size() == 1:
        set_single_process_threads()
        return
    cores = len(usable_cores())
    torch.set_num_threads(cores if bound else max(1, cores // local_world_size()))


def use_deterministic_algorithms() -> None:
    """--deterministic-mode: torch raises on an operation without a deterministic implementation.
    cuBLAS is deterministic only with a fixed workspace, which torch then insists on (CUDA >= 10.2)
    and cuBLAS reads from the environment when CUDA starts, so this runs before the device is
    picked; a value the user set is kept. Without CUDA nothing reads the variable."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def setup(config: Config, typed: set) -> tuple[Config, ParallelLayout, torch.device, object]:
    """Initialise the processes, apply --auto-parallel's plan, check the layout, build the groups."""
    if config.training.deterministic_mode:
        use_deterministic_algorithms()
    info, device = init_distributed(config.parallel.distributed_backend,
                                    config.parallel.timeout_minutes,
                                    config.parallel.bind_cores_to_rank)
    set_cpu_threads(config.parallel.bind_cores_to_rank)
    plan = None
    if config.parallel.auto_parallel:
        from megatron_2bw.planner.auto import describe_plan, plan_job
        busy = busy_machine_note()  # before the ranks' own work loads the machine
        config, plan = plan_job(config, info.world_size, info.rank, typed)
        if info.rank == 0:
            print(f" auto-parallel plan: {describe_plan(plan)}", flush=True)
            if busy is not None:
                print(f" auto-parallel: {busy}", flush=True)
            if config.parallel.planner_hardware != "local":
                print(f" auto-parallel: planned for --planner-hardware "
                      f"{config.parallel.planner_hardware}; its predictions describe that "
                      f"hardware, not necessarily this machine", flush=True)
    par = config.parallel
    validate_for_world(config, info.world_size)
    layout = ParallelLayout(info.world_size, par.tensor_parallel, par.pipeline_parallel, info.rank,
                            par.context_parallel)
    layout.build_groups(par.timeout_minutes)
    return config, layout, device, plan


def build_data(config: Config, layout: ParallelLayout, tokenizer, train_offset: int = 0,
               valid_consumed: int = 0):
    """Train, validation and test iterator factories (consumed_samples -> iterator of
    microbatches; None for a split without data). Rank 0 builds the index caches first; the others
    then load them. A resumed run's streams start where the checkpoint's stopped: `train_offset`
    more training samples than the batch schedule counts, `valid_consumed` validation samples
    read, so each split is built long enough to go on from there without wrapping."""
    from megatron_2bw.data.builder import build_pretraining_datasets
    from megatron_2bw.data.samplers import build_data_iterator
    train = config.training
    evaluations = train.train_iters // train.eval_interval + 1
    counts = (batch_schedule(train).consumed(train.train_iters) + train_offset,
              valid_consumed + evaluations * train.eval_iters * train.global_batch_size,
              train.eval_iters * train.global_batch_size)
    datasets = None
    for building_rank in (True, False):
        if (layout.rank == 0) == building_rank:
            datasets = build_pretraining_datasets(config, tokenizer, counts)
        if layout.world_size > 1:
            dist.barrier()

    def factory(dataset):
        if dataset is None:
            return None
        return lambda consumed: build_data_iterator(dataset, consumed, train.micro_batch_size,
                                                    layout.sample_rank, layout.data_replicas,
                                                    config.data.num_workers)
    return tuple(factory(dataset) for dataset in datasets)


def _check_writable(flag: str, path: str, directory: bool) -> None:
    """`path` can be written, or created: its nearest existing ancestor is a writable directory."""
    target = os.path.abspath(path)
    if os.path.islink(target) and not os.path.exists(target):
        raise ConfigError(f"{flag} {path}: a symbolic link to nothing")
    if os.path.exists(target):
        if os.path.isdir(target) != directory:
            raise ConfigError(f"{flag} {path}: exists and is {'not ' if directory else ''}a "
                              f"directory")
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{flag} {path}: not writable")
        return
    ancestor = os.path.dirname(target)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot be created ({ancestor} is not a writable "
                          f"directory)")


def check_inputs(config: Config) -> None:
    """What the flags name on disk, checked on every rank before any process group or model
    exists, so that a mistake ends the job with one line naming the flag (ConfigError), not a
    traceback after start-up or an unwritable --save after the first interval of training."""
    from megatron_2bw.data.builder import check_data_flags
    from megatron_2bw.data.tokenizers import tokenizer_files
    check_data_flags(config.data)
    for field, _ in tokenizer_files(config.data.tokenizer_type):
        path = getattr(config.data, field)
        if path and os.path.exists(path):  # as the checkpoint records it: usable from any folder
            setattr(config.data, field, os.path.abspath(path))
    for flag, path, directory in (("--save", config.checkpoint.save, True),
                                  ("--tensorboard-dir", config.logging.tensorboard_dir, True),
                                  ("--log-file", config.logging.log_file, False)):
        if path:
            _check_writable(flag, path, directory)
    par = config.parallel
    if par.auto_parallel and par.planner_hardware != "local":
        from megatron_2bw.planner.hardware import load_hardware
        try:
            load_hardware(par.planner_hardware)
        except (ValueError, FileNotFoundError) as error:
            raise ConfigError(f"--planner-hardware: {error}") from None


def build_checked_tokenizer(config: Config):
    """The run's tokenizer; a tokenizer the flags cannot build, a BERT run's tokenizer without
    BERT's special tokens, or one without an end-of-document token where the GPT data flags need
    it, is a ConfigError naming the flags."""
    from megatron_2bw.data.bert_dataset import BertSpecialTokens
    from megatron_2bw.data.tokenizers import build_tokenizer
    kind = config.data.tokenizer_type
    try:
        tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        if config.model.model_type == "bert" and not config.data.mock_data:
            BertSpecialTokens.from_tokenizer(tokenizer)  # BERT samples need [CLS], [SEP], ...
    except Exception as error:  # noqa: BLE001 - the tokenizer libraries raise plain Exception
        message = str(error).strip() or type(error).__name__
        raise ConfigError(message if message.startswith("--") or kind is None
                          else f"--tokenizer-type {kind}: {message}") from None
    if config.data.uses_document_boundaries and not tokenizer.has("eod"):
        raise ConfigError(f"--eod-mask-loss, --reset-position-ids and --reset-attention-mask need "
                          f"an end-of-document token, which {tokenizer.name} lacks "
                          f"(--tokenizer-type {kind})")
    return tokenizer
