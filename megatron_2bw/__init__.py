"""megatron_2bw: GPT and BERT pretraining with Megatron-style tensor parallelism and
PipeDream-2BW pipeline parallelism."""

__version__ = "0.1.0"
