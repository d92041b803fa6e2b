"""Run a function on several gloo ranks from inside pytest: the library's forked-rank runner."""
from megatron_2bw.distributed.forked import run_forked as run_ranks  # noqa: F401
from megatron_2bw.distributed.launch import free_port  # noqa: F401
