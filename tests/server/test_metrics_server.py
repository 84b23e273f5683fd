"""GET /metrics of a real `pagedllm serve`: every metric issue 4 names is exported under `pagedllm:` with the
model_name label, the counters and histograms move by exactly what the responses report, the gauges are back
at 0 when the server is idle, the stats line is logged while busy (and only then), and every metric the
Grafana dashboard (docs/grafana.json) queries is one the server exports.

One server of its own for this module (not the shared session server): it sets $PAGEDLLM_STATS_LOG_INTERVAL
to keep the stats-line test short, and a served model name to check the label. Like every route but /health
and /ping, /metrics wants the API key when the server has one.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_utils import API_KEY, ROOT, RemoteServer

MODEL = "metrics-model"
STATS_INTERVAL_S = 0.25
# The metrics issue 4 lists (family names: counters without _total, histograms without _bucket/_sum/_count).
ISSUE_METRICS = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "iteration_tokens": "histogram",
}
# Histograms observed once per finished request.
PER_REQUEST_HISTOGRAMS = [
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
]
STATS_LINE = re.compile(
    r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
    r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%"
)
# A prompt of several full KV blocks (16 tokens each): sent twice, the second finds them in the prefix cache.
LONG_PROMPT = (
    "A paged KV cache stores keys and values in fixed-size blocks, so that requests can share the blocks "
    "of a common prefix and memory is never wasted on padding. The scheduler"
)


@pytest.fixture(scope="module")
def metrics_server():
    srv = RemoteServer(
        "--enable-debug-routes",
        "--served-model-name",
        MODEL,
        api_key=API_KEY,
        env={"PAGEDLLM_STATS_LOG_INTERVAL": str(STATS_INTERVAL_S)},
    )
    yield srv
    srv.stop()


def scrape(srv: RemoteServer) -> tuple[dict[str, Any], dict[tuple[str, frozenset], float]]:
    """(families by name, {(sample name, labels without model_name and engine): value}) of the pagedllm: metrics
    (this server runs one engine: every series is engine "0")."""
    status, text = srv.request("GET", "/metrics")
    assert status == 200, text
    families, samples = {}, {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("pagedllm:"):
            continue
        families[family.name] = family
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            assert s.labels.get("engine") == "0", s
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            samples[(s.name, labels)] = s.value
    return families, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((f"pagedllm:{name}", frozenset(labels.items())), 0.0)


def complete(srv: RemoteServer, prompt: str, **kw: Any) -> Any:
    return srv.client().completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def test_metrics_endpoint_names_labels_and_key(metrics_server):
    status, _ = metrics_server.request("GET", "/metrics", headers={})
    assert status == 401  # the server has an API key
    families, samples = scrape(metrics_server)
    for name, kind in ISSUE_METRICS.items():
        family = families.get(f"pagedllm:{name}")
        assert family is not None, f"pagedllm:{name} is not exported"
        assert family.type == kind, (name, family.type)
        assert family.samples, name  # a series with the model_name label exists from the start
    assert value(samples, "num_requests_running") == 0
    assert value(samples, "num_requests_waiting") == 0


def test_counters_and_histograms_move_with_requests(metrics_server):
    metrics_server.wait_idle()
    _, before = scrape(metrics_server)
    responses = [
        complete(metrics_server, "The capital of France is", max_tokens=7, extra_body={"ignore_eos": True}),
        complete(metrics_server, LONG_PROMPT, max_tokens=4, extra_body={"ignore_eos": True}),
        complete(metrics_server, LONG_PROMPT, max_tokens=4, extra_body={"ignore_eos": True}),
    ]
    # A stop string: a word in the middle of the greedy continuation (found by the front end, which then aborts
    # the request in the core).
    text = responses[0].choices[0].text
    stop = text.strip().split()[1]
    responses.append(complete(metrics_server, "The capital of France is", max_tokens=16, stop=[stop]))
    reasons = [r.choices[0].finish_reason for r in responses]
    assert reasons == ["length", "length", "length", "stop"], reasons
    prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    gen_tokens = sum(r.usage.completion_tokens for r in responses)
    metrics_server.wait_idle()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    deadline = time.monotonic() + 10
    while True:  # the stats of the last step may be recorded just after its response was sent
        _, after = scrape(metrics_server)
        if delta("request_success_total", finished_reason="stop") == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("generation_tokens_total") == gen_tokens
    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("request_success_total", finished_reason="stop") == 1
    n = len(responses)
    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(f"{name}_count") == n, name
    assert delta("request_prompt_tokens_sum") == prompt_tokens
    assert delta("request_generation_tokens_sum") == gen_tokens
    # One token per step: every token after a request's first is one inter-token gap.
    assert delta("inter_token_latency_seconds_count") == gen_tokens - n
    assert delta("iteration_tokens_count") > 0
    # The second LONG_PROMPT found the first one's full blocks in the prefix cache.
    assert delta("prefix_cache_queries_total") >= prompt_tokens
    assert delta("prefix_cache_hits_total") >= 16
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_decode_time_seconds"):
        assert delta(f"{name}_sum") >= 0, name
    assert delta("e2e_request_latency_seconds_sum") >= delta("time_to_first_token_seconds_sum") > 0
    # Idle again: nothing running or waiting, no KV block in use (also after the stop-string abort).
    assert value(after, "num_requests_running") == 0
    assert value(after, "num_requests_waiting") == 0
    assert value(after, "kv_cache_usage_perc") == 0


def test_stats_line_logged_while_busy_only(metrics_server):
    metrics_server.wait_idle()
    start = len(STATS_LINE.findall(metrics_server.log_text()))
    # Decoding 256 tokens spans several stats intervals even at the quantized model's ~170 tokens/s on two cores
    # (the first step after an idle spell logs a line at once, with the throughput averaged over the idle time).
    # The API server logs the line after its step's output: wait for it, bounded, rather than read the log at once.
    complete(metrics_server, "Once upon a time", max_tokens=256, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:
        lines = STATS_LINE.findall(metrics_server.log_text())[start:]
        busy = [line for line in lines if not re.search(r"Avg generation throughput: 0\.0 ", line)]
        if busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert busy, metrics_server.log_text()[-3000:]
    time.sleep(2 * STATS_INTERVAL_S)  # the last step's line, if it logged one, is in the log by now
    settled = len(STATS_LINE.findall(metrics_server.log_text()))
    time.sleep(4 * STATS_INTERVAL_S)  # idle: no new line
    assert len(STATS_LINE.findall(metrics_server.log_text())) == settled


def _dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []))
            walk(panel.get("panels", []))  # panels inside collapsed rows

    walk(dashboard["panels"])
    return exprs


def test_grafana_dashboard_uses_exported_metrics(metrics_server):
    dashboard = json.loads((ROOT / "docs" / "grafana.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model_var = variables["model_name"]
    query = model_var["query"]["query"] if isinstance(model_var["query"], dict) else model_var["query"]
    assert query == "label_values(pagedllm:num_requests_running, model_name)"
    exprs = _dashboard_exprs(dashboard)
    assert exprs
    for expr in exprs:
        assert 'model_name="$model_name"' in expr, expr  # every series is filtered by the model variable
    used = set(re.findall(r"pagedllm:[A-Za-z0-9_]+", " ".join(exprs + [query])))
    complete(metrics_server, "Hello", max_tokens=2)
    families, samples = scrape(metrics_server)
    exported = {name for name, _ in samples}
    assert used <= exported, sorted(used - exported)
    # And the dashboard shows every metric of the issue.
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert {f"pagedllm:{name}" for name in ISSUE_METRICS} <= bases, sorted(
        {f"pagedllm:{name}" for name in ISSUE_METRICS} - bases
    )
