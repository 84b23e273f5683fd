"""The command line as a client of a running OpenAI-compatible server, as `vllm chat` and `vllm complete` are:
`pagedllm chat --url URL` and `pagedllm complete [--url URL]`.

Contract:
* `--url` is the server's API base (`http://localhost:8000/v1` for `complete` by default; `chat` without it runs
  the model in this process instead), `--model-name` the model (default: the first of `/v1/models`), `--api-key`
  the key (default: $OPENAI_API_KEY, else none).
* `chat` keeps the conversation (an optional `--system-prompt` first) and sends all of it with each message;
  `complete` sends each prompt alone. Both read one message or prompt per line of stdin until its end, or send
  the one given by `-q/--quick` and exit. Replies stream to stdout as they are generated.
* The sampling flags of `pagedllm chat` (`--max-tokens`, `--temperature`, `--top-p`, `--top-k`, `--sampling-seed`)
  go with every request, so a remote chat samples as a local one does (greedy by default).
* A server that cannot be reached, or that answers with an error, ends the command with status 2 and its message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

DEFAULT_URL = "http://localhost:8000/v1"


def add_query_args(parser: argparse.ArgumentParser, default_url: str | None) -> None:
    """--url, --model-name and --api-key, as vLLM's `chat` and `complete` name them."""
    where = "the running server's API base URL" + ("" if default_url else "; without it the model runs in this process")
    parser.add_argument("--url", default=default_url, help=where + (" (default: %(default)s)" if default_url else ""))
    parser.add_argument("--model-name", default=None, help="the model (default: the first one of /v1/models)")
    parser.add_argument("--api-key", default=None, help="the server's API key (default: $OPENAI_API_KEY)")


class Client:
    """The few calls the commands make, over httpx (a dependency of pagedllm already)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        import httpx

        key = api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(600.0, connect=10.0))

    def _fail(self, e: Exception) -> ValueError:
        return ValueError(f"cannot reach the server at {self.url}: {e}")

    @staticmethod
    def _error(status: int, body: bytes) -> ValueError:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body.decode(errors="replace")[:500]
        return ValueError(f"the server answered {status}: {message}")

    def model(self, name: str | None) -> str:
        if name:
            return name
        import httpx

        try:
            resp = self.http.get("/models")
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        if resp.status_code != 200:
            raise self._error(resp.status_code, resp.content)
        models = resp.json().get("data") or []
        if not models:
            raise ValueError(f"the server at {self.url} serves no model")
        return str(models[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of a streamed request (each `data:` line's JSON) until `[DONE]`."""
        import httpx

        started = False
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}) as resp:
                if resp.status_code != 200:
                    raise self._error(resp.status_code, resp.read())
                started = True
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        raise ValueError(f"the server failed the request: {message}")
                    yield event
        except httpx.HTTPError as e:
            if not started:
                raise self._fail(e) from None
            raise ValueError(f"the connection to the server at {self.url} broke during the answer: {e}") from None
        raise ValueError(f"the server at {self.url} ended the answer before its end ([DONE])")


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p}
    if ns.top_k != -1:
        body["top_k"] = ns.top_k
    if ns.sampling_seed is not None:
        body["seed"] = ns.sampling_seed
    return body


def _lines(stdin: TextIO, out: TextIO) -> Iterator[str]:
    """The non-empty lines of stdin, with a `> ` prompt where a person types them."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=out, flush=True)
        line = stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def run_chat(ns: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """`pagedllm chat --url URL`: a conversation with the server's model."""
    client = Client(ns.url, ns.api_key)
    model = client.model(ns.model_name)
    print(f"Using model: {model}", file=sys.stderr)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    messages = [ns.quick] if ns.quick is not None else _lines(stdin, out)
    for message in messages:
        history.append({"role": "user", "content": message})
        reply = []
        for event in client.stream("/chat/completions", {"model": model, "messages": history, **_sampling(ns)}):
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                reply.append(text)
                print(text, end="", file=out, flush=True)
        print(file=out, flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def run_complete(ns: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """`pagedllm complete`: each prompt completed by the server's model."""
    client = Client(ns.url, ns.api_key)
    model = client.model(ns.model_name)
    print(f"Using model: {model}", file=sys.stderr)
    prompts = [ns.quick] if ns.quick is not None else _lines(stdin, out)
    for prompt in prompts:
        for event in client.stream("/completions", {"model": model, "prompt": prompt, **_sampling(ns)}):
            for choice in event.get("choices") or []:
                print(choice.get("text") or "", end="", file=out, flush=True)
        print(file=out, flush=True)
    return 0
