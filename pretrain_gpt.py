"""Pretrain GPT (Megatron-compatible flags). Launch with torchrun, srun or the deepspeed launcher:

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --pipeline-schedule 2bw --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 100 --lr 3e-4 --mock-data --vocab-size 1000
"""
from megatron_2bw.training import main, run_and_report

if __name__ == "__main__":
    run_and_report(lambda: main("gpt", __doc__))
