"""Sample text from a GPT checkpoint of any layout (see megatron_2bw/inference/cli.py).

    python tools/generate.py --load checkpoints/gpt --prompt "To be, or not to be" --top-p 0.9
    python tools/generate.py --load checkpoints/gpt --sample-input-file prompts.txt --greedy
"""
from megatron_2bw.inference.cli import generate_main

if __name__ == "__main__":
    generate_main()
