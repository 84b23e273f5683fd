"""`pagedllm run-batch` (vLLM's `run-batch`: OpenAI's batch file format, offline): each line's answer is the one the
server gives the same request, in the input's order, and a line the server would refuse, or that is no request, has
its 400 in the output without stopping the batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.server_utils import COMMON_ARGS, ROOT

pytestmark = pytest.mark.timeout(240)

TOPICS = ["the moon", "penguins", "tea", "chess", "glaciers", "the violin"]


def test_run_batch_answers_as_the_server_does(server, client, model_name, tmp_path) -> None:
    chats = [
        {"messages": [{"role": "user", "content": f"Tell me about {t}."}], "max_tokens": 8, "temperature": 0}
        for t in TOPICS
    ]
    lines = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b} for i, b in
             enumerate(chats)]  # fmt: skip
    lines.append({"custom_id": "cmpl", "url": "/v1/completions", "body": {"prompt": "1, 2, 3,", "max_tokens": 6,
                                                                           "temperature": 0}})  # fmt: skip
    text = "\n".join(json.dumps(line) for line in lines)
    text += '\nnot json\n\n{"custom_id": "s", "url": "/v1/chat/completions", "body": {"stream": true}}\n'
    text += '{"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": "hi"}}\n'
    text += '{"custom_id": "hot", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}\n'
    text += '{"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}\n'
    (tmp_path / "in.jsonl").write_text(text)
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(tmp_path / "in.jsonl")]
    cmd += ["-o", str(tmp_path / "out.jsonl"), *COMMON_ARGS, "--max-queued-requests", "1"]  # no 429 in a batch
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine core process stopped (exit status 0)" in done.stderr
    outs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outs] == [*(f"chat-{i}" for i in range(len(TOPICS))), "cmpl", None, "s", "emb",
                                              "hot", "get"]  # fmt: skip
    assert len({o["id"] for o in outs}) == len(outs)
    for out, body in zip(outs, chats, strict=False):
        want = client.chat.completions.create(model=model_name, **body)
        assert out["response"]["status_code"] == 200 and out["error"] is None
        got = out["response"]["body"]
        assert got["object"] == "chat.completion" and got["model"] == model_name
        assert got["choices"][0]["message"]["content"] == want.choices[0].message.content
        assert got["usage"]["completion_tokens"] == want.usage.completion_tokens
    want = client.completions.create(model=model_name, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert outs[len(TOPICS)]["response"]["body"]["choices"][0]["text"] == want.choices[0].text
    refused = {o["custom_id"]: o for o in outs[len(TOPICS) + 1 :]}
    for custom_id, words in [
        (None, "not JSON"),
        ("s", "cannot stream"),
        ("emb", "--runner generate"),
        ("hot", "temperature"),
        ("get", "method must be POST"),
    ]:
        out = refused[custom_id]
        assert out["response"]["status_code"] == 400 and out["response"]["body"] is None, out
        assert out["error"]["code"] == 400 and words in out["error"]["message"], out


def test_an_unreadable_input_is_status_2(tmp_path) -> None:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(tmp_path / "missing.jsonl")]
    done = subprocess.run(cmd + ["-o", str(tmp_path / "o")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "cannot read the input file" in done.stderr
    assert not (tmp_path / "o").exists()
