"""pretrain_gpt.py with one rank stalling before a chosen action (fault-injection for tests):
    STALL_RANK=0 STALL_ACTION="F2@v0" torchrun ... tests/functional/stall_rank.py <pretrain flags>"""
import os
import runpy
import sys
import time

from megatron_2bw.pipeline.executor import StageExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
original = StageExecutor._run_one


def stalling_run_one(self, action, next_microbatch):
    if os.environ["RANK"] == os.environ["STALL_RANK"] and str(action) == os.environ["STALL_ACTION"]:
        time.sleep(3600)
    return original(self, action, next_microbatch)


StageExecutor._run_one = stalling_run_one
sys.argv[0] = os.path.join(ROOT, "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
