"""`pagedllm bench serve` end to end against a real `pagedllm serve` subprocess on the tiny random Llama.

One server (with an API key and a chat template) for the module; each test runs the benchmark in-process on
a handful of short requests and checks its saved JSON: counts, exact output lengths with --ignore-eos,
ordered percentiles, goodput, concurrency from the per-request start/end times, prompt lengths as the
server's own tokenizer counts them, failures, and the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from pagedllm.benchmarks import serve
from pagedllm.benchmarks.datasets import load_tokenizer, sample_prefix_repetition, sample_random
from tests.bench.conftest import SHAREGPT_PAIRS
from tests.server.server_utils import RemoteServer

API_KEY = "bench-key"


@pytest.fixture(scope="module")
def server(tiny_chat_llama: str):
    # The tiny model's limit is 512 positions (the harness defaults to 1024).
    srv = RemoteServer(tiny_chat_llama, "--max-model-len", "512", "--max-num-seqs", "8", api_key=API_KEY)
    yield srv
    srv.stop()


def _run(server: RemoteServer, tokenizer: str, tmp_path: Path, *extra: str, via_cli: bool = False) -> dict[str, Any]:
    argv = [
        "--base-url",
        server.url,
        "--api-key",
        API_KEY,
        "--tokenizer",
        tokenizer,
        "--disable-tqdm",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "result.json",
        *extra,
    ]
    if via_cli:
        from pagedllm.entrypoints.cli import main as cli_main

        rc = cli_main(["bench", "serve", *argv])
    else:
        rc = serve.main(argv)
    record = json.loads((tmp_path / "result.json").read_text())
    record["exit_code"] = rc
    return record


def _assert_ordered_percentiles(record: dict[str, Any]) -> None:
    for metric in ("ttft", "tpot", "itl", "e2el"):
        if metric == "itl" and not any(record["itls"]):
            # Every answer came in one text chunk (a tiny model's few tokens, merged while the client read the
            # stream, or held back by the detokenizer): no gap between chunks to measure, all ITL stats 0.
            assert record["p50_itl_ms"] == record["p99_itl_ms"] == 0
            continue
        p50, p90, p99 = (record[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, (metric, p50, p90, p99)
        assert record[f"median_{metric}_ms"] == p50


def _server_token_counts(server: RemoteServer, model: str, prompts: list[str]) -> list[int]:
    counts = []
    for prompt in prompts:
        status, body = server.request("POST", "/tokenize", {"model": model, "prompt": prompt})
        assert status == 200, body
        counts.append(body["count"])
    return counts


def test_random_ignore_eos_exact_lengths_and_impossible_goodput(server, tiny_chat_llama, tmp_path, capsys):
    rec = _run(
        server,
        tiny_chat_llama,
        tmp_path,
        *("--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "6"),
        *("--random-range-ratio", "0.5", "--ignore-eos", "--seed", "3", "--goodput", "ttft:0"),
        via_cli=True,
    )
    assert rec["exit_code"] == 0
    assert (rec["completed"], rec["failed"]) == (6, 0) and rec["success"] == [True] * 6
    assert rec["model_id"] == Path(tiny_chat_llama).name  # the first id of GET /v1/models
    assert rec["output_lens"] == rec["expected_output_lens"]  # ignore_eos: every request gets all it asked
    assert all(3 <= n <= 9 for n in rec["expected_output_lens"]) and len(set(rec["expected_output_lens"])) > 1
    # the prompts the benchmark sent are as long as drawn, counted by the server's tokenizer
    from pagedllm.benchmarks.datasets import load_tokenizer

    sent = sample_random(load_tokenizer(tiny_chat_llama), 6, 40, 6, 0.5, seed=3)
    assert rec["input_lens"] == [r.prompt_len for r in sent]
    assert all(20 <= n <= 60 for n in rec["input_lens"])
    assert _server_token_counts(server, rec["model_id"], [r.prompt for r in sent]) == rec["input_lens"]
    assert rec["total_input_tokens"] == sum(rec["input_lens"])
    assert rec["total_output_tokens"] == sum(rec["expected_output_lens"])
    _assert_ordered_percentiles(rec)
    for ttft, itl, e2el, tpot, out in zip(rec["ttfts"], rec["itls"], rec["e2els"], rec["tpots"], rec["output_lens"]):
        assert 0 < ttft <= e2el and ttft + sum(itl) <= e2el + 1e-9
        assert len(itl) <= out - 1
        assert tpot == pytest.approx((e2el - ttft) / (out - 1))
    assert rec["request_goodput"] == 0.0  # nobody gets a first token in 0 ms
    assert rec["request_throughput"] == pytest.approx(6 / rec["duration"])
    assert rec["output_throughput"] == pytest.approx(rec["total_output_tokens"] / rec["duration"])
    assert rec["request_rate"] == "inf" and rec["args"]["ignore_eos"] is True and "api_key" not in rec["args"]
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and re.search(r"\nRequest goodput \(req/s\): +0\.00\n", out)
    assert re.search(r"\nP90 TTFT \(ms\): +\d+\.\d\d\n", out) and re.search(r"\nSuccessful requests: +6\n", out)


def test_prefix_repetition_one_at_a_time_with_loose_goodput(server, tiny_chat_llama, tmp_path):
    rec = _run(
        server,
        tiny_chat_llama,
        tmp_path,
        *("--dataset-name", "prefix-repetition", "--num-prompts", "5", "--max-concurrency", "1"),
        *("--prefix-repetition-prefix-len", "30", "--prefix-repetition-suffix-len", "6"),
        *("--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4", "--ignore-eos"),
        *("--goodput", "ttft:1e9", "tpot:1e9", "e2el:1e9"),
    )
    assert (rec["completed"], rec["failed"]) == (5, 0)
    assert rec["input_lens"] == [36] * 5 and rec["output_lens"] == [4] * 5
    assert rec["request_goodput"] == rec["request_throughput"] > 0
    spans = sorted(zip(rec["start_times"], rec["end_times"]))
    assert all(start < end for start, end in spans)
    assert all(nxt_start >= end for (_, end), (nxt_start, _) in zip(spans, spans[1:])), spans  # never 2 in flight
    assert rec["max_concurrent_requests"] == 1 and rec["max_concurrency"] == 1
    _assert_ordered_percentiles(rec)
    from pagedllm.benchmarks.datasets import load_tokenizer

    sent = sample_prefix_repetition(load_tokenizer(tiny_chat_llama), 5, 30, 6, 2, 4, seed=0)
    assert _server_token_counts(server, rec["model_id"], [r.prompt for r in sent]) == [36] * 5


def test_sharegpt_chat_endpoint_poisson_arrivals(server, tiny_chat_llama, sharegpt_file, tmp_path):
    rate, seed = 20.0, 4
    rec = _run(
        server,
        tiny_chat_llama,
        tmp_path,
        *("--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt", "--dataset-path", sharegpt_file),
        *("--num-prompts", "3", "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos"),
        *("--metric-percentiles", "50,90,99"),
    )
    assert (rec["completed"], rec["failed"]) == (3, 0)
    replies = {len(p.split()): len(a.split()) for p, a in SHAREGPT_PAIRS}  # prompt len -> reply len (distinct)
    assert sorted(rec["input_lens"]) == sorted(replies)
    assert rec["output_lens"] == [replies[n] for n in rec["input_lens"]]  # the gpt reply's token count
    # requests leave on the Poisson schedule (never before it)
    offsets = serve.arrival_offsets(3, rate, 1.0, seed)
    assert all(start >= off - 0.005 for start, off in zip(rec["start_times"], offsets))
    assert max(rec["start_times"]) > 0
    text = rec["generated_texts"][0]
    assert text.split() and all(w.startswith("t") or w in ("<unk>", "<s>", "</s>") for w in text.split())
    _assert_ordered_percentiles(rec)


def test_failed_requests_are_counted_and_shown_once(server, tiny_chat_llama, tmp_path, capsys):
    # 600-token prompts cannot fit the server's max_model_len of 512: every request gets a 400
    rec = _run(
        server,
        tiny_chat_llama,
        tmp_path,
        *("--num-prompts", "3", "--random-input-len", "600", "--random-output-len", "4"),
    )
    assert rec["exit_code"] == 1
    assert (rec["completed"], rec["failed"]) == (0, 3) and rec["success"] == [False] * 3
    assert all(e.startswith("HTTP 400: ") and "512" in e for e in rec["errors"])
    err = capsys.readouterr().err
    assert err.count("request(s) failed:") == 1 and "3 request(s) failed: HTTP 400" in err
    assert rec["request_throughput"] == 0.0 and rec["mean_ttft_ms"] == 0.0


def test_api_key_from_environment_and_missing_key(server, tiny_chat_llama, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    base = ["--base-url", server.url, "--tokenizer", tiny_chat_llama, "--disable-tqdm", "--num-prompts", "2"]
    assert serve.main(base) == 2  # GET /v1/models is refused: a clear error, no traceback
    assert "HTTP 401" in capsys.readouterr().err
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    assert serve.main([*base, "--random-input-len", "8", "--random-output-len", "2"]) == 0
    assert re.search(r"\nSuccessful requests: +2\n", capsys.readouterr().out)


def test_plot_writes_a_png(server, tiny_chat_llama, tmp_path):
    png = tmp_path / "plots" / "serve.png"
    rec = _run(
        server,
        tiny_chat_llama,
        tmp_path,
        *("--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "5", "--ignore-eos"),
        *("--request-rate", "50", "--plot", str(png)),
    )
    assert rec["completed"] == 4
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not math.isnan(rec["mean_itl_ms"])


def test_output_tokens_counted_from_text_without_usage(tiny_tokenizer):
    """A server that sends no usage chunk: the output is tokenized with the benchmark's tokenizer."""
    results = [
        serve.RequestResult(success=True, generated_text="t5 t6 t7", output_tokens=-1),  # no usage
        serve.RequestResult(success=True, generated_text="t5 t6 t7", output_tokens=4),  # usage says 4
        serve.RequestResult(success=False, error="HTTP 500: x", output_tokens=-1),
    ]
    serve.fill_output_tokens(results, tiny_tokenizer)
    assert [r.output_tokens for r in results] == [3, 4, 0]
    assert serve._chunk_text({"choices": [{"index": 0, "delta": {"content": "t5"}}]}) == "t5"
    assert serve._chunk_text({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) == ""
    assert serve._chunk_text({"choices": [{"index": 0, "text": " t6", "finish_reason": None}]}) == " t6"
    assert serve._chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_without_tokenizer_the_served_models_root_counts_tokens(server, tiny_chat_llama, tmp_path, capsys):
    """No --tokenizer: the tokenizer is the served model's, from the `root` of its /v1/models card (the server's model
    folder here), not the default model's; prompt lengths then agree with the server's own counts."""
    argv = ["--base-url", server.url, "--api-key", API_KEY, "--disable-tqdm", "--num-prompts", "3"]
    argv += ["--random-input-len", "12", "--random-output-len", "2", "--ignore-eos", "--seed", "5"]
    assert serve.main([*argv, "--result-dir", str(tmp_path), "--result-filename", "result.json"]) == 0
    rec = json.loads((tmp_path / "result.json").read_text())
    assert Path(rec["tokenizer_id"]) == Path(tiny_chat_llama).resolve()
    assert "WARNING" not in capsys.readouterr().err
    from pagedllm.benchmarks.datasets import load_tokenizer

    sent = sample_random(load_tokenizer(tiny_chat_llama), 3, 12, 2, 0.0, seed=5)
    assert _server_token_counts(server, rec["model_id"], [r.prompt for r in sent]) == rec["input_lens"]


def test_a_vllm_bench_serve_command_line(server, tiny_chat_llama, tmp_path, capsys):
    """vLLM's flags: --backend openai-chat (the chat route), --served-model-name, sampling flags and --extra-body in
    the bodies, --no-stream, warm-ups, request ids, --percentile-metrics, --label/--metadata, --append-result."""
    name = Path(tiny_chat_llama).name
    argv = [
        *("--backend", "openai-chat", "--served-model-name", name, "--model", tiny_chat_llama, "--no-stream"),
        *("--num-prompts", "3", "--input-len", "20", "--output-len", "4", "--ignore-eos", "--top-k", "5"),
        *("--top-p", "0.9", "--extra-body", '{"min_tokens": 4}', "--num-warmups", "2", "--request-id-prefix", "b-"),
        *("--percentile-metrics", "ttft,e2el", "--label", "mybench", "--metadata", "run=1", "hw=cpu"),
        *("--trust-remote-code", "--save-detailed", "--append-result", "--ready-check-timeout-sec", "5"),
    ]
    first = _run(server, tiny_chat_llama, tmp_path, *argv)
    assert first["exit_code"] == 0 and first["endpoint"] == "/v1/chat/completions" and first["model_id"] == name
    assert first["completed"] == 3 and first["output_lens"] == [4, 4, 4]
    assert first["ttfts"] == first["e2els"] and not any(first["itls"])  # whole answers: no stream to time
    assert (first["label"], first["run"], first["hw"]) == ("mybench", "1", "cpu")
    assert "header" not in first["args"] and "api_key" not in first["args"]  # no credentials in the saved file
    parser = serve.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args([*argv, "--result-filename", "r.json"])
    serve._validate(parser, args)
    body = serve.build_payload(args, name, sample_random(load_tokenizer(tiny_chat_llama), 1, 20, 4)[0])
    assert (body["top_k"], body["top_p"], body["min_tokens"], body["stream"]) == (5, 0.9, 4, False)
    assert "messages" in body and "stream_options" not in body
    out = capsys.readouterr().out
    assert "Time to First Token" in out and "End-to-end Latency" in out and "Inter-token Latency" not in out
    # --append-result: a second run is one more JSON line in the same file
    base = ["--base-url", server.url, "--api-key", API_KEY, "--tokenizer", tiny_chat_llama, "--disable-tqdm"]
    assert serve.main([*base, "--result-dir", str(tmp_path), "--result-filename", "result.json", *argv]) == 0
    lines = (tmp_path / "result.json").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["completed"] == 3 for line in lines)
