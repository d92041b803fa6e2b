"""The order in which a benchmark's round runs its configurations.

Benchmarks here interleave their configurations (every one once per round, several rounds),
because this machine's speed drifts by 10-30% within minutes. In a fixed order each configuration
would still run at the same point of every round: always right after the same neighbour, always
the same time after whatever the round starts with. A fresh order per round spreads that over
all of them.
"""
from __future__ import annotations

import random


def round_order(count: int, round_index: int) -> list[int]:
    """range(count) shuffled for round `round_index`; seeded by the round, so a rerun repeats it."""
    order = list(range(count))
    random.Random(round_index).shuffle(order)
    return order
