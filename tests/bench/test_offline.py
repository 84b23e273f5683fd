"""`pagedllm bench throughput` (--no-hf) and `pagedllm bench latency` end to end on the tiny random Llama.

Each run goes through the `pagedllm` command's parser (`cli.main`) and is checked on the JSON it writes. The
engine core runs in-process ($PAGEDLLM_ENGINE_CLIENT=inproc): the benchmarks' code is the same, and a test
does not pay for spawning and stopping an engine process per run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedllm.entrypoints.cli import main as cli_main


@pytest.fixture(autouse=True)
def _inproc_engine(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENGINE_CLIENT", "inproc")


def _throughput(model: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "throughput.jsonl"
    argv = ["bench", "throughput", "--model", model, "--no-hf", "--no-warmup", "--disable-tqdm", "--num-threads", "1"]
    assert cli_main([*argv, "--json-out", str(out), *extra]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_throughput_random_keeps_its_flags_and_record(tiny_llama, tmp_path):
    rec = _throughput(
        tiny_llama, tmp_path, "--num-prompts", "5", "--input-len-range", "8-24", "--output-len-range", "2-6"
    )
    assert rec["mode"] == "throughput" and rec["model"] == tiny_llama
    assert rec["workload"] == {
        "dataset": "random",
        "num_prompts": 5,
        "input_range": [8, 24],
        "output_range": [2, 6],
        "seed": 0,
    }
    (row,) = rec["results"]
    assert row["engine"] == "pagedllm" and row["requests"] == 5 and row["length_mismatches"] == 0
    assert 5 * 8 <= row["prompt_tokens"] <= 5 * 24 and 5 * 2 <= row["output_tokens"] <= 5 * 6
    assert row["req_per_s"] == pytest.approx(5 / row["wall_s"])
    assert row["output_tok_per_s"] == pytest.approx(row["output_tokens"] / row["wall_s"])
    assert row["total_tok_per_s"] == pytest.approx((row["prompt_tokens"] + row["output_tokens"]) / row["wall_s"])


def test_throughput_prefix_repetition(tiny_llama, tmp_path, capsys):
    rec = _throughput(
        tiny_llama,
        tmp_path,
        *("--dataset", "prefix-repetition", "--num-prompts", "6", "--prefix-repetition-prefix-len", "24"),
        *("--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2"),
        *("--prefix-repetition-output-len", "3"),
    )
    assert rec["workload"]["dataset"] == "prefix-repetition"
    assert rec["workload"]["prefix_repetition_num_prefixes"] == 2
    (row,) = rec["results"]
    assert row["requests"] == 6 and row["length_mismatches"] == 0
    assert row["prompt_tokens"] == 6 * 32 and row["output_tokens"] == 6 * 3  # exact with the tiny tokenizer
    assert "workload: 6 requests from prefix-repetition" in capsys.readouterr().out


def test_throughput_sharegpt_and_bad_dataset_input(tiny_llama, sharegpt_file, tmp_path, capsys):
    rec = _throughput(
        tiny_llama, tmp_path, "--dataset", "sharegpt", "--dataset-path", sharegpt_file, "--num-prompts", "3"
    )
    (row,) = rec["results"]
    assert row["prompt_tokens"] == 5 + 3 + 4 and row["output_tokens"] == 3 + 6 + 2  # SHAREGPT_PAIRS' word counts
    argv = ["bench", "throughput", "--model", tiny_llama, "--no-hf", "--dataset", "sharegpt"]
    with pytest.raises(SystemExit, match="--dataset sharegpt needs --dataset-path to a ShareGPT JSON file, got None"):
        cli_main(argv)
    with pytest.raises(SystemExit, match="applies to --mode throughput only"):
        cli_main([*argv, "--dataset-path", sharegpt_file, "--mode", "decode"])


def test_latency_reports_prefill_decode_and_batch_latency(tiny_llama, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", tiny_llama, "--batch-size", "3", "--input-len", "8", "--output-len", "5"]
    argv += ["--num-iters", "3", "--num-iters-warmup", "1", "--kv-cache-memory", "16MiB", "--num-threads", "1"]
    assert cli_main([*argv, "--output-json", str(out), "--disable-tqdm"]) == 0
    rec = json.loads(out.read_text())
    assert (rec["batch_size"], rec["input_len"], rec["output_len"], rec["num_iters"]) == (3, 8, 5, 3)
    assert rec["model"] == tiny_llama
    full, prefill, decode = rec["latencies"], rec["prefill_latencies"], rec["decode_per_token_latencies"]
    assert len(full) == len(prefill) == len(decode) == 3  # the warm-up iteration is not reported
    # Structure, not timings: prefill and batch latency come from the same call, so these hold by construction.
    for f, p, d in zip(full, prefill, decode):
        assert 0 <= p <= f and d >= 0 and d == pytest.approx((f - p) / 4)
    for key, values in (("latency_s", full), ("prefill_s", prefill), ("decode_per_token_s", decode)):
        stats = rec[key]
        assert stats["avg"] == pytest.approx(sum(values) / 3)
        assert min(values) <= stats["p50"] <= stats["p90"] <= stats["p99"] <= max(values)
    assert rec["avg_latency"] == pytest.approx(rec["latency_s"]["avg"])
    printed = capsys.readouterr().out
    assert "batch 3 x (8 prompt + 5 output tokens), 3 timed iterations" in printed
    assert "decode per token (ms)" in printed


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--output-len", "1", "--output-len must be at least 2, got 1"),
        ("--batch-size", "0", "--batch-size must be at least 1, got 0"),
        ("--num-iters-warmup", "-1", "--num-iters-warmup must be >= 0, got -1"),
    ],
)
def test_latency_bad_input_names_the_value(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "latency", flag, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_latency_prompt_longer_than_the_model_is_an_error(tiny_llama, capsys):
    argv = ["bench", "latency", tiny_llama, "--max-model-len", "16", "--input-len", "12", "--output-len", "8"]
    assert cli_main([*argv, "--kv-cache-memory", "1MiB", "--disable-tqdm"]) == 2
    assert "error: --input-len 12 + --output-len 8 exceeds max_model_len 16" in capsys.readouterr().err
