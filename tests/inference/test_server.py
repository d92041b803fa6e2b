"""The text generation server's answers to bad requests, on a stand-in model: every answer is
JSON (a wrong method and http.server's own errors too), an unknown field and top_k with top_p are
refused, and a port outside 0..65535 is one line before any model loads."""
import http.client
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_2bw.inference.sampling import SamplingConfig
from megatron_2bw.inference.server import TextGenerator, make_server

TOOLS = Path(__file__).resolve().parents[2] / "tools"


class EchoModel:
    """Answers each prompt with itself: only the request handling is under test."""
    model = torch.nn.Linear(1, 1)

    def complete(self, prompt, count, sampling, generator):
        return prompt


@pytest.fixture(scope="module")
def server():
    generator = TextGenerator(EchoModel(), SamplingConfig(), 16, 4, seed=1)
    server = make_server(generator, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join(timeout=30)
    server.server_close()


def _request(server, method: str, body=None, path: str = "/api"):
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    data = None if body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    answer = connection.getresponse()
    status, headers, raw = answer.status, dict(answer.getheaders()), answer.read()
    connection.close()
    return status, headers, raw


def test_a_good_request_is_answered(server):
    status, _, raw = _request(server, "PUT", {"prompts": ["a b"], "tokens_to_generate": 2})
    assert status == 200 and json.loads(raw) == {"text": ["a b"]}


@pytest.mark.parametrize("body, message", [
    ({"prompts": ["a"], "top-k": 5}, "unknown field \"top-k\"; the fields are prompts, "
                                     "tokens_to_generate, temperature, top_k, top_p, greedy, "
                                     "random_seed"),
    ({"prompts": ["a"], "top_k": 5, "top_p": 0.9}, "give \"top_k\" or \"top_p\", not both"),
])
def test_a_request_that_would_be_misread_is_refused_naming_the_field(server, body, message):
    status, headers, raw = _request(server, "PUT", body)
    assert status == 400 and headers["Content-Type"] == "application/json"
    assert json.loads(raw)["error"].startswith(message)


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE", "PATCH"])
def test_another_method_is_answered_405_in_json(server, method):
    status, headers, raw = _request(server, method, {"prompts": ["a"]})
    assert status == 405 and headers["Allow"] == "PUT"
    assert headers["Content-Type"] == "application/json"
    assert json.loads(raw) == {"error": f"method {method} is not served; use PUT /api"}


def test_http_servers_own_errors_are_json_too(server):
    status, headers, raw = _request(server, "FOO")
    assert status == 501 and headers["Content-Type"] == "application/json"
    assert "FOO" in json.loads(raw)["error"]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_outside_the_tcp_range_is_one_line(port, tmp_path):
    run = subprocess.run([sys.executable, str(TOOLS / "run_text_generation_server.py"), "--load",
                          str(tmp_path), "--port", port], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stderr
    assert run.stderr == (f"run_text_generation_server.py: error: --port must be in 0..65535 "
                          f"(0: a free port), got {port}\n")
