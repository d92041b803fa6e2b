"""Throughput and peak memory of tools/preprocess_data.py on generated jsonl.

    python benchmarks/preprocess_throughput.py --sizes-mb 50 200 --workers 2

For each size it writes a jsonl of synthetic English-like documents, trains a byte-level BPE
(GPT2BPETokenizer) on the first few MB once, runs the tool as a subprocess and samples the memory
of its whole process tree (the reader and its workers) every 50 ms. Peak memory is reported as the
sum of RSS (counts pages shared by forked workers more than once, an upper bound) and the sum of
PSS (shared pages divided among their users). Equal peaks for different sizes show that the tool
streams. CPU seconds (reader + workers) and the load average are recorded too, since other jobs
on a shared machine lower the wall-clock rate. Results are printed and written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def make_words(count: int, rng: np.random.Generator) -> list[str]:
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    frequency = 1 / np.arange(1, 27)
    spelled = rng.choice(letters, size=(count, 9), p=frequency / frequency.sum())
    return ["".join(row[:n]) for row, n in zip(spelled, rng.integers(1, 10, size=count))]


def write_corpus(path: str, megabytes: int, seed: int = 0) -> int:
    """Documents of about 400 Zipf-distributed words in sentences, until the file has the size."""
    rng = np.random.default_rng(seed)
    words = make_words(20_000, rng)
    zipf = 1 / np.arange(1, len(words) + 1)
    target, written, number = megabytes * 1_000_000, 0, 0
    with open(path, "w") as f:
        while written < target:
            block = [words[i] for i in rng.choice(len(words), size=400_000, p=zipf / zipf.sum())]
            sentence_lengths = rng.integers(5, 25, size=len(block)).tolist()
            document_lengths = rng.integers(50, 800, size=len(block)).tolist()
            position = 0
            while position < len(block) and written < target:
                end = min(position + document_lengths.pop(), len(block))
                sentences = []
                while position < end:
                    stop = min(position + sentence_lengths.pop(), end)
                    sentences.append(" ".join(block[position:stop]).capitalize() + ".")
                    position = stop
                line = json.dumps({"text": " ".join(sentences), "id": number}) + "\n"
                f.write(line)
                written += len(line)
                number += 1
    return written


def tree_memory(process: psutil.Process) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in bytes over a process and all its descendants."""
    rss = pss = 0
    for p in [process] + process.children(recursive=True):
        try:
            info = p.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return rss, pss


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_measured(command: list[str]) -> dict:
    """Wall time, CPU time and peak memory of a command and all its descendants."""
    load_before = os.getloadavg()[0]
    cpu_before = _children_cpu_seconds()  # workers are waited for, so their time rolls up here
    start = time.perf_counter()
    process = psutil.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak_rss = peak_pss = 0
    while process.poll() is None:
        rss, pss = tree_memory(process)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    output = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"preprocess_data.py failed ({process.returncode}): {output}")
    return {"seconds": seconds, "cpu_seconds": _children_cpu_seconds() - cpu_before,
            "peak_rss_mb": peak_rss / 1e6, "peak_pss_mb": peak_pss / 1e6,
            # other jobs on the machine slow the run down: the load average says how busy it was
            "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "tool_summary": output.strip().splitlines()[-1]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output", default=os.path.join(ROOT, "runs", "benchmarks",
                                                         "preprocess_throughput.json"))
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        sample = os.path.join(tmp, "sample.jsonl")
        write_corpus(sample, 5, seed=1)
        subprocess.run([sys.executable, os.path.join(TOOLS, "train_tokenizer.py"), "--input", sample,
                        "--output-prefix", os.path.join(tmp, "bpe"), "--byte-level-bpe",
                        "--vocab-size", str(args.vocab_size)], check=True, capture_output=True)
        for megabytes in args.sizes_mb:
            corpus = os.path.join(tmp, f"corpus{megabytes}.jsonl")
            size = write_corpus(corpus, megabytes)
            command = [sys.executable, os.path.join(TOOLS, "preprocess_data.py"), "--input", corpus,
                       "--output-prefix", os.path.join(tmp, f"out{megabytes}"),
                       "--tokenizer-type", "GPT2BPETokenizer",
                       "--vocab-file", os.path.join(tmp, "bpe-vocab.json"),
                       "--merge-file", os.path.join(tmp, "bpe-merges.txt"),
                       "--append-eod", "--workers", str(args.workers)]
            measured = run_measured(command)
            result = {"input_mb": size / 1e6, "workers": args.workers,
                      "tokenizer": f"GPT2BPETokenizer (byte-level BPE, {args.vocab_size} ids)",
                      "mb_per_s": size / 1e6 / measured["seconds"],
                      "mb_per_cpu_second": size / 1e6 / measured["cpu_seconds"], **measured,
                      "cpu_count": os.cpu_count()}
            print(json.dumps(result), flush=True)
            results.append(result)
            for suffix in (".bin", ".idx"):
                os.remove(os.path.join(tmp, f"out{megabytes}_text_document{suffix}"))
            os.remove(corpus)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
