"""Bytes per parameter: what a built stage holds after two batches (every tensor of its weights,
gradients and optimizer state, counted once per storage) against the table in
docs/precision_memory.md, and the table against `held_bytes_per_parameter`, which the planner's
memory estimate uses. The start-up banner under the distributed optimizer: what a rank holds and
what it owns."""
import re
from pathlib import Path

import pytest

from megatron_2bw.memory import storage_bytes
from megatron_2bw.planner.memory import held_bytes_per_parameter
from megatron_2bw.training.loop import startup_summary
from megatron_2bw.training.segments import run_segment
from megatron_2bw.training.stage import static_tensors
from tests.distributed_helpers import run_ranks
from tests.pipeline.harness import gpt_feed, stage_on_rank
from tests.pipeline.precision_harness import precise_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "precision_memory.md"
ROW = re.compile(r"^\| (fp32|bf16|fp16)(?: \+ ZeRO-1 d=(\d))?, (Flush|2BW) \|(.*)\|$")
COLUMNS = ("working", "buffer", "master", "master_grads", "optimizer", "total")


def documented_table() -> dict[tuple[str, int, str], dict[str, float]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            precision, d, schedule, cells = match.groups()
            values = [float(cell) for cell in cells.split("|")]
            rows[(precision, int(d or 1), schedule.lower())] = dict(zip(COLUMNS, values))
    return rows


TABLE = documented_table()
PRECISION_BYTES = {"fp32": (4, 4), "bf16": (2, 4), "fp16": (2, 2)}  # working, gradient buffer


def test_the_table_covers_each_layout_and_the_planner_uses_it():
    assert len(TABLE) == 10
    for (precision, d, schedule), row in TABLE.items():
        e, g = PRECISION_BYTES[precision]
        held = held_bytes_per_parameter(e, g, 2 if schedule == "2bw" else 1, d, "adam")
        assert [getattr(held, c) for c in COLUMNS] == [row[c] for c in COLUMNS]
        assert sum(row[c] for c in COLUMNS[:-1]) == row["total"]
    # the targets: Megatron-LM's 18 (bf16) and 6 + 12/d (bf16, distributed optimizer) under Flush
    assert TABLE[("bf16", 1, "flush")]["total"] == 18
    assert TABLE[("bf16", 2, "flush")]["total"] == 6 + 12 / 2


def _held(rank: int, world: int, config) -> float:
    _, stage = stage_on_rank(rank, world, config)
    run_segment(stage, 0, 2, gpt_feed(config, stage.layout))
    return storage_bytes(static_tensors(stage)) / sum(stage.versions.layout.numels)


@pytest.mark.parametrize("precision, d, schedule", sorted(TABLE),
                         ids=[f"{p}-d{d}-{s}" for p, d, s in sorted(TABLE)])
def test_a_stage_holds_the_documented_bytes_per_parameter(precision, d, schedule):
    config = precise_config(precision, schedule=schedule, optimizer="adam", lr=0.01, layers=2)
    config.parallel.use_distributed_optimizer = d > 1
    held = run_ranks(d, _held, config) if d > 1 else [_held(0, 1, config)]
    for per_parameter in held:  # the layout pads each region by a few elements
        assert per_parameter == pytest.approx(TABLE[(precision, d, schedule)]["total"], rel=0.01)


def _banner(rank: int, world: int, config) -> tuple[str, int, int]:
    _, stage = stage_on_rank(rank, world, config)
    return (startup_summary(stage), sum(stage.versions.layout.numels),
            sum(m.numel() for m in stage.versions.master))


def test_the_banner_says_what_a_sharded_rank_holds_and_what_it_owns():
    config = precise_config("bf16", schedule="flush", optimizer="adam", layers=2,
                            hidden_size=256, num_attention_heads=4)
    plain = _banner(0, 1, config)
    config.parallel.use_distributed_optimizer = True
    for line, held, owned in run_ranks(2, _banner, config):
        assert held == plain[1] and 2 * owned == pytest.approx(held, abs=8)  # padding
        assert line.endswith(f"holds {held / 1e6:.2f} M parameters on rank 0 and owns "
                             f"{owned / 1e6:.2f} M of their master weights and optimizer state "
                             f"(1/2)"), line
    assert plain[0].endswith(f"holds {plain[1] / 1e6:.2f} M parameters on rank 0")
