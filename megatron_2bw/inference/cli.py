"""Command lines of text generation: tools/generate.py and tools/run_text_generation_server.py
(also installed as megatron-2bw-generate and megatron-2bw-text-server)."""
from __future__ import annotations

import os
import sys

import torch

from megatron_2bw.arguments import ConfigError, build_parser
from megatron_2bw.data.cli import exit_on_user_error
from megatron_2bw.inference.loading import load_text_model
from megatron_2bw.inference.sampling import SamplingConfig
from megatron_2bw.inference.server import TextGenerator, make_server

GENERATE_DOC = """Sample text from a GPT checkpoint of any layout, in one process.

    python tools/generate.py --load checkpoints/gpt --prompt "To be, or not to be" --top-p 0.9
    python tools/generate.py --load checkpoints/gpt --sample-input-file prompts.txt --greedy

The shards are merged in memory; model and tokenizer flags left unset come from the checkpoint.
Each prompt's text and its continuation are printed, separated by a blank line.
"""

SERVER_DOC = """Serve a GPT checkpoint over Megatron-LM's REST interface.

    python tools/run_text_generation_server.py --load checkpoints/gpt --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["To be, or not"], "tokens_to_generate": 32}'

Answers {"text": [prompt + continuation, ...]}; optional request fields: temperature, top_k,
top_p, greedy, random_seed. Listens on 127.0.0.1 unless --host says otherwise.
"""


def add_sampling_arguments(parser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--greedy", action="store_true", help="take the most likely token")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0,
                       help="sample among the k most likely (0: all)")
    group.add_argument("--top-p", type=float, default=0.0,
                       help="sample within the nucleus of probability p (0: all)")
    group.add_argument("--iteration", type=int, default=None,
                       help="checkpoint iteration (default: the latest)")


def add_generate_arguments(parser) -> None:
    add_sampling_arguments(parser)
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", action="append", default=[],
                       help="a prompt (repeat for several)")
    group.add_argument("--sample-input-file", "--prompts-file", dest="prompts_file",
                       help="a file of prompts, one per line")
    group.add_argument("--out-seq-length", "--tokens-to-generate", dest="tokens_to_generate",
                       type=int, default=64, help="tokens to generate per prompt (at most)")


def add_server_arguments(parser) -> None:
    add_sampling_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=5000)
    group.add_argument("--max-tokens-to-generate", type=int, default=1024,
                       help="the largest tokens_to_generate a request may ask for")
    group.add_argument("--max-prompts-per-request", type=int, default=64)


def sampling_config(args) -> SamplingConfig:
    sampling = SamplingConfig(args.greedy, args.temperature, args.top_k, args.top_p)
    sampling.validate()
    return sampling


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not os.path.isfile(args.prompts_file):
            raise FileNotFoundError(f"--sample-input-file {args.prompts_file}: file not found")
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ConfigError("give a prompt: --prompt TEXT or --sample-input-file FILE")
    return prompts


def run_generate(argv=None) -> list[str]:
    """Print and return each prompt followed by its continuation."""
    args = build_parser(GENERATE_DOC.split("\n")[0], add_generate_arguments).parse_args(argv)
    sampling = sampling_config(args)
    if args.tokens_to_generate < 0:
        raise ConfigError(f"--out-seq-length must be >= 0, got {args.tokens_to_generate}")
    prompts = read_prompts(args)
    text_model = load_text_model(args, show_progress=False)
    device = next(text_model.model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(text_model.config.training.seed)
    texts = []
    for prompt in prompts:
        texts.append(text_model.complete(prompt, args.tokens_to_generate, sampling, generator))
        print(texts[-1] + "\n", flush=True)
    return texts


def run_server(argv=None, ready=None) -> None:
    """Serve until interrupted; `ready(server)` is called once it listens (tests read its port)."""
    args = build_parser(SERVER_DOC.split("\n")[0], add_server_arguments).parse_args(argv)
    sampling = sampling_config(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (0: a free port), got {args.port}")
    for flag, value in [("--max-tokens-to-generate", args.max_tokens_to_generate),
                        ("--max-prompts-per-request", args.max_prompts_per_request)]:
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    text_model = load_text_model(args)
    generator = TextGenerator(text_model, sampling, args.max_tokens_to_generate,
                              args.max_prompts_per_request, text_model.config.training.seed)
    try:
        server = make_server(generator, args.host, args.port)
    except OSError as error:
        raise ConfigError(f"--host {args.host} --port {args.port}: cannot listen "
                          f"({error})") from None
    host, port = server.server_address[:2]
    print(f" serving {args.load} (iteration {text_model.iteration}) on http://{host}:{port}/api",
          flush=True)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def generate_main() -> None:
    with exit_on_user_error(sys.argv[0]):
        run_generate()


def server_main() -> None:
    with exit_on_user_error(sys.argv[0]):
        run_server()
