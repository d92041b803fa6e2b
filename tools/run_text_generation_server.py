"""Serve a GPT checkpoint over Megatron-LM's REST interface (see megatron_2bw/inference/cli.py).

    python tools/run_text_generation_server.py --load checkpoints/gpt --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["To be, or not"], "tokens_to_generate": 32}'
"""
from megatron_2bw.inference.cli import server_main

if __name__ == "__main__":
    server_main()
