"""`bench serve`'s statistics, request bodies, arrival times and CLI validation, on hand-computable inputs."""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import pytest

from pagedllm.benchmarks import serve
from pagedllm.benchmarks.datasets import SampleRequest
from pagedllm.benchmarks.serve import RequestResult


def _result(start, ttft, itl, e2el, out, prompt_len=10, success=True) -> RequestResult:
    return RequestResult(
        success=success,
        error="" if success else "HTTP 400: too long",
        prompt_len=prompt_len,
        expected_output_len=out,
        output_tokens=out if success else 0,
        ttft=ttft,
        itl=list(itl),
        e2el=e2el,
        start=start,
        end=start + e2el,
    )


def test_summarize_percentiles_and_scale():
    stats = serve.summarize([1, 2, 3, 4, 5], [50, 90, 99, 99.9])
    assert stats["mean"] == 3 and stats["median"] == 3 and stats["p50"] == 3
    assert stats["p90"] == pytest.approx(4.6)  # linear interpolation: 1 + 0.9 * 4
    assert stats["p99"] == pytest.approx(4.96)
    assert stats["p99.9"] == pytest.approx(4.996)
    assert stats["std"] == pytest.approx(math.sqrt(2))
    assert serve.summarize([0.5, 1.5], [50], scale=1e3) == {"mean": 1000, "median": 1000, "std": 500, "p50": 1000}
    assert serve.summarize([], [90]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0}


def test_tpot_and_goodput():
    fast = _result(0.0, ttft=0.1, itl=[0.02] * 4, e2el=0.3, out=5)  # tpot (0.3 - 0.1) / 4 = 50 ms
    slow = _result(0.0, ttft=0.5, itl=[0.1], e2el=0.7, out=2)  # tpot 200 ms
    single = _result(0.0, ttft=0.2, itl=[], e2el=0.2, out=1)  # tpot 0: one token
    failed = _result(0.0, ttft=0.0, itl=[], e2el=0.01, out=3, success=False)
    assert fast.tpot == pytest.approx(0.05) and slow.tpot == pytest.approx(0.2) and single.tpot == 0.0
    results = [fast, slow, single, failed]
    assert serve.count_good(results, {"ttft": 200}) == 2  # fast, single; the failed one never counts
    assert serve.count_good(results, {"ttft": 200, "tpot": 40}) == 1  # single only
    assert serve.count_good(results, {"e2el": 300}) == 2  # <= is within: fast (300 ms) and single
    assert serve.count_good(results, {"ttft": 0}) == 0
    assert serve.count_good(results, {"ttft": 1e9, "tpot": 1e9, "e2el": 1e9}) == 3


def test_calculate_metrics_by_hand():
    results = [
        _result(0.0, ttft=0.1, itl=[0.02] * 4, e2el=0.3, out=5, prompt_len=7),
        _result(0.5, ttft=0.5, itl=[0.1], e2el=0.7, out=2, prompt_len=3),
        _result(0.0, ttft=0.0, itl=[], e2el=0.01, out=3, prompt_len=100, success=False),
    ]
    m = serve.calculate_metrics(results, duration_s=2.0, percentiles=[50, 90], slos_ms={"ttft": 200})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (10, 7)  # failed requests do not count
    assert m["request_throughput"] == 1.0 and m["request_goodput"] == 0.5
    assert m["output_throughput"] == 3.5 and m["total_token_throughput"] == 8.5
    assert m["mean_ttft_ms"] == pytest.approx(300) and m["p50_ttft_ms"] == pytest.approx(300)
    assert m["p90_ttft_ms"] == pytest.approx(460)
    assert m["mean_tpot_ms"] == pytest.approx(125)  # (50 + 200) / 2
    assert m["mean_itl_ms"] == pytest.approx((4 * 20 + 100) / 5) and m["median_itl_ms"] == pytest.approx(20)
    assert m["mean_e2el_ms"] == pytest.approx(500)
    assert m["max_concurrent_requests"] == 2  # the failed request [0, 0.01] overlaps the first one
    # chunks: request 1 at 0.1, 0.12, ..., 0.18 (5 tokens), request 2 at 1.0 and 1.1 (2 tokens)
    assert m["max_output_tokens_per_s"] == 5.0
    assert serve.calculate_metrics(results, 2.0, [50])["request_goodput"] is None


def test_output_rate_series_and_peak_concurrency():
    a = _result(0.0, ttft=0.5, itl=[1.0], e2el=1.6, out=4)  # 2 chunks of 2 tokens at 0.5 s and 1.5 s
    b = _result(1.6, ttft=0.1, itl=[], e2el=0.2, out=1)  # 1 token at 1.7 s; starts as `a` ends
    times, rates = serve.output_rate_series([a, b], bucket_s=1.0)
    assert times.tolist() == [0.0, 1.0] and rates.tolist() == [2.0, 3.0]
    assert serve.output_rate_series([a, b], bucket_s=0.5)[1].tolist() == [0.0, 4.0, 0.0, 6.0]
    assert serve.peak_concurrency([a, b]) == 1  # back to back: no overlap
    c = _result(1.5, ttft=0.1, itl=[], e2el=0.2, out=1)
    assert serve.peak_concurrency([a, b, c]) == 2


def test_arrival_offsets():
    assert serve.arrival_offsets(4, math.inf, 1.0, seed=0) == [0.0] * 4
    offsets = serve.arrival_offsets(2000, 10.0, 1.0, seed=0)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.1, rel=0.1)  # Poisson: exponential gaps of mean 1/rate
    assert gaps.std() == pytest.approx(0.1, rel=0.15)  # exponential: std == mean
    bursty = np.diff(serve.arrival_offsets(2000, 10.0, 0.25, seed=0))
    assert bursty.mean() == pytest.approx(0.1, rel=0.15) and bursty.std() > 1.5 * gaps.std()
    assert serve.arrival_offsets(3, 5.0, 1.0, seed=7) == serve.arrival_offsets(3, 5.0, 1.0, seed=7)


def _args(**kw) -> argparse.Namespace:
    args = serve.add_arguments(argparse.ArgumentParser()).parse_args([])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def test_payloads_are_plain_openai_bodies():
    req = SampleRequest("t5 t6", [5, 6], 2, 7)
    body = serve.build_payload(_args(), "m", req)
    assert body == {
        "model": "m",
        "prompt": "t5 t6",
        "max_tokens": 7,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = serve.build_payload(_args(endpoint="/v1/chat/completions", ignore_eos=True, temperature=0.5), "m", req)
    assert chat["messages"] == [{"role": "user", "content": "t5 t6"}] and chat["max_completion_tokens"] == 7
    assert chat["ignore_eos"] is True and chat["temperature"] == 0.5 and "prompt" not in chat


def test_urls_and_tokenizer_resolution(tmp_path):
    assert serve.server_urls(_args()) == ("http://127.0.0.1:8000/v1/completions", "http://127.0.0.1:8000/v1/models")
    args = _args(base_url="http://h:1/v1/", endpoint="/v1/chat/completions")
    assert serve.server_urls(args) == ("http://h:1/v1/chat/completions", "http://h:1/v1/models")
    assert serve.resolve_tokenizer_path(_args(model="served-name")) is None
    assert serve.resolve_tokenizer_path(_args(model=str(tmp_path))) == str(tmp_path)
    assert serve.resolve_tokenizer_path(_args(model=str(tmp_path), tokenizer="tok")) == "tok"


def test_models_in_turn():
    assert [serve.model_of(i, ["a", "b", "c"], 2) for i in range(8)] == ["a", "a", "b", "b", "c", "c", "a", "a"]
    assert {serve.model_of(i, ["only"], 10) for i in range(25)} == {"only"}


def test_parsers():
    assert serve.parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert serve.parse_slo("tpot:12.5") == ("tpot", 12.5)
    for bad in ("0,50", "50,abc", "101", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad).replace("(", r"\(")):
            serve.parse_percentiles(bad)
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:x", "e2el:inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            serve.parse_slo(bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--goodput", "ttft:5", "latency:3"], "invalid goodput SLO 'latency:3'"),
        (["--request-rate", "0"], "--request-rate must be > 0 (or inf), got 0.0"),
        (["--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1, got 0"),
        (["--burstiness", "-1"], "--burstiness must be a positive number, got -1.0"),
        (["--endpoint", "/v1/embeddings"], "got '/v1/embeddings'"),
        (["--dataset-name", "sonnet"], "invalid choice: 'sonnet'"),
        (["--metric-percentiles", "50,200"], "percentiles must be in (0, 100], got '50,200'"),
        (["--models", "a", "b", "--switch-every", "0"], "--switch-every must be at least 1, got 0"),
        (["--models", "a", "b", "--model", "a"], "--model and --models are exclusive"),
        (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "--backend openai does not send to"),
        (["--backend", "tgi"], "invalid choice: 'tgi'"),
        (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics takes a comma-separated list"),
        (["--header", "novalue"], "--header takes KEY=VALUE items, got 'novalue'"),
        (["--extra-body", "[1]"], "argument --extra-body: invalid json_object value"),
        (["--append-result"], "--append-result needs --result-filename"),
        (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
    ],
)
def test_bad_cli_input_names_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_is_a_clear_error(capsys):
    # port 9 (discard) on loopback: nothing listens there in the test environment
    assert serve.main(["--base-url", "http://127.0.0.1:9", "--disable-tqdm"]) == 2
    assert "cannot reach the server at http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SystemExit) as exc:
        serve.main(["--plot", "out.png"])
    assert exc.value.code == 2
    assert "--plot needs matplotlib: pip install 'pagedllm[bench]'" in capsys.readouterr().err


def test_tokenizer_from_the_served_models_root(tmp_path, monkeypatch, capsys):
    """--tokenizer; else the `root` of the served model's card where it is a path here that loads (an adapter's: its
    base model's); else the old choice (--model as a path, else the default model's), with a warning saying why."""
    monkeypatch.setattr(serve, "load_tokenizer", lambda path: f"tokenizer of {path}")
    base = {"id": "base", "root": str(tmp_path)}
    adapter = {"id": "adapter", "root": str(tmp_path / "adapter"), "parent": "base"}
    assert serve.choose_tokenizer(_args(), base, [base]) == (str(tmp_path), f"tokenizer of {tmp_path}")
    assert serve.choose_tokenizer(_args(), adapter, [base, adapter])[0] == str(tmp_path)
    assert serve.choose_tokenizer(_args(tokenizer="tok"), base, [base])[0] == "tok"
    assert capsys.readouterr().err == ""
    hub = {"id": "m", "root": "Org/Model-7B"}  # a vLLM server's root: a hub name
    assert serve.choose_tokenizer(_args(), hub, [hub]) == (None, "tokenizer of None")
    assert "root 'Org/Model-7B' is not a path on this machine" in capsys.readouterr().err
    assert serve.choose_tokenizer(_args(model=str(tmp_path)), {"id": "m"}, [])[0] == str(tmp_path)
    assert "gives no root" in capsys.readouterr().err

    def load(path):
        if path is not None:
            raise OSError("no tokenizer files")
        return "default"

    monkeypatch.setattr(serve, "load_tokenizer", load)
    assert serve.choose_tokenizer(_args(), base, [base]) == (None, "default")
    assert "does not load as a tokenizer (OSError: no tokenizer files)" in capsys.readouterr().err
