"""pretrain_gpt.py with one rank dying (os._exit) in the middle of a layer migration
(fault-injection for tests): DIE_RANK=0 torchrun ... tests/functional/die_in_repartition.py <flags>.
Its layers measure alike (even_layer_times.py), so a bad split moves on any machine, loaded or not."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_2bw.pipeline import repartition  # noqa: E402
from tests.functional.even_layer_times import run_pretrain_gpt  # noqa: E402
original = repartition._transfer


def dying_transfer(obj, source, destination, rank, what, device):
    if rank == int(os.environ["DIE_RANK"]):
        os._exit(9)
    return original(obj, source, destination, rank, what, device)


if __name__ == "__main__":
    repartition._transfer = dying_transfer
    run_pretrain_gpt()
