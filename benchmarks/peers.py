"""The peers of the throughput benchmark: the same GPT, data and batch trained on 2 pipeline stages by
torch.distributed.pipelining (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B with two model
chunks per rank, ScheduleInterleavedZeroBubble with one: ZB-H1; ScheduleZBVZeroBubble and
ScheduleDualPipeV with two in a V) and by DeepSpeed's PipelineEngine.

The peers cannot run megatron_2bw's modules inside their runtimes as-is, so the model is rebuilt from
plain torch.nn modules computing the same function (pre-LayerNorm blocks, fused qkv rows ordered
(head, q/k/v, head_dim), exact GELU, learned positions, embeddings tied to the head), with parameter
names equal to ours, and its weights are copied from megatron_2bw's own initialisation: every run
starts from identical weights, so the first batch's loss must agree across all runs.

Each trainer builds its stage and exposes `run(first_batch, batches)`, `first_loss` and `batch_ends`
(batch -> perf_counter when this rank finished it); the harness (pipeline_throughput.py) does the
timing and memory measurement identically for every run.
"""
from __future__ import annotations

import contextlib
import io
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models import build_stage_model
from megatron_2bw.optim.optimizer import build_torch_optimizer

TIED_HEAD = "output_embedding"  # the last stage's copy of embedding.word_embeddings.weight


# -- the model, from plain torch.nn modules ------------------------------------------------------

class Embedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size(1), config.hidden_size)
        self.position_embeddings = nn.Parameter(
            torch.empty(config.max_position_embeddings, config.hidden_size))

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.word_embeddings(tokens) + F.embedding(positions, self.position_embeddings)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.transpose(1, 2)
                   for t in self.qkv(x).view(b, s, self.heads, 3, self.head_dim).unbind(dim=3))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(context.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_norm, self.post_attention_norm = nn.LayerNorm(h, eps), nn.LayerNorm(h, eps)
        self.attention, self.mlp = Attention(config), MLP(config)

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class Blocks(nn.Module):
    """Layers keyed by global index, so names read `layers.<i>....` as in megatron_2bw."""

    def __init__(self, config: ModelConfig, layers: range):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(config) for i in layers})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


class PlainGPTStage(nn.Module):
    """Layers [first, last) with, optionally, the embedding before and the final norm (and the
    tied head) after; tokens in on the first stage, logits out on the last."""

    def __init__(self, config: ModelConfig, layers: range, embedding: bool, final_norm: bool,
                 head: bool):
        super().__init__()
        self.embedding = Embedding(config) if embedding else None
        self.transformer = Blocks(config, layers)
        self.final_norm = (nn.LayerNorm(config.hidden_size, config.layernorm_epsilon)
                           if final_norm else None)
        self.output_embedding = (nn.Parameter(torch.empty(config.padded_vocab_size(1),
                                                          config.hidden_size)) if head else None)

    def forward(self, x):
        if self.embedding is not None:
            x = self.embedding(x)
        x = self.transformer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return F.linear(x, self.output_embedding) if self.output_embedding is not None else x


def megatron_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """megatron_2bw's initial weights of the whole model (they do not depend on the layout)."""
    model = build_stage_model(config, None, 1, range(config.num_layers), True, True, seed)
    return {name: p.detach() for name, p in model.named_parameters()}


@torch.no_grad()
def load_weights(module: nn.Module, weights: dict[str, torch.Tensor], prefix: str = "") -> None:
    for name, param in module.named_parameters():
        source = "embedding.word_embeddings.weight" if name == TIED_HEAD else prefix + name
        if source not in weights or weights[source].shape != param.shape:
            raise KeyError(f"no megatron_2bw weight {source!r} of shape {tuple(param.shape)}")
        param.copy_(weights[source])


def language_model_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_optimizer(module: nn.Module, workload):
    """The same AdamW (fp32, foreach, Megatron's weight-decay groups) as megatron_2bw uses."""
    return build_torch_optimizer([p for p in module.parameters()], workload.optimizer)


# -- torch.distributed.pipelining ----------------------------------------------------------------

# schedule name -> (torch.distributed.pipelining class, model chunks per rank)
TORCH_SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "gpipe": ("ScheduleGPipe", 1),
                   "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
                   "zero_bubble": ("ScheduleInterleavedZeroBubble", 1),
                   "zbv": ("ScheduleZBVZeroBubble", 2), "dualpipev": ("ScheduleDualPipeV", 2)}
V_SCHEDULES = ("zbv", "dualpipev")  # chunk 0 of rank r: stage r; chunk 1: stage 2 x world - 1 - r


class TorchPipeliningTrainer:
    """A torch.distributed.pipelining schedule on 2 ranks (TORCH_SCHEDULES). With chunks, chunk c of
    rank r is virtual stage c * 2 + r of equal layer counts, as in our interleaved schedule, or in
    a V (V_SCHEDULES) stage r for chunk 0 and 2 x 2 - 1 - r for chunk 1, as in ours. torch
    pipelining keeps no tied weights across stages, so the embedding/head gradients are summed
    (over both ranks, or on rank 0 under a V) and the gradients clipped over both ranks by hand
    here, as megatron_2bw and DeepSpeed do."""

    def __init__(self, workload, split: list[int], rank: int, world: int, schedule_name: str,
                 device: torch.device):
        from torch.distributed import pipelining
        config = workload.model
        self.workload, self.rank, self.device = workload, rank, device
        class_name, chunks = TORCH_SCHEDULES[schedule_name]
        self.v = schedule_name in V_SCHEDULES
        # the ranks holding the first and the last stage (a V: both on rank 0)
        self.first, self.last = rank == 0, rank == (0 if self.v else world - 1)
        if chunks == 1:
            start = sum(split[:rank])
            virtual = [rank]
            layers = [range(start, start + split[rank])]
        else:
            per_chunk = config.num_layers // (world * chunks)
            virtual = [rank, 2 * world - 1 - rank] if self.v else \
                [c * world + rank for c in range(chunks)]
            layers = [range(v * per_chunk, (v + 1) * per_chunk) for v in virtual]
        ends = [(v == 0, v == world * chunks - 1) for v in virtual]
        chunk_modules = [PlainGPTStage(config, layers[c], ends[c][0], ends[c][1], ends[c][1])
                         for c in range(chunks)]
        self.module = nn.ModuleList(chunk_modules).to(device)
        weights = megatron_weights(config, workload.seed)
        for chunk in chunk_modules:
            load_weights(chunk, weights)
        self.optimizer = build_optimizer(self.module, workload)
        stages = [pipelining.PipelineStage(chunk, virtual[c], world * chunks, device)
                  for c, chunk in enumerate(chunk_modules)]
        schedule_class = getattr(pipelining, class_name)
        # loss_fn on every rank: a rank without it waits forever in shape inference
        self.schedule = schedule_class(stages if class_name.startswith("ScheduleInterleaved")
                                       or self.v else stages[0], workload.microbatches,
                                       loss_fn=language_model_loss)
        self.tied = [module.embedding.word_embeddings.weight for module in chunk_modules
                     if module.embedding is not None] + \
            [module.output_embedding for module in chunk_modules
             if module.output_embedding is not None]
        self.first_loss: float | None = None
        self.batch_ends: dict[int, float] = {}

    def run(self, first_batch: int, batches: int) -> None:
        for b in range(first_batch, first_batch + batches):
            tokens = self.workload.batch_tokens(b).to(self.device)
            losses: list[torch.Tensor] = []
            inputs = (tokens[:, :-1],) if self.first else ()
            if self.last:
                self.schedule.step(*inputs, target=tokens[:, 1:], losses=losses)
            elif self.first:
                self.schedule.step(*inputs)
            else:
                self.schedule.step()
            if self.v:  # the embedding and its head copy both on rank 0: summed there
                if self.tied:
                    summed = self.tied[0].grad + self.tied[1].grad
                    for tied in self.tied:
                        tied.grad.copy_(summed)
            else:  # tied embedding: both copies take the summed gradient
                dist.all_reduce(self.tied[0].grad)
            head_copy = self.tied[-1] if self.last and self.tied else None
            squared = torch.stack([p.grad.pow(2).sum() for p in self.module.parameters()
                                   if p.grad is not None and p is not head_copy])
            total = squared.sum().reshape(1)
            dist.all_reduce(total)
            norm = float(total.sqrt())
            clip = self.workload.optimizer.clip_grad
            if clip > 0 and norm > clip:
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(clip / (norm + 1e-6))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
            self.batch_ends[b] = time.perf_counter()
            if b == 0 and self.last:
                self.first_loss = float(torch.stack(losses).detach().mean())


# -- DeepSpeed -----------------------------------------------------------------------------------

def _head_logits(embedding: Embedding, hidden):
    return F.linear(hidden, embedding.word_embeddings.weight)


class DeepSpeedTrainer:
    """PipelineEngine with a PipelineModule of four layers: [tied embedding, first stage's blocks,
    second stage's blocks + final norm, tied head]; the 'uniform' partition puts two on each stage,
    which is exactly the chosen layer split."""

    def __init__(self, workload, split: list[int], rank: int, world: int, device: torch.device):
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
        # skip compiling the shared-memory comm op (about 40 s on first use); gloo is used instead
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        # its loss broadcast backpropagates through c10d::broadcast_ and warns on every batch
        warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel")
        config = workload.model
        self.workload, self.device = workload, device
        first_layers = range(split[0])
        last_layers = range(split[0], config.num_layers)
        layers = [TiedLayerSpec("embedding", Embedding, config,
                                tied_weight_attr=["word_embeddings.weight"]),
                  LayerSpec(PlainGPTStage, config, first_layers, False, False, False),
                  LayerSpec(PlainGPTStage, config, last_layers, False, True, False),
                  TiedLayerSpec("embedding", Embedding, config, forward_fn=_head_logits,
                                tied_weight_attr=["word_embeddings.weight"])]
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its partition table
            module = PipelineModule(layers, num_stages=world, loss_fn=language_model_loss,
                                    partition_method="uniform", activation_checkpoint_interval=0)
        weights = megatron_weights(config, workload.seed)
        for tied in module.tied_modules.values():
            load_weights(tied, weights, "embedding.")
        for layer in module.forward_funcs:
            if isinstance(layer, PlainGPTStage):
                load_weights(layer, weights)
        module.to(device)
        ds_config = {
            "train_batch_size": workload.global_batch,
            "train_micro_batch_size_per_gpu": workload.micro_batch,
            "gradient_accumulation_steps": workload.microbatches,
            "gradient_clipping": workload.optimizer.clip_grad,
            "steps_per_print": 10 ** 9,
        }
        # a torch optimizer, not one in the JSON (that would select FusedAdam and compile it)
        self.engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                                    optimizer=build_optimizer(module, workload))
        self.first_loss: float | None = None
        self.batch_ends: dict[int, float] = {}

    def _microbatches(self, first_batch: int, batches: int):
        micro = self.workload.micro_batch
        for b in range(first_batch, first_batch + batches):
            tokens = self.workload.batch_tokens(b).to(self.device)
            for j in range(self.workload.microbatches):
                chunk = tokens[j * micro:(j + 1) * micro]
                yield chunk[:, :-1], chunk[:, 1:]

    def run(self, first_batch: int, batches: int) -> None:
        data = self._microbatches(first_batch, batches)
        for b in range(first_batch, first_batch + batches):
            loss = self.engine.train_batch(data_iter=data)
            self.batch_ends[b] = time.perf_counter()
            if b == 0:
                self.first_loss = float(loss)  # the engine broadcasts the batch mean to all stages
