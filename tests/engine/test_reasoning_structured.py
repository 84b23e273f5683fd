"""Structured output after the thinking (`reasoning_parser`), on a tiny random model whose vocabulary has <think>
and </think> as tokens 3 and 4: the grammar leaves the thinking free and constrains what follows the end token;
without a reasoning parser the same grammar constrains the first token already. Behind the server, the thinking
comes back as `reasoning_content`, streamed as its own deltas that join into the non-streamed split."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from tests.model_utils import make_tiny_model
from tests.server.server_utils import RemoteServer

THINK, END_THINK, T5 = 3, 4, 5


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir: Path) -> str:
    """The tiny Llama with a tokenizer whose tokens 3 and 4 are <think> and </think> (tokens decode without spaces
    between them; llguidance cannot spell a text of two such tokens, there being no single-character tokens, so the
    grammars here are one token long)."""
    from tokenizers import Tokenizer

    base = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=3)
    folder = os.path.join(tiny_model_dir, "thinking-llama-v2")
    if not os.path.isdir(folder):
        shutil.copytree(base, folder)
        path = os.path.join(folder, "tokenizer.json")
        spec = json.loads(Tokenizer.from_file(path).to_str())
        vocab = spec["model"]["vocab"]
        vocab["<think>"] = vocab.pop("t3")
        vocab["</think>"] = vocab.pop("t4")
        # A decoder llguidance can read token bytes from (every token here is printable ASCII, its own bytes).
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        Tokenizer.from_str(json.dumps(spec)).save(path)
    return folder


def _params(**kw: object) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=12, logit_bias={END_THINK: 100.0}, structured_outputs={"choice": ["t5"]}, **kw
    )


def test_the_grammar_starts_after_the_thinking(thinking_model: str) -> None:
    prompt = {"prompt_token_ids": [7, 8, 9, 10]}
    with LLM(thinking_model, max_model_len=128, kv_cache_memory_bytes="16MiB", reasoning_parser="deepseek_r1") as llm:
        out = llm.generate(prompt, _params(), use_tqdm=False)[0].outputs[0]
        # The bias makes </think> the first token (free: the thinking is not constrained), then the grammar.
        assert out.token_ids == [END_THINK, T5] and out.finish_reason == "stop"
        # A prompt that already closed the thinking: the grammar applies from the first token.
        closed = llm.generate({"prompt_token_ids": [THINK, 7, END_THINK]}, _params(), use_tqdm=False)[0].outputs[0]
        assert closed.token_ids == [T5]
    with LLM(thinking_model, max_model_len=128, kv_cache_memory_bytes="16MiB") as plain:
        assert plain.generate(prompt, _params(), use_tqdm=False)[0].outputs[0].token_ids == [T5]


def test_a_vocabulary_without_the_end_tag_is_refused(tiny_model_dir: Path) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=3)
    with pytest.raises(ValueError, match="needs the token '</think>'"):
        LLM(folder, max_model_len=128, kv_cache_memory_bytes="16MiB", reasoning_parser="qwen3")


@pytest.mark.timeout(300)
def test_reasoning_content_behind_the_server(thinking_model: str) -> None:
    srv = RemoteServer(
        "--model",
        thinking_model,
        "--max-model-len",
        "128",
        "--reasoning-parser",
        "deepseek_r1",
        "--trust-request-chat-template",
    )
    try:
        client = srv.client()
        model = client.models.list().data[0].id
        # Sampled thinking, with </think> made likely (so that it comes within max_tokens) and eos impossible; the
        # first seed whose thinking is not empty is checked (each has a ~1/5 chance of an empty one).
        with_thinking = 0
        for seed in range(8):
            kw = dict(
                model=model,
                messages=[{"role": "user", "content": "t7 t8"}],
                max_tokens=60,
                temperature=1.0,
                seed=seed,
                logit_bias={str(END_THINK): 5.0, "2": -100.0},
                extra_body={
                    "guided_choice": ["t5"],
                    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                },
            )
            choice = client.chat.completions.create(**kw).choices[0]
            message = choice.message
            assert message.content == "t5" and choice.finish_reason == "stop", (seed, message)
            if not message.reasoning_content:
                continue
            assert "</think>" not in message.reasoning_content
            reasoning, content = "", ""
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    reasoning += getattr(delta, "reasoning_content", None) or ""
                    content += delta.content or ""
            assert (reasoning, content) == (message.reasoning_content, message.content)
            # include_reasoning false (vLLM's): the same answer without its thinking, streamed or not
            quiet = client.chat.completions.create(
                **{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}}
            )
            assert quiet.choices[0].message.content == "t5" and quiet.choices[0].message.reasoning_content is None
            streamed = client.chat.completions.create(
                stream=True, **{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}}
            )
            deltas = [c.choices[0].delta for c in streamed if c.choices]
            assert not any(getattr(d, "reasoning_content", None) for d in deltas)
            assert "".join(d.content or "" for d in deltas) == "t5"
            with_thinking += 1
            break
        assert with_thinking == 1
    finally:
        srv.stop()
