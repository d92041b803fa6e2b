"""tools/generate.py and tools/run_text_generation_server.py on a checkpoint trained here (t1 x p2,
2BW, mock data: the text is token ids), against generation in this process."""
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_2bw.arguments import build_parser
from megatron_2bw.inference.cli import add_generate_arguments, run_server
from megatron_2bw.inference.loading import load_text_model
from megatron_2bw.inference.sampling import SamplingConfig
from megatron_2bw.training.loop import pretrain
from tests.checkpoint.helpers import config_from_flags, pretrain_flags
from tests.distributed_helpers import run_ranks

TOOLS = Path(__file__).resolve().parents[2] / "tools"
PROMPT = "5 9 13 17"


def _train(rank: int, world: int, root: str) -> None:
    pretrain(config_from_flags(pretrain_flags(1, 2, 4, "--save", root)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("generation") / "checkpoint")
    torch.set_num_threads(1)
    run_ranks(2, _train, root, timeout=240)
    return root


def _greedy(root: str, tokens: int) -> str:
    args = build_parser("", add_generate_arguments).parse_args(["--load", root])
    loaded = load_text_model(args, device=torch.device("cpu"), show_progress=False)
    return loaded.complete(PROMPT, tokens, SamplingConfig(greedy=True))


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_generate_prints_the_prompt_and_its_greedy_continuation(checkpoint, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n\n3 4\n")
    run = _tool("generate.py", "--load", checkpoint, "--prompt", PROMPT, "--sample-input-file",
                str(prompts), "--greedy", "--out-seq-length", "6")
    assert run.returncode == 0, run.stderr[-3000:]
    texts = [block.strip() for block in run.stdout.strip().split("\n\n")]
    expected = _greedy(checkpoint, 6)
    assert texts[:2] == [expected, expected] and texts[2].startswith("3 4")
    assert len(expected.split()) > 4  # something was generated (at most 6 tokens, eod ends it)


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "2"], "--top-p must be in [0, 1]"),
    (["--sample-input-file", "/nonexistent/prompts.txt"], "--sample-input-file"),
    (["--prompt", "not token ids"], "NullTokenizer expects whitespace-separated integers")])
def test_generate_rejects_bad_input_in_one_line(checkpoint, flags, message):
    run = _tool("generate.py", "--load", checkpoint, *flags)
    assert run.returncode == 2 and message in run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


def _put(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_server_answers_put_api_like_megatron_lm(checkpoint):
    started = threading.Event()
    servers = []

    def ready(server):
        servers.append(server)
        started.set()

    thread = threading.Thread(target=run_server, daemon=True, kwargs=dict(
        argv=["--load", checkpoint, "--host", "127.0.0.1", "--port", "0", "--greedy",
              "--max-tokens-to-generate", "16"], ready=ready))
    thread.start()
    assert started.wait(timeout=120), "the server did not start"
    server = servers[0]
    url = f"http://127.0.0.1:{server.server_address[1]}/api"
    try:
        status, answer = _put(url, {"prompts": [PROMPT, PROMPT], "tokens_to_generate": 6})
        assert status == 200 and answer == {"text": [_greedy(checkpoint, 6)] * 2}
        status, answer = _put(url, {"prompts": [PROMPT], "tokens_to_generate": 17})
        assert status == 400 and "\"tokens_to_generate\" must be in [0, 16]" in answer["error"]
        status, answer = _put(url, {"prompts": "5 9", "tokens_to_generate": 2})
        assert status == 400 and "\"prompts\" must be a non-empty list" in answer["error"]
        status, answer = _put(url, {"prompts": [PROMPT], "greedy": False, "top_p": 3})
        assert status == 400 and "\"top_p\" must be in [0, 1]" in answer["error"]
        status, answer = _put(url, b"{not json")
        assert status == 400 and "not JSON" in answer["error"]
        status, answer = _put(url.replace("/api", "/other"), {"prompts": [PROMPT]})
        assert status == 404
        # sampling with a seed is reproducible
        body = {"prompts": [PROMPT], "tokens_to_generate": 8, "greedy": False,
                "temperature": 1.5, "random_seed": 7}
        assert _put(url, body) == _put(url, body)
    finally:
        server.shutdown()
        thread.join(timeout=30)
    assert not thread.is_alive()
