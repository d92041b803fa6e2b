"""Training throughput of GPT on one GPU (t = p = d = 1, bf16, sequence 2048) against a peer of the
same shape, Hugging Face transformers' GPT-2 with SDPA attention and fused AdamW.

    python benchmarks/gpu_throughput.py                       # 125M, 350M, 1.3B, 2.7B
    python benchmarks/gpu_throughput.py --models 125M 1.3B --json results/gpu_throughput.json
    python benchmarks/gpu_throughput.py --tiny                # a CPU smoke run of every step

For each model: the largest micro batch that fits (doubling until out of memory), its tokens/s,
model TFLOP/s per GPU and MFU, eager and with --torch-compile; the peer likewise; our peak memory
against the planner's estimate (planner.memory.estimate_stage_memory); and one layer's forward and
backward time and activation memory for micro batch 1, 2, 4, 8, 16 against the planner's analytic
profile of the hardware file (--planner-hardware). Without transformers installed the peer is
skipped with one line.

Model FLOPs per token, in two conventions (no recomputation counted in either), for L layers of
width h, sequence s, vocabulary V:
    full attention:  6 N + 12 L s h,   N = 12 L h^2 + V h
    causal:          6 N +  6 L s h
6N: forward (2) and backward (4) FLOPs of every matmul weight (N counts the layers' four linears,
24 L h^2 / 2, and the output head V h; biases, norms and the embedding lookup are negligible);
12 L s h: the attention scores q k^T and their product with v, 4 s h per layer forward, x3. The
full count is PaLM's (Chowdhery et al. 2022, appendix B), the one torchtitan and Megatron-LM
report (training.model_flops_per_sample): it does not discount the causal mask. The causal count
keeps half of the s^2 attention work, what a causal kernel computes (at s = 2048 and GPT 1.3B
about 7% fewer FLOPs). MFU = tokens/s x FLOPs per token / peak, in each convention, the peak
being the device's dense bf16 tensor FLOP/s (PEAK_BF16_TFLOPS by the device's name, or
--peak-tflops).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_2bw.config import (Config, ModelConfig, OptimizerConfig, ParallelConfig,  # noqa: E402
                                 PrecisionConfig, TrainingConfig)
from megatron_2bw.distributed.layout import ParallelLayout  # noqa: E402
from megatron_2bw.planner.hardware import load_hardware  # noqa: E402
from megatron_2bw.planner.memory import estimate_stage_memory  # noqa: E402
from megatron_2bw.planner.analytic_profile import AnalyticProfile  # noqa: E402
from megatron_2bw.planner.profile import attention_flops_per_token  # noqa: E402
from megatron_2bw.training.progress import model_flops_per_sample  # noqa: E402
from megatron_2bw.training.segments import run_segment  # noqa: E402
from megatron_2bw.training.stage import build_stage  # noqa: E402

# GPT-3 paper's shapes (Brown et al. 2020, table 2.1): layers, hidden size, heads
MODELS = {"125M": (12, 768, 12), "350M": (24, 1024, 16), "1.3B": (24, 2048, 16),
          "2.7B": (32, 2560, 32)}
TINY = {"tiny": (2, 64, 4)}
# dense bf16 tensor-core peaks from NVIDIA's datasheets, by a part of torch.cuda.get_device_name;
# the first match wins
PEAK_BF16_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                    ("GH200", 989.4), ("A100", 312.0), ("L40S", 362.05), ("A10G", 70.0),
                    ("L4", 121.0))
LAYER_MICRO_BATCHES = (1, 2, 4, 8, 16)
GiB = 2.0 ** 30


def peak_tflops(device_name: str) -> float | None:
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in device_name:
            return tflops
    return None


def gpt_config(shape: tuple[int, int, int], seq: int, vocab: int, micro: int, microbatches: int,
               compiled: bool) -> Config:
    layers, hidden, heads = shape
    model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        seq_length=seq, max_position_embeddings=seq, vocab_size=vocab,
                        make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                        attention_dropout=0.0)
    return Config(model=model, parallel=ParallelConfig(),
                  precision=PrecisionConfig(bf16=True),
                  optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, lr_decay_style="constant"),
                  training=TrainingConfig(micro_batch_size=micro,
                                          global_batch_size=micro * microbatches,
                                          train_iters=10 ** 6, torch_compile=compiled))


FLOP_CONVENTIONS = {
    "full": "6 N + 12 L s h per token, N = 12 L h^2 + V h (PaLM's model FLOPs, as torchtitan and "
            "Megatron-LM report them: the causal mask not discounted)",
    "causal": "6 N + 6 L s h per token (half the s^2 attention work: what a causal kernel "
              "computes)"}


def flops_per_token(config: Config, convention: str = "full") -> float:
    """Model FLOPs per token in `convention` (FLOP_CONVENTIONS): forward and backward, no
    recomputation."""
    full = model_flops_per_sample(config) / config.model.seq_length
    if convention == "full":
        return full
    m = config.model  # the attention's forward and backward share, halved
    return full - 3 * m.num_layers * attention_flops_per_token(m) / 2


def is_out_of_memory(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error):
            return True
        error = error.__cause__
    return False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> float | None:
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


# -- the runs ------------------------------------------------------------------------------------

def run_ours(config: Config, device: torch.device, warmup: int, iterations: int) -> dict:
    """megatron_2bw's own stage (flush schedule, one rank): seconds per iteration after warm-up."""
    layout = ParallelLayout(1, 1, 1, 0)
    layout.build_groups(10.0)
    steps = []
    if config.training.torch_compile:
        # compile afresh: a recompilation for another model or micro batch would make their
        # sizes dynamic (dynamo's automatic dynamic shapes), not the graph a run would compile
        import torch._dynamo as dynamo
        dynamo.reset()
    stage = build_stage(config, layout, device, None, on_step=steps.append)
    train = config.training
    tokens = torch.randint(0, config.model.vocab_size,
                           (train.micro_batch_size, config.model.seq_length + 1), device=device)
    feed = lambda k: {"tokens": tokens}  # noqa: E731 - the same microbatch: no host work
    try:
        run_segment(stage, 0, warmup, feed)
        synchronize(device)
        start = time.perf_counter()
        run_segment(stage, warmup, iterations, feed)
        synchronize(device)
        seconds = (time.perf_counter() - start) / iterations
        loss = steps[-1].metrics.get("lm loss") if steps else None
        return {"seconds_per_iteration": seconds, "peak_bytes": peak_bytes(device), "loss": loss}
    finally:
        del stage


def run_peer(config: Config, device: torch.device, warmup: int, iterations: int) -> dict:
    """transformers' GPT2LMHeadModel of the same shape: fp32 weights under bf16 autocast, SDPA
    attention, fused AdamW, the same microbatches per step."""
    from transformers import GPT2Config, GPT2LMHeadModel
    m, train = config.model, config.training
    peer_config = GPT2Config(vocab_size=m.padded_vocab_size(1), n_positions=m.seq_length,
                             n_embd=m.hidden_size, n_layer=m.num_layers,
                             n_head=m.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, bos_token_id=m.vocab_size - 1,
                             eos_token_id=m.vocab_size - 1)
    peer_config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(peer_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    microbatches = train.global_batch_size // train.micro_batch_size
    tokens = torch.randint(0, m.vocab_size, (train.micro_batch_size, m.seq_length), device=device)

    def step():
        for _ in range(microbatches):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            (loss / microbatches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    try:
        for _ in range(warmup):
            step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        synchronize(device)
        return {"seconds_per_iteration": (time.perf_counter() - start) / iterations,
                "peak_bytes": peak_bytes(device)}
    finally:
        del model, optimizer


def largest_fitting(run, make_config, micro_batches, device, warmup, iterations) -> dict | None:
    """Run with growing micro batches until one does not fit; the last that fitted, with every
    size tried."""
    best, tried = None, []
    for micro in micro_batches:
        release(device)
        try:
            result = run(make_config(micro), device, warmup, iterations)
        except Exception as error:  # noqa: BLE001 - only out-of-memory ends the search quietly
            if not is_out_of_memory(error):
                raise
            tried.append({"micro_batch_size": micro, "fits": False})
            break
        tried.append({"micro_batch_size": micro, "fits": True,
                      "seconds_per_iteration": result["seconds_per_iteration"]})
        best = {"micro_batch_size": micro, **result}
    release(device)
    return None if best is None else {**best, "tried": tried}


def compiled_sizes(eager: dict, micro_batches: list[int]) -> list[int]:
    """The micro batches the compiled run tries: the eager run's, and up from there only below
    the size that did not fit eagerly. Each size tried costs a compilation, and one that ends
    out of memory would waste it."""
    too_big = min((t["micro_batch_size"] for t in eager["tried"] if not t["fits"]), default=None)
    return [b for b in micro_batches
            if b >= eager["micro_batch_size"] and (too_big is None or b < too_big)]


def throughput(result: dict, config: Config, peak: float | None) -> dict:
    train = config.training
    tokens = train.global_batch_size * config.model.seq_length
    tokens_per_s = tokens / result["seconds_per_iteration"]
    tflops = tokens_per_s * flops_per_token(config) / 1e12
    causal = tokens_per_s * flops_per_token(config, "causal") / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
            "mfu": tflops / peak if peak else None, "tflops_per_gpu_causal": causal,
            "mfu_causal": causal / peak if peak else None}


# -- one layer against the planner ---------------------------------------------------------------

def layer_profile(config: Config, device: torch.device, hardware, micro_batches, repeats: int
                  ) -> list[dict]:
    """One transformer layer in bf16: forward and backward time (median of `repeats`) and the
    bytes its forward keeps for the backward, against the planner's analytic profile."""
    from megatron_2bw.models.transformer import TransformerLayer
    m = config.model
    analytic = AnalyticProfile(m, config.precision, hardware)
    rows = []
    for micro in micro_batches:
        release(device)
        with torch.device(device):
            layer = TransformerLayer(m, None, causal=True).to(torch.bfloat16)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(micro, m.seq_length, m.hidden_size, dtype=torch.bfloat16, device=device,
                        requires_grad=True)
        forward, backward = [], []
        try:
            for _ in range(repeats + 1):  # the first is a warm-up
                synchronize(device)
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                start = time.perf_counter()
                y = layer(x)
                synchronize(device)
                middle = time.perf_counter()
                kept = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" \
                    else None
                y.backward(torch.ones_like(y))
                synchronize(device)
                forward.append(middle - start)
                backward.append(time.perf_counter() - middle)
                del y
                x.grad = None
        except Exception as error:  # noqa: BLE001
            if not is_out_of_memory(error):
                raise
            rows.append({"micro_batch_size": micro, "fits": False})
            break
        finally:
            del layer
        predicted = analytic.costs(1, micro)
        rows.append({"micro_batch_size": micro, "fits": True,
                     "forward_s": statistics.median(forward[1:]),
                     "backward_s": statistics.median(backward[1:]),
                     "activation_bytes": kept,
                     "predicted_forward_s": predicted.layer_forward_s,
                     "predicted_backward_s": predicted.layer_backward_s,
                     "predicted_activation_bytes": predicted.layer_activation_bytes})
    release(device)
    return rows


# -- reporting -----------------------------------------------------------------------------------

def _relative(measured, predicted) -> str:
    if not measured or predicted is None:
        return ""
    return f" ({predicted / measured - 1:+.0%} predicted)"


def describe(name: str, run: str, result: dict | None, peak: float | None) -> str:
    if result is None:
        return f"{name} {run}: no micro batch fits"
    if "error" in result:
        return f"{name} {run}: FAILED: {result['error']}"
    mfu = (f", MFU {result['mfu']:.1%} (6N + 12Lsh, full attention; causal 6N + 6Lsh: "
           f"{result['tflops_per_gpu_causal']:.1f} TFLOP/s, MFU {result['mfu_causal']:.1%})"
           if result.get("mfu") is not None else
           f" (6N + 12Lsh, full attention; causal 6N + 6Lsh: "
           f"{result['tflops_per_gpu_causal']:.1f} TFLOP/s), MFU n/a (no peak)")
    memory = ""
    if result.get("peak_bytes") is not None:
        memory = f", peak memory {result['peak_bytes'] / GiB:.1f} GiB"
        if result.get("planner_estimate_bytes"):
            memory += f" (planner {result['planner_estimate_bytes'] / GiB:.1f} GiB, " \
                      f"{result['planner_estimate_bytes'] / result['peak_bytes'] - 1:+.0%})"
    ratio = f", {result['versus_peer']:.2f}x the peer" if result.get("versus_peer") else ""
    return (f"{name} {run}: micro batch {result['micro_batch_size']}, "
            f"{result['tokens_per_s']:.0f} tokens/s, {result['tflops_per_gpu']:.1f} TFLOP/s"
            f"{mfu}{memory}{ratio}")


def describe_layer(name: str, row: dict) -> str:
    if not row["fits"]:
        return f"{name} layer b={row['micro_batch_size']}: does not fit"
    kept = row["activation_bytes"]
    memory = "" if kept is None else (f", activations {kept / 2 ** 20:.0f} MiB"
                                      f"{_relative(kept, row['predicted_activation_bytes'])}")
    return (f"{name} layer b={row['micro_batch_size']}: forward {row['forward_s'] * 1e3:.2f} ms"
            f"{_relative(row['forward_s'], row['predicted_forward_s'])}, backward "
            f"{row['backward_s'] * 1e3:.2f} ms"
            f"{_relative(row['backward_s'], row['predicted_backward_s'])}{memory}")


def default_hardware(device_name: str) -> str:
    return "h200-1gpu" if "H200" in device_name else "h100-sxm-1gpu"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--microbatches", type=int, default=4,
                        help="microbatches per optimizer step (gradient accumulation)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="tried in order until one does not fit")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the --torch-compile runs")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    parser.add_argument("--no-layer-profile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: from its name)")
    parser.add_argument("--planner-hardware", default=None,
                        help="hardware file for the planner's estimates (default: the shipped "
                             "one-GPU H100 or H200 file by the device's name)")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model on whatever device is at hand (the CPU smoke run)")
    args = parser.parse_args(argv)

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: this benchmark measures GPUs (--tiny runs a CPU smoke test)")
    models = TINY if args.tiny else {name: MODELS[name] for name in args.models}
    seq, vocab = (64, 512) if args.tiny else (args.seq_length, args.vocab_size)
    micro_batches = [1, 2] if args.tiny else args.micro_batch_sizes
    layer_micro_batches = (1, 2) if args.tiny else LAYER_MICRO_BATCHES
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or peak_tflops(device_name)
    hardware = load_hardware(args.planner_hardware or default_hardware(device_name))
    report = {"device": device_name, "peak_bf16_tflops": peak, "torch": torch.__version__,
              "sequence_length": seq, "microbatches_per_step": args.microbatches,
              "planner_hardware": hardware.name,
              "flop_conventions": FLOP_CONVENTIONS, "models": {}}
    lines = [f"device: {device_name}, dense bf16 peak "
             f"{f'{peak:.1f} TFLOP/s' if peak else 'unknown (pass --peak-tflops)'}"]
    print(lines[0], flush=True)
    report["failed_runs"] = []
    if not args.no_peer and importlib.util.find_spec("transformers") is None:
        lines.append("transformers GPT-2 peer: skipped (transformers is not installed)")
        print(lines[-1], flush=True)
        args.no_peer = True

    def save() -> None:  # after every run: a benchmark cut short keeps what it measured
        report["summary"] = lines
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1))
    peer_run = "transformers GPT-2 peer"
    for name, shape in models.items():
        def make(micro, compiled=False, shape=shape):
            return gpt_config(shape, seq, vocab, micro, args.microbatches, compiled)
        entry = report["models"][name] = {"flops_per_token": {
            convention: flops_per_token(make(1), convention) for convention in FLOP_CONVENTIONS}}
        # the peer first, so that each of our runs states its ratio to it when it ends; the
        # compiled run last, the longest (compilation) and the one a cut-off may best lose
        runs = [] if args.no_peer else [(peer_run, run_peer, lambda b: make(b))]
        runs.append(("ours eager", run_ours, lambda b: make(b)))
        if not args.no_compile:
            runs.append(("ours compiled", run_ours, lambda b: make(b, True)))
        for run_name, run, make_config in runs:
            sizes = micro_batches
            eager = entry.get("ours eager")
            if run_name == "ours compiled" and eager and "tried" in eager:
                sizes = compiled_sizes(eager, micro_batches)
            try:
                result = largest_fitting(run, make_config, sizes, device, args.warmup,
                                         args.iterations)
            except Exception as error:  # noqa: BLE001 - the other runs still measure
                traceback.print_exc()
                result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                          if str(error) else type(error).__name__}
                report["failed_runs"].append(f"gpt-{name} {run_name}")
            if result is not None and "error" not in result:
                config = make_config(result["micro_batch_size"])
                result.update(throughput(result, config, peak))
                if run is run_ours:
                    estimate = estimate_stage_memory(
                        config.model, config.parallel, config.precision, config.recompute,
                        config.optimizer.optimizer, result["micro_batch_size"], args.microbatches,
                        1, 0, device_type=device.type)
                    result["planner_estimate_bytes"] = estimate.total
                    peer = entry.get(peer_run)
                    if peer and peer.get("tokens_per_s"):
                        result["versus_peer"] = result["tokens_per_s"] / peer["tokens_per_s"]
            entry[run_name] = result
            lines.append(describe(f"gpt-{name}", run_name, result, peak))
            print(lines[-1], flush=True)
            save()
        if not args.no_layer_profile:
            rows = layer_profile(make(1), device, hardware, layer_micro_batches, args.iterations)
            entry["layer"] = rows
            for row in rows:
                lines.append(describe_layer(f"gpt-{name}", row))
                print(lines[-1], flush=True)
            save()
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failed_runs"] else 0)
