"""Fine-tune a pretrained BERT checkpoint on one GLUE task and report the task's official metrics.

The checkpoint (any tensor/pipeline layout of `pretrain_bert.py --save`) is read unsharded and cut
for this run's tensor-parallel size; its masked-LM and sentence-order heads are dropped and a
classification (STS-B: regression) head is trained on the encoder (models/classification.py).
Model and tokenizer flags the user leaves unset come from the checkpoint's saved configuration.

Training is plain data- and tensor-parallel (world = t x d, no pipeline): each step takes a global
batch of --global-batch-size examples (default --micro-batch-size x d) in Megatron's sample order,
accumulates micro-batches, averages gradients over the data-parallel replicas, clips by the global
norm and steps AdamW with linear warm-up and decay. --bf16 and --fp16 run the model under autocast
(fp16 with loss scaling). After every epoch each dev split is evaluated and the results file
(glue.format_results_table reads it) is rewritten. With a test-predictions directory the final
model then predicts every test split and writes the files the GLUE benchmark server takes
(glue.submission_tsv), for MNLI also GLUE's diagnostic set (AX.tsv) when given; the test files are
read before training, so a bad one fails at once.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from tqdm import tqdm

from megatron_2bw.arguments import ConfigError, config_from_args
from megatron_2bw.checkpoint.reshard import read_full_state, shard_of
from megatron_2bw.checkpoint.save_load import METADATA_FILE, iteration_dir, read_metadata
from megatron_2bw.checkpoint.tool_config import check_architecture_flags
from megatron_2bw.config import Config, DataConfig
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.distributed.comm import all_reduce, group_size
from megatron_2bw.distributed.layout import ParallelLayout
from megatron_2bw.evaluation.glue import (DIAGNOSTIC_SUBMISSION_FILE, DIAGNOSTIC_TASK, Example,
                                          GlueTask, build_features, get_task, read_diagnostic,
                                          read_task, read_task_from_datasets_dir, submission_tsv,
                                          task_metrics)
from megatron_2bw.models.classification import (OPTIONAL_PREFIXES, BertClassifier,
                                                build_classifier, pretrained_name)
from megatron_2bw.optim.grad_scaler import build_loss_scaler
from megatron_2bw.optim.lr_schedule import apply_schedule
from megatron_2bw.optim.muon import Muon, WholeMatrices
from megatron_2bw.optim.optimizer import build_torch_optimizer
from megatron_2bw.tensor_parallel.layers import sum_tensor_partial_grads
from megatron_2bw.tensor_parallel.random import seed_everything
from megatron_2bw.training.progress import print_rank0
from megatron_2bw.training.startup import setup

TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
DEFAULT_WARMUP_FRACTION = 0.1
AUTOCAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class GlueSettings:
    """What fine-tuning needs beyond the shared pretraining flags."""
    task: str
    data_dir: str | None = None  # the task's directory of the GLUE distribution (TSV files)
    datasets_dir: str | None = None  # or a local Hugging Face `datasets` copy of the task
    results: str | None = None  # JSON results file
    epochs: int = 3
    lr_warmup_fraction: float | None = None  # of all steps; None: --lr-warmup-iters (or 0.1)
    test_predictions: str | None = None  # directory for the GLUE server's test prediction files
    # GLUE's diagnostic set (glue.read_diagnostic), predicted into test_predictions/AX.tsv
    diagnostic_data: str | None = None

    def __post_init__(self):
        task = get_task(self.task)  # an unknown task fails here, with the list of known ones
        if (self.data_dir is None) == (self.datasets_dir is None):
            raise ConfigError("give exactly one of --data-dir (GLUE .tsv files of the task) and "
                              "--datasets-dir (a local Hugging Face datasets copy of the task)")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be a positive integer, got {self.epochs}")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1), got "
                              f"{self.lr_warmup_fraction}")
        if self.test_predictions is not None and os.path.isfile(self.test_predictions):
            raise ConfigError(f"--test-predictions names a directory for the prediction files; "
                              f"{self.test_predictions} is a file")
        if self.diagnostic_data is not None:
            if task.name != DIAGNOSTIC_TASK:
                raise ConfigError(f"--diagnostic-data (GLUE's diagnostic set AX) is predicted with "
                                  f"the {DIAGNOSTIC_TASK} model: it needs --task "
                                  f"{DIAGNOSTIC_TASK}, not --task {self.task}")
            if self.test_predictions is None:
                raise ConfigError(f"--diagnostic-data writes {DIAGNOSTIC_SUBMISSION_FILE} with the "
                                  f"test predictions: it needs --test-predictions DIR")

    @property
    def source(self) -> str:
        return self.data_dir if self.data_dir is not None else self.datasets_dir


# -- the pretrained checkpoint -------------------------------------------------------------------

@dataclass
class PretrainedBert:
    root: str
    iteration: int
    config: Config  # as saved by pretraining


def open_pretrained(root: str) -> PretrainedBert:
    """The latest checkpoint in `root`; refuses anything but a BERT model."""
    metadata = read_metadata(root)
    iteration = metadata["iteration"]
    config = Config.from_dict(metadata["config"])
    if config.model.model_type != "bert":
        path = os.path.join(iteration_dir(root, iteration), METADATA_FILE)
        raise ConfigError(f"{path}: the checkpoint holds a {config.model.model_type!r} model; GLUE "
                          f"fine-tuning needs a BERT checkpoint (pretrain_bert.py --save)")
    return PretrainedBert(root, iteration, config)


def finetune_config(args, pretrained: PretrainedBert) -> Config:
    """The command line over the checkpoint's model and tokenizer settings (all else: the flags or
    their defaults, not the pretraining run's learning rate, batch sizes or precision)."""
    saved = pretrained.config
    check_architecture_flags(args, saved, f"checkpoint {pretrained.root}")
    base = Config(model=copy.deepcopy(saved.model),
                  data=DataConfig(**{f: getattr(saved.data, f) for f in TOKENIZER_FIELDS}))
    config = config_from_args(args, "bert", base=base, require_data=False)
    if config.training.train_samples is not None:
        raise ConfigError("fine-tuning runs --epochs over the task's training set; --train-samples "
                          "does not apply")
    par = config.parallel
    if par.pipeline_parallel != 1 or par.auto_parallel:
        raise ConfigError(f"fine-tuning runs without pipeline parallelism or --auto-parallel: use "
                          f"--tensor-model-parallel-size and data parallelism (got "
                          f"--pipeline-model-parallel-size {par.pipeline_parallel})")
    return config


@torch.no_grad()
def load_pretrained_encoder(model: BertClassifier, pretrained: PretrainedBert) -> list[str]:
    """Copy this rank's shard of every pretrained weight into `model`; returns the names of the
    parameters that keep their fresh initialisation (the classifier; the pooler if absent)."""
    state = read_full_state(pretrained.root, pretrained.iteration, with_optimizer=False)
    fresh = []
    for name, param in model.named_parameters():
        source = pretrained_name(name)
        if source is None or source not in state.model:
            if name.startswith(OPTIONAL_PREFIXES):
                fresh.append(name)
                continue
            raise ConfigError(f"checkpoint {pretrained.root} (iteration {pretrained.iteration}) "
                              f"has no parameter {source}, which the BERT encoder needs")
        spec = param.spec
        param.copy_(shard_of(state.model[source], source, spec.full_shape, spec.partition_dim,
                             spec.tp_rank, spec.tp_size))
    return fresh


# -- task data -----------------------------------------------------------------------------------

@dataclass
class SubmissionSplit:
    """A test split (or the diagnostic set), predicted for the GLUE server's submission files."""
    indices: list[int]  # each example's index in the test file, for the submission file
    features: dict[str, np.ndarray]


@dataclass
class TaskData:
    train: dict[str, np.ndarray]  # build_features arrays
    dev: dict[str, dict[str, np.ndarray]]  # split name -> features
    # submission file name (MNLI-m.tsv, AX.tsv, ...) -> examples; read only for --test-predictions
    test: dict[str, SubmissionSplit]


def _nonempty(examples: list[Example], what: str) -> list[Example]:
    if not examples:
        raise ValueError(f"{what} has no examples")
    return examples


def load_task_data(task: GlueTask, settings: GlueSettings, tokenizer, seq_length: int) -> TaskData:
    def examples(split: str) -> list[Example]:
        if settings.data_dir is not None:
            read = read_task(task.name, settings.data_dir, split)
        else:
            read = read_task_from_datasets_dir(task.name, settings.datasets_dir, split)
        return _nonempty(read, f"{settings.source}: the {split} split of {task.name}")

    def features(split: str) -> dict[str, np.ndarray]:
        return build_features(examples(split), tokenizer, seq_length)

    def submission(read: list[Example]) -> SubmissionSplit:
        return SubmissionSplit([example.index for example in read],
                               build_features(read, tokenizer, seq_length))

    data = TaskData(features("train"), {split: features(split) for split in task.dev_splits}, {})
    if settings.test_predictions is not None:
        data.test = {task.submission_file(split): submission(examples(split))
                     for split in task.test_splits}
    if settings.diagnostic_data is not None:
        data.test[DIAGNOSTIC_SUBMISSION_FILE] = submission(_nonempty(
            read_diagnostic(settings.diagnostic_data),
            f"{settings.diagnostic_data}: the diagnostic set (AX)"))
    return data


def _batch(features: dict[str, np.ndarray], indices, device) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(features[key][indices]).to(device)
            for key in ("text", "types", "padding_mask", "label")}


# -- training ------------------------------------------------------------------------------------

class ClassifierTrainer:
    """One rank's model, optimizer and loss scaler, and its share of every global batch."""

    def __init__(self, config: Config, layout: ParallelLayout, device: torch.device,
                 model: BertClassifier):
        self.config, self.layout, self.device, self.model = config, layout, device, model
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        for p in self.params:  # every gradient exists from the start (norms, all-reduces)
            p.grad = torch.zeros_like(p)
        self.optimizer = build_torch_optimizer(self.params, config.optimizer,
                                               [name for name, _ in named])
        if isinstance(self.optimizer, Muon):  # orthogonalise whole matrices, not t-shards
            self.optimizer.whole_matrices = WholeMatrices(layout.group("tensor"))
        self.scaler = build_loss_scaler(config.precision)
        # outside fp16 (whose loss scaler skips overflows) a non-finite norm stops the job
        self.stop_on_nonfinite_norm = config.training.check_for_nan_in_loss_and_grad and \
            not config.precision.fp16
        dtype = AUTOCAST_DTYPES.get(config.precision.working_dtype_name)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else nullcontext
        train = config.training
        self.micro = train.micro_batch_size
        self.accumulation = train.global_batch_size // (self.micro * layout.data)

    def microbatches(self, batch_indices: np.ndarray) -> list[np.ndarray]:
        """This rank's micro-batches of a global batch (Megatron's order: micro-batch j of
        data-parallel rank r holds examples j*micro*d + r*micro ...)."""
        d, r = self.layout.data, self.layout.coords.dp
        starts = (j * self.micro * d + r * self.micro for j in range(self.accumulation))
        return [batch_indices[s:s + self.micro] for s in starts]

    def step(self, features: dict[str, np.ndarray], batch_indices: np.ndarray,
             step: int) -> tuple[float, bool]:
        """One optimizer step on a global batch; returns (this rank's mean loss, skipped)."""
        self.model.train()
        scale, loss_sum = self.scaler.scale, 0.0
        for indices in self.microbatches(batch_indices):
            batch = _batch(features, indices, self.device)
            with self.autocast():
                logits = self.model(batch)
            loss = self.model.loss(logits, batch["label"]) / self.accumulation
            (loss * scale).backward()
            loss_sum += loss.item()
        sum_tensor_partial_grads([p.grad for p in self.params], [p.spec for p in self.params],
                                 self.layout.group("tensor"))
        self._average_over_replicas()
        grad_norm = self._grad_norm() / scale
        skipped = not math.isfinite(grad_norm)  # fp16 overflow: the same verdict on every rank
        if skipped and self.stop_on_nonfinite_norm:
            raise FloatingPointError(
                f"rank {self.layout.rank}: the gradient norm of fine-tuning step {step + 1} is "
                f"{grad_norm}: a NaN or infinity in the gradients (--check-for-nan-in-loss-and-grad"
                f" is on; --no-check-for-nan-in-loss-and-grad would skip such steps instead)")
        if not skipped:
            coefficient = 1.0 / scale
            clip = self.config.optimizer.clip_grad
            if clip > 0 and grad_norm > clip:
                coefficient *= clip / (grad_norm + 1e-6)
            for p in self.params:
                p.grad.mul_(coefficient)
            apply_schedule(self.optimizer.param_groups, step, self.config.optimizer,
                           self.config.training)
            self.optimizer.step()
        self.scaler.update(skipped)
        self.optimizer.zero_grad(set_to_none=False)
        return loss_sum, skipped

    @torch.no_grad()
    def _average_over_replicas(self) -> None:
        group = self.layout.group("data")
        if group_size(group) == 1:
            return
        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        all_reduce(flat, group, op=dist.ReduceOp.AVG)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    @torch.no_grad()
    def _grad_norm(self) -> float:
        """Global L2 norm: sharded gradients summed over the tensor-parallel group, replicated ones
        (identical on every tensor-parallel rank) counted once."""
        squares = torch.zeros(2, dtype=torch.float64, device=self.device)
        for p in self.params:
            squares[int(p.spec.replicated)] += p.grad.double().pow(2).sum()
        sharded = squares[:1].clone()
        all_reduce(sharded, self.layout.group("tensor"))
        return math.sqrt(float(sharded[0] + squares[1]))

    @torch.no_grad()
    def predict(self, features: dict[str, np.ndarray]) -> np.ndarray:
        """Predictions for every example; the data-parallel replicas share the work."""
        self.model.eval()
        count, d = len(features["label"]), self.layout.data
        per_rank = -(-count // d)
        first = self.layout.coords.dp * per_rank
        mine = np.arange(first, min(first + per_rank, count))
        local = torch.zeros(per_rank, dtype=torch.float32, device=self.device)
        for start in range(0, len(mine), self.micro):
            chunk = mine[start:start + self.micro]
            with self.autocast():
                logits = self.model(_batch(features, chunk, self.device))
            local[start:start + len(chunk)] = self.model.predictions(logits).float()
        group = self.layout.group("data")
        if group_size(group) > 1:
            gathered = [torch.empty_like(local) for _ in range(d)]
            dist.all_gather(gathered, local, group=group)
            local = torch.cat(gathered)
        predictions = local[:count].cpu().numpy()
        return predictions if self.model.is_regression else predictions.astype(np.int64)


# -- results -------------------------------------------------------------------------------------

def _write_atomically(path: str, text: str) -> None:
    """Write to a temporary name, then rename, so a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_results(path: str, results: dict) -> None:
    """Atomically: the file is rewritten after every epoch."""
    _write_atomically(path, json.dumps(results, indent=2) + "\n")


def write_test_predictions(trainer: ClassifierTrainer, task: GlueTask,
                           test: dict[str, SubmissionSplit], directory: str) -> list[str]:
    """Predict every entry of `test` (TaskData.test) with the trainer's model and write it as the
    GLUE server's file of that name (glue.submission_tsv, `task`'s labels) into `directory`, on
    rank 0; returns the paths. Every rank must call this: the data-parallel replicas share the
    predictions."""
    paths = []
    for file_name, data in test.items():
        predictions = trainer.predict(data.features)
        path = os.path.join(directory, file_name)
        if trainer.layout.rank == 0:
            _write_atomically(path, submission_tsv(task.name, data.indices, predictions))
        paths.append(path)
    return paths


def _mean_over_replicas(value: float, layout: ParallelLayout, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL: a device tensor
    all_reduce(tensor, layout.group("data"), op=dist.ReduceOp.AVG)
    return float(tensor[0])


def finetune(config: Config, settings: GlueSettings, pretrained: PretrainedBert) -> dict:
    """Fine-tune and evaluate after every epoch; returns the results (the --results JSON)."""
    task = get_task(settings.task)
    tokenizer = build_tokenizer(config.data, config.model.vocab_size)
    if tokenizer.vocab_size != config.model.vocab_size:
        raise ConfigError(f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} ids, but "
                          f"checkpoint {pretrained.root} was pretrained with vocab_size "
                          f"{config.model.vocab_size}: use the pretraining tokenizer flags")
    data = load_task_data(task, settings, tokenizer, config.model.seq_length)

    config, layout, device, _ = setup(config, typed=set())
    train = config.training
    examples = len(data.train["label"])
    steps_per_epoch = examples // train.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"{settings.source}: {task.name} has {examples} training examples, fewer "
                          f"than one --global-batch-size {train.global_batch_size}")
    train.train_iters = settings.epochs * steps_per_epoch
    if settings.lr_warmup_fraction is not None:
        config.optimizer.lr_warmup_fraction = settings.lr_warmup_fraction

    seed_everything(train.seed, layout.coords.tp, 0)
    model = build_classifier(config.model, layout.group("tensor"), layout.tensor,
                             task.num_classes, train.seed, config.recompute).to(device)
    fresh = load_pretrained_encoder(model, pretrained)
    trainer = ClassifierTrainer(config, layout, device, model)
    summary = (f" finetune {task.name}: {pretrained.root} (iteration {pretrained.iteration}); "
               f"newly initialised: {', '.join(fresh)}; {examples} training examples, "
               f"{settings.epochs} epochs of {steps_per_epoch} steps of {train.global_batch_size}; "
               f"world {layout.world_size} = t {layout.tensor} x d {layout.data}")
    print_rank0(layout, summary)

    results = {"task": task.name, "metric_names": list(task.metric_names), "load": pretrained.root,
               "epochs": []}
    step = 0
    for epoch in range(1, settings.epochs + 1):
        start = time.time()
        order = np.random.RandomState(train.seed + epoch).permutation(examples)
        losses, skipped = [], 0
        progress = tqdm(range(steps_per_epoch), desc=f"epoch {epoch}/{settings.epochs}",
                        unit="step", disable=layout.rank != 0)
        for i in progress:
            batch_indices = order[i * train.global_batch_size:(i + 1) * train.global_batch_size]
            loss, was_skipped = trainer.step(data.train, batch_indices, step)
            losses.append(loss)
            skipped += was_skipped
            step += 1
            progress.set_postfix(loss=f"{loss:.4f}")
        train_loss = _mean_over_replicas(sum(losses) / len(losses), layout, device)
        for split, features in data.dev.items():
            metrics = task_metrics(task.name, trainer.predict(features), features["label"])
            results["epochs"].append({"epoch": epoch, "split": split, "metrics": metrics,
                                      "train_loss": train_loss})
            text = " | ".join(f"{name}: {value:.4f}" for name, value in metrics.items())
            print_rank0(layout, f" epoch {epoch}/{settings.epochs} | {split} | {text} | train "
                                f"loss: {train_loss:.4f} | skipped steps: {skipped} | "
                                f"{time.time() - start:.1f} s")
        if settings.results and layout.rank == 0:
            write_results(settings.results, results)
    if settings.results:
        print_rank0(layout, f" wrote {settings.results}")
    if settings.test_predictions is not None:
        paths = write_test_predictions(trainer, task, data.test, settings.test_predictions)
        print_rank0(layout, f" wrote test predictions {', '.join(paths)}")
    return results
