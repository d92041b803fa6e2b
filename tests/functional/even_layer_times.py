"""pretrain_gpt.py whose layers all measure alike (1 ms forward, 2 ms backward) whatever the
machine's speed, so a test of repartitioning in a launched job does not depend on timing:
torchrun ... tests/functional/even_layer_times.py <flags>"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_2bw.pipeline import layer_times  # noqa: E402
measured = layer_times.LayerTimes.collect


def even_collect(self):
    times = measured(self)
    times.layer_forward_s = {layer: 1e-3 for layer in times.layer_forward_s}
    times.layer_backward_s = {layer: 2e-3 for layer in times.layer_backward_s}
    times.stage_forward_s = sum(times.layer_forward_s.values())
    return times


def run_pretrain_gpt():
    """pretrain_gpt.py with this process's arguments, its layers measured alike."""
    layer_times.LayerTimes.collect = even_collect
    sys.argv[0] = os.path.join(ROOT, "pretrain_gpt.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    run_pretrain_gpt()
