"""The analytic profile (`AnalyticProfile`), for hardware not at hand. Every kernel is either a
matmul or memory-bound, and every launch costs a fixed overhead:
    time = matmul FLOPs / (peak_flops * efficiency) + bytes moved / (memory_bandwidth * efficiency)
           + kernels * kernel_overhead_s
with the hardware's stated `efficiency`, except that each of a layer's four linears is a GEMM on
the roofline: the longer of its FLOPs at the matmul rate and its operands' bytes at the memory
rate. Where the hardware file gives measured rates, a GEMM's matmul rate is the share of peak
measured for a GEMM of its size (`HardwareSpec.gemm_efficiency`) and the fused attention kernel
runs at `attention_efficiency`, computing half the scores under GPT's causal mask (it skips the
blocks above the diagonal). Assumptions:
- matmul FLOPs per layer forward: 2bsh(q + ad + f1 + f)/t for the four linears
  (`linear_flops_per_token`), where ad is the attention's width, a heads of d channels
  (config.attention_size: h unless --kv-channels sets d), q the QKV projection's output features
  (config.qkv_size: 3ad, less with grouped-query attention) and f1 fc1's (f, or 2f with SwiGLU's
  fused gate and up): 2bs(4h^2 + 2hf)/t for GPT-2's layout; and 4bs^2ad/t for the attention
  scores and their product with V (`attention_flops_per_token`; causal masking is not credited:
  PyTorch's math path computes the full square; grouped-query attention repeats k and v to every
  head first, so it saves nothing here); backward does twice the forward's matmul FLOPs.
- memory traffic: each element-wise kernel reads and writes its tensors once (the norms one fused
  kernel each, RMSNorm on a CPU several fp32 kernels, with --qk-layernorm also over this rank's q
  and k; the row-parallel bias add unless --disable-bias-linear, dropout + residual, GELU or
  SwiGLU's silu and product, k and v repeated for grouped-query attention, rotary embeddings on q
  and k, the layout copies around attention, the softmax chain over the b*a*s*s
  scores (in fp32, with casts to it and back, under --attention-softmax-in-fp32 with fp16/bf16:
  Megatron-LM's unfused attention; a fused kernel, memory.fused_attention, moves only q, k, v,
  its output and a log-sum-exp per row), the fp32 cross entropy over the vocabulary); the
  backward moves twice the forward's bytes. The norms and the residual path are replicated over
  the tensor-parallel group (not divided by t), except under --sequence-parallel, where each rank
  runs them (and the embedding's position add and dropout) on its s/t tokens; the layout copies
  beside the sequence's gathers and reduce-scatters (micro-batches over 1) count as part of the
  collectives (cost.py).
- every microbatch's weight gradients are added into the accumulation buffer (read two buffers,
  write one), and the embedding's dense gradient is first written in full: memory-bound traffic
  proportional to the piece's parameters, counted from the model code (memory.stage_parameters).
- kernels are counted per piece from the model code (about 86 per layer forward and backward in
  GPT-2's layout; an accumulation per parameter tensor);
  `kernel_overhead_s` (5 us in the shipped files) stands for launch latency and the last partial
  wave of thread blocks.
These fixed costs per microbatch make small micro batches (and narrow tensor-parallel shards) less
efficient.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_2bw.config import ModelConfig, PrecisionConfig
from megatron_2bw.planner.hardware import HardwareSpec
from megatron_2bw.planner.memory import (MASK_BYTES, dtype_bytes, fused_attention,
                                         grad_buffer_bytes, layer_activation_bytes,
                                         stage_parameter_tensors, stage_parameters,
                                         unfused_attention)
from megatron_2bw.planner.profile import ComputeCosts, attention_flops_per_token


@dataclass(frozen=True)
class _Work:
    """Matmul FLOPs, bytes moved by memory-bound kernels, kernels launched, GEMMs timed on their
    own roofline: (FLOPs, bytes of their operands, how many) each, and the fused attention
    kernel's FLOPs (timed at its own measured rate)."""
    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0
    gemms: tuple[tuple[float, float, float], ...] = ()
    attention_flops: float = 0.0

    def __add__(self, other: "_Work") -> "_Work":
        return _Work(self.flops + other.flops, self.bytes + other.bytes,
                     self.kernels + other.kernels, self.gemms + other.gemms,
                     self.attention_flops + other.attention_flops)

    def __mul__(self, factor: float) -> "_Work":
        return _Work(self.flops * factor, self.bytes * factor, self.kernels * factor,
                     tuple((f, b, n * factor) for f, b, n in self.gemms),
                     self.attention_flops * factor)


def gemm(rows: float, inner: float, columns: float, element_bytes: int) -> _Work:
    """One [rows x inner] @ [inner x columns] product: 2 rows inner columns FLOPs, its operands
    and result read and written once (a kernel; its backward's two products have the same FLOPs
    and operand bytes)."""
    return _Work(kernels=1, gemms=((2.0 * rows * inner * columns,
                                    element_bytes * (rows * inner + inner * columns
                                                     + rows * columns), 1.0),))


class AnalyticProfile:
    def __init__(self, model: ModelConfig, precision: PrecisionConfig, hardware: HardwareSpec):
        self.model, self.precision, self.hardware = model, precision, hardware
        self.e = dtype_bytes(precision)
        self.g = grad_buffer_bytes(precision)
        self.peak_flops = hardware.flops_for(precision.working_dtype_name)
        self.flops_per_s = self.peak_flops * hardware.efficiency
        self.attention_flops_per_s = self.peak_flops * (
            hardware.attention_efficiency if hardware.attention_efficiency is not None
            else hardware.efficiency)
        self.bytes_per_s = hardware.memory_bandwidth * hardware.efficiency

    def seconds(self, work: _Work) -> float:
        """FLOPs at the attainable rate, memory-bound bytes at the bandwidth, and each GEMM on
        the roofline: bound by its FLOPs or by its operands' bytes, whichever takes longer, so a
        GEMM of few rows (a small micro batch) or a narrow one (a small hidden size, a large t)
        runs below the peak, as measured GPUs do."""
        gemms = sum(n * max(f / (self.peak_flops * self.hardware.gemm_efficiency(f)),
                            b / self.bytes_per_s) for f, b, n in work.gemms)
        return (work.flops / self.flops_per_s + work.bytes / self.bytes_per_s + gemms
                + work.attention_flops / self.attention_flops_per_s
                + work.kernels * self.hardware.kernel_overhead_s)

    def layer_gemms(self, t: int, b: int) -> _Work:
        """The four linears of a layer on one rank of t: QKV (h to qkv/t), the dense projection
        (attention width/t to h), fc1 (h to f1/t), fc2 (f/t to h), each over all s b tokens."""
        m, e = self.model, self.e
        sb, h = m.seq_length * b, m.hidden_size
        fc1 = 2 * m.ffn_hidden_size if m.swiglu else m.ffn_hidden_size
        return (gemm(sb, h, m.qkv_size / t, e) + gemm(sb, m.attention_size / t, h, e)
                + gemm(sb, h, fc1 / t, e) + gemm(sb, m.ffn_hidden_size / t, h, e))

    # per-piece work, one microbatch of b on one rank of t
    def attention_core(self, t: int, b: int) -> _Work:
        m, e = self.model, self.e
        scores = m.num_attention_heads * m.seq_length ** 2 * b / t
        flops = b * m.seq_length * attention_flops_per_token(m) / t
        if fused_attention(m, e, self.hardware.device_type):
            # one kernel: q, k and v read, the output and a log-sum-exp per row written; the
            # scores stay on chip; under GPT's causal mask (is_causal) it skips the blocks above
            # the diagonal, half the square
            rows = m.num_attention_heads * m.seq_length * b / t
            causal = 0.5 if m.model_type == "gpt" else 1.0
            return _Work(0.0, 4 * e * m.seq_length * b * m.attention_size / t + 4 * rows, 1,
                         attention_flops=causal * flops)
        if not unfused_attention(m, e):
            # write scores, mask, softmax, dropout (+ its mask), read for the product with V: q
            # and k scaling, two batched matmuls and four element-wise kernels
            return _Work(flops, (8 * e + MASK_BYTES) * scores, 8)
        # softmax_in_fp32_attention: baddbmm writes the scores (e), cast to fp32 (e + 4), scaled
        # by the layer's coefficient (8), masked (8), softmax (8), cast back (4 + e), dropout
        # (2e + mask) if any, read for the product with V (e); q and k made batch-contiguous,
        # two batched matmuls, five element-wise kernels, the mask's (GPT's causal one built:
        # ones, tril, invert; BERT's inverted) and the dropout's
        dropout = m.attention_dropout > 0
        mask_kernels = 1 if m.model_type == "bert" else 3
        return _Work(flops, (32 + 4 * e + dropout * (2 * e + MASK_BYTES)) * scores,
                     9 + mask_kernels + dropout)

    def norm(self, elements: float) -> _Work:
        """One norm over `elements`: torch's fused layer_norm or rms_norm, one kernel (read,
        write); but RMSNorm on a CPU as the model code runs it there in fp32: pow (8 bytes per
        element), mean (4), eps and rsqrt, multiply (8), the weight (2e), and in half precision
        the casts to fp32 and back (4 + e each). Under --apply-layernorm-1p one more kernel adds
        1 to the (tiny) weight."""
        e, m = self.e, self.model
        if m.normalization == "LayerNorm" or self.hardware.device_type != "cpu":
            return _Work(0.0, 2 * e * elements, 1 + m.apply_layernorm_1p)
        casts = 0 if e == 4 else 2
        return _Work(0.0, (20 + 2 * e + casts * (4 + e)) * elements,
                     6 + casts + m.apply_layernorm_1p)

    def attention_layout(self, t: int, b: int) -> _Work:
        """What ParallelAttention.project_qkv does besides views, per layer: with grouped-query
        attention k and v repeated to every query head (read a group, write its heads) and q
        copied out of several groups; with rotary embeddings q and k rotated (negate, concatenate,
        two products, a sum: ~10e per rotated element, 5 kernels each, plus a concatenation when
        only some channels rotate and the tables' casts in half precision)."""
        m, e = self.model, self.e
        # widths of all queries and of k (or v) before it is repeated
        sb, q_width, kv_width = m.seq_length * b, m.attention_size, m.query_groups * m.head_dim
        work = _Work()
        if m.query_groups != m.num_attention_heads:  # k and v repeated to every query head
            q_copy = 2 * q_width if m.query_groups > t else 0
            work += _Work(0.0, e * sb * (2 * (kv_width + q_width) + q_copy) / t, 2 + bool(q_copy))
        if m.position_embedding_type == "rope":
            partial = m.rotary_percent < 1
            per_tensor = 5 + partial + (0 if e == 4 else 2)
            per_element = 10 * m.rotary_percent + 2 * partial
            work += _Work(0.0, e * sb * (q_width + kv_width) * per_element / t, 2 * per_tensor)
        return work

    def layer_forward(self, t: int, b: int) -> _Work:
        m, e = self.model, self.e
        h, f, sb = m.hidden_size, m.ffn_hidden_size, m.seq_length * b
        attention_width = m.attention_size  # of q, k repeated to every head, and the context
        # replicated: 2 x (bias if any, dropout + mask, residual) (2e + 2e + 1 + 3e each); the
        # column-parallel biases are added inside their matmuls; s/t tokens of them (and of the
        # norms) under --sequence-parallel
        row_bias = 2 * e if m.add_bias_linear else 0
        local_sbh = sb * h / m.sequence_ranks(t)
        replicated = 2 * (row_bias + 5 * e + MASK_BYTES) * local_sbh
        # sharded: q/k copies for the core (scaled, or batch-contiguous for the unfused one) and
        # the context layout copy (6e), GELU over f (2e) or SwiGLU's silu (2e) and product (3e)
        sharded = (6 * e * sb * attention_width + (5 if m.swiglu else 2) * e * sb * f) / t
        # kernels besides the linears (layer_gemms), the core and the norms: 2 x (bias, dropout,
        # residual), GELU (or silu and product), the layout copy
        kernels = 2 * (2 + m.add_bias_linear) + (2 if m.swiglu else 1) + 1
        work = (self.layer_gemms(t, b) + _Work(0.0, replicated + sharded, kernels)
                + self.norm(local_sbh) * 2 + self.attention_layout(t, b)
                + self.attention_core(t, b))
        if m.qk_layernorm:  # over this rank's queries and keys, the whole sequence
            work += self.norm(sb * attention_width / t) + \
                self.norm(sb * m.query_groups * m.head_dim / t)
        return work

    def weight_gradient_accumulation(self, parameters: float, tensors: int) -> _Work:
        return _Work(0.0, (self.e + 2 * self.g) * parameters, tensors)

    def _accumulation(self, t: int, layers: int, first: bool, last: bool) -> _Work:
        """weight_gradient_accumulation of a piece's parameters, counted from the model code."""
        return self.weight_gradient_accumulation(
            stage_parameters(self.model, t, layers, first, last),
            stage_parameter_tensors(self.model, t, layers, first, last))

    def layer_backward(self, t: int, b: int) -> _Work:
        # twice the forward, plus the weight-gradient matmuls and the linears' bias reductions
        # (8 kernels with biases) and the accumulation of the layer's parameter tensors
        m = self.model
        biases = 4 if m.add_bias_linear else int(m.add_qkv_bias)
        return self.layer_forward(t, b) * 2 + _Work(kernels=4 + biases) + \
            self._accumulation(t, 1, False, False)

    def _vocab_shard(self, t: int) -> int:
        return self.model.padded_vocab_size(t) // t

    def embedding_forward(self, t: int, b: int) -> _Work:
        # gather rows (2e), add learned positions (gather and add: 4e, 2 kernels), dropout (2e +
        # mask); the last two on s/t tokens under --sequence-parallel
        m, e = self.model, self.e
        positions = m.position_embedding_type == "learned_absolute"
        local = ((6 if positions else 2) * e + MASK_BYTES) / m.sequence_ranks(t)
        return _Work(0.0, (2 * e + local) * m.seq_length * b * m.hidden_size,
                     4 if positions else 2)

    def embedding_backward(self, t: int, b: int) -> _Work:
        tables = stage_parameters(self.model, t, 0, True, False)
        # the dense tables' gradient is written (e), then accumulated
        return self.embedding_forward(t, b) + _Work(0.0, self.e * tables, 1) + \
            self._accumulation(t, 0, True, False)

    def _loss_forward(self, t: int, b: int) -> _Work:
        """The vocabulary-parallel cross entropy, in fp32 chunks: max (e), cast (e + 4), shift
        (8), exp (8), sum (4) per logit; about 5 kernels."""
        m = self.model
        return _Work(0.0, (2 * self.e + 24) * m.seq_length * b * self._vocab_shard(t), 5)

    def _head_body(self, t: int, b: int) -> _Work:
        """Final norm and logits (and BERT's LM transform: linear, GELU, LayerNorm)."""
        m, e = self.model, self.e
        sb, h = m.seq_length * b, m.hidden_size
        work = _Work(2 * sb * h * self._vocab_shard(t), 0.0, 1) + self.norm(sb * h)
        if m.model_type == "bert":
            work += _Work(2 * sb * h * h, 6 * e * sb * h, 3)
        return work

    def head_forward(self, t: int, b: int) -> _Work:
        return self._head_body(t, b) + self._loss_forward(t, b)

    def head_backward(self, t: int, b: int) -> _Work:
        m, v = self.model, self._vocab_shard(t)
        # the loss gradient: scaled in place and cast to the working dtype (3 kernels)
        loss = _Work(0.0, (12 + self.e) * m.seq_length * b * v, 3)
        return loss + self._head_body(t, b) * 2 + self._accumulation(t, 0, False, True)

    def costs(self, tensor_parallel: int, micro_batch_size: int) -> ComputeCosts:
        t, b, s = tensor_parallel, micro_batch_size, self.seconds
        return ComputeCosts(
            layer_forward_s=s(self.layer_forward(t, b)),
            layer_backward_s=s(self.layer_backward(t, b)),
            attention_core_forward_s=s(self.attention_core(t, b)),
            embedding_forward_s=s(self.embedding_forward(t, b)),
            embedding_backward_s=s(self.embedding_backward(t, b)),
            head_forward_s=s(self.head_forward(t, b)),
            head_backward_s=s(self.head_backward(t, b)),
            layer_activation_bytes=layer_activation_bytes(self.model, t, b, self.e,
                                                          device_type=self.hardware.device_type),
            selective_layer_activation_bytes=layer_activation_bytes(
                self.model, t, b, self.e, selective=True, device_type=self.hardware.device_type))
