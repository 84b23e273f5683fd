"""`pagedllm chat --url` and `pagedllm complete`, the command line as a client of a running server (as `vllm chat`
and `vllm complete`): their streamed replies are the server's own greedy answers, a chat keeps its history, and
an unreachable server or a refused key ends the command with status 2 and the reason."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server.server_utils import API_KEY, ROOT

pytestmark = pytest.mark.timeout(180)


def _cli(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=full_env,
    )


def test_complete_prints_the_servers_greedy_completion(server, client, model_name) -> None:
    prompt = "The capital of France is"
    want = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    done = _cli("complete", "--url", server.url + "/v1", "--api-key", API_KEY, "-q", prompt, "--max-tokens", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n" and f"Using model: {model_name}" in done.stderr
    # prompts from stdin, one a line (blank lines skipped); the key from $OPENAI_API_KEY, the model named
    done = _cli(
        "complete", "--url", server.url + "/v1", "--model-name", model_name, "--max-tokens", "8",
        stdin=f"{prompt}\n\n{prompt}\n", env={"OPENAI_API_KEY": API_KEY},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{want}\n{want}\n"


def test_chat_keeps_the_conversation(server, client, model_name) -> None:
    first, second = "Name a fruit.", "And a vegetable?"
    done = _cli(
        "chat", "--url", server.url + "/v1", "--api-key", API_KEY, "--system-prompt", "Be brief.",
        "--max-tokens", "12", stdin=f"{first}\n{second}\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    replies = done.stdout.splitlines()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": first}]
    want = client.chat.completions.create(model=model_name, messages=history, max_tokens=12, temperature=0)
    reply = want.choices[0].message.content
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": second}]
    want2 = client.chat.completions.create(model=model_name, messages=history, max_tokens=12, temperature=0)
    assert "\n".join(replies) == f"{reply}\n{want2.choices[0].message.content}"
    quick = _cli("chat", "--url", server.url + "/v1", "--api-key", API_KEY, "--quick", first, "--max-tokens", "12")
    alone = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": first}], max_tokens=12, temperature=0
    )
    assert quick.returncode == 0 and quick.stdout == alone.choices[0].message.content + "\n", quick


def test_an_unreachable_server_or_a_refused_key_is_status_2(server) -> None:
    done = _cli("complete", "--url", "http://127.0.0.1:9/v1", "-q", "x")
    assert done.returncode == 2 and "cannot reach the server at http://127.0.0.1:9/v1" in done.stderr
    done = _cli("chat", "--url", server.url + "/v1", "--api-key", "wrong", "--quick", "hi")
    assert done.returncode == 2 and "the server answered 401" in done.stderr, done.stderr
    done = _cli("complete", "--url", server.url + "/v1", "--api-key", API_KEY, "--model-name", "nope", "-q", "x")
    assert done.returncode == 2 and "404" in done.stderr and "nope" in done.stderr, done.stderr
