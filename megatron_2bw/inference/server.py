"""Megatron-LM's text generation REST interface, on the standard library's HTTP server.

    PUT /api  {"prompts": ["..."], "tokens_to_generate": 32}  ->  {"text": ["...", ...]}

Each answer is its prompt followed by the generated text (the tokens of both, detokenized), as
Megatron-LM answers. Optional
fields: "temperature", "top_k", "top_p", "greedy" (the server's defaults otherwise) and
"random_seed"; top_k and top_p exclude each other, as in Megatron-LM. A bad request is answered 400
with {"error": "..."} naming the field (an unknown field too), another method than PUT 405, in
JSON as every answer. Requests are served one at a time (one model, one lock).
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from megatron_2bw.inference.loading import TextModel
from megatron_2bw.inference.sampling import SamplingConfig

JSON_FIELDS = {field: f'"{field}"' for field in ("temperature", "top_k", "top_p")}
REQUEST_FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "greedy",
                  "random_seed")
MAX_BODY_BYTES = 1 << 20


class RequestError(ValueError):
    """A request the server answers with 400 and this message."""


def _number(body: dict, field: str, kind: type, default):
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()):
        raise RequestError(f"\"{field}\" must be {'an integer' if kind is int else 'a number'}, "
                           f"got {value!r}")
    return kind(value)


class TextGenerator:
    """Answers requests for one loaded model, within the server's limits."""

    def __init__(self, text_model: TextModel, sampling: SamplingConfig,
                 max_tokens_to_generate: int, max_prompts: int, seed: int):
        self.text_model, self.sampling = text_model, sampling
        self.max_tokens_to_generate, self.max_prompts = max_tokens_to_generate, max_prompts
        self.seed = seed
        self._lock = threading.Lock()

    def parse(self, body) -> tuple[list[str], int, SamplingConfig, int]:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object with \"prompts\"")
        unknown = sorted(set(body) - set(REQUEST_FIELDS))
        if unknown:  # a misspelt field would otherwise be ignored without a word
            raise RequestError(f"unknown field \"{unknown[0]}\"; the fields are "
                               f"{', '.join(REQUEST_FIELDS)}")
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts or \
                not all(isinstance(p, str) for p in prompts):
            raise RequestError("\"prompts\" must be a non-empty list of strings")
        if len(prompts) > self.max_prompts:
            raise RequestError(f"\"prompts\" holds {len(prompts)} prompts; this server takes at "
                               f"most {self.max_prompts} per request")
        count = _number(body, "tokens_to_generate", int, min(64, self.max_tokens_to_generate))
        if not 0 <= count <= self.max_tokens_to_generate:
            raise RequestError(f"\"tokens_to_generate\" must be in [0, "
                               f"{self.max_tokens_to_generate}], got {count}")
        greedy = body.get("greedy", self.sampling.greedy)
        if not isinstance(greedy, bool):
            raise RequestError(f"\"greedy\" must be true or false, got {greedy!r}")
        sampling = replace(self.sampling, greedy=greedy,
                           temperature=_number(body, "temperature", float,
                                               self.sampling.temperature),
                           top_k=_number(body, "top_k", int, self.sampling.top_k),
                           top_p=_number(body, "top_p", float, self.sampling.top_p))
        try:
            sampling.validate(JSON_FIELDS)
        except ValueError as error:
            raise RequestError(str(error)) from None
        return prompts, count, sampling, _number(body, "random_seed", int, self.seed)

    def complete(self, prompts: list[str], count: int, sampling: SamplingConfig,
                 seed: int) -> list[str]:
        tm = self.text_model
        with self._lock:
            device = next(tm.model.parameters()).device
            generator = torch.Generator(device=device).manual_seed(seed)
            try:
                return [tm.complete(prompt, count, sampling, generator) for prompt in prompts]
            except ValueError as error:  # a prompt the tokenizer cannot read
                raise RequestError(str(error)) from None


def make_server(generator: TextGenerator, host: str, port: int) -> ThreadingHTTPServer:
    """The HTTP server (not started: call serve_forever); port 0 picks a free one."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", "PUT")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def send_error(self, code, message=None, explain=None):
            """http.server's own errors (an unknown method, a malformed request line) in JSON,
            as every other answer, instead of its HTML page."""
            self.close_connection = True
            self._answer(code, {"error": message or self.responses.get(code, ("",))[0]})

        def _wrong_method(self):
            self._answer(405, {"error": f"method {self.command} is not served; use PUT /api"})

        do_GET = do_POST = do_DELETE = do_PATCH = _wrong_method  # noqa: N815

        def do_PUT(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/api":
                self._answer(404, {"error": f"no endpoint {self.path}; use PUT /api"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 <= length <= MAX_BODY_BYTES:
                    raise RequestError(f"the request body must be at most {MAX_BODY_BYTES} bytes")
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise RequestError(f"the request body is not JSON ({error})") from None
                texts = generator.complete(*generator.parse(body))
            except RequestError as error:
                self._answer(400, {"error": str(error)})
                return
            self._answer(200, {"text": texts})

    return ThreadingHTTPServer((host, port), Handler)
