"""pretrain_gpt.py with one rank stalling before a chosen action (fault-injection for tests):
    STALL_RANK=0 STALL_ACTION="F2@v0" torchrun ... tests/functional/stall_rank.py <pretrain flags>"""
import os
import runpy
import sys
import time

from megatron_2bw.training import startup
from megatron_2bw.pipeline.executor import StageExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
original = StageExecutor._run_one
# the default group (start-up: ranks of a loaded machine import torch at different speeds) waits
# this long at least; the pipeline's groups and transfers keep --distributed-timeout-minutes
START_UP_TIMEOUT_MINUTES = 5.0
original_init = startup.init_distributed


def patient_start_up(backend, timeout_minutes, *args, **kwargs):
    return original_init(backend, max(timeout_minutes, START_UP_TIMEOUT_MINUTES), *args, **kwargs)


def stalling_run_one(self, action, next_microbatch):
    if os.environ["RANK"] == os.environ["STALL_RANK"] and str(action) == os.environ["STALL_ACTION"]:
        time.sleep(3600)
    return original(self, action, next_microbatch)


StageExecutor._run_one = stalling_run_one
startup.init_distributed = patient_start_up
sys.argv[0] = os.path.join(ROOT, "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
