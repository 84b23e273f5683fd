"""Online serving benchmark: `pagedllm bench serve` against any running OpenAI-compatible server (vLLM's too).

Contract. Requests come from a dataset (`datasets.py`: random, sharegpt, prefix-repetition) and arrive as a
Poisson process at ``--request-rate`` (gamma inter-arrival times with shape ``--burstiness``; ``inf``, the
default, sends them all at once), at most ``--max-concurrency`` in flight. Each request is a plain OpenAI body
(``/v1/completions``: prompt + max_tokens; ``/v1/chat/completions``: one user message + max_completion_tokens)
with ``temperature`` (default 0), ``stream=true`` and ``stream_options.include_usage``; the only extra field is
vLLM's ``ignore_eos``, sent with ``--ignore-eos``. With ``--models A B C`` (a router's models) the requests, in
dataset order, name A for ``--switch-every`` requests, then B, then C, then A again. For each request, timed on the
client:

* TTFT: from sending the request to the first chunk carrying text;
* ITL: the gaps between consecutive chunks carrying text (a chunk normally carries one token);
* E2EL: from sending the request to the end of its stream;
* TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
* output tokens: ``usage.completion_tokens`` of the final chunk when the server sends it, else the generated
  text tokenized with the benchmark's tokenizer.

The benchmark's tokenizer (prompt lengths, and output lengths without usage) is ``--tokenizer``'s; else the served
model's, from the ``root`` of its ``GET /v1/models`` card when that is a path on this machine that loads (a pagedllm
server's root is its model file or folder); else ``--model``'s when it is a path, else the default model's, with a
warning that says why.

The report (printed like vLLM's, saved as JSON with ``--save-result``) gives mean, median, std and the
``--metric-percentiles`` of TTFT, TPOT, ITL and E2EL in ms over successful requests; request, output-token and
total-token throughput over the benchmark's wall time; peak output tok/s (1 s buckets) and peak concurrency;
and, with ``--goodput ttft:MS tpot:MS e2el:MS``, the rate of requests meeting every given SLO. A failed request
(HTTP error, an error event in the stream, a dropped connection) is counted, never retried, and each distinct
error is printed once. Exit status: 0 when at least one request succeeded, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest, add_dataset_args, encode, load_tokenizer, sample_requests
from pagedllm.config import json_object as parse_json_object

DEFAULT_PROG = "pagedllm bench serve"
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (  # (key, label, title of the block)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
# vLLM bench serve's sampling flags, sent in each body when given
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
BACKENDS = ("openai", "vllm", "openai-chat", "vllm-chat")  # vLLM's names of the OpenAI-compatible request shapes
HTTP_TIMEOUT_S = 6 * 3600.0  # a request may legitimately wait long in a saturated server's queue


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    expected_output_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # [num_text_chunks - 1] s
    e2el: float = 0.0  # s
    start: float = 0.0  # s since the benchmark started
    end: float = 0.0  # s since the benchmark started

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for a request with at most one output token."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


# ---- statistics ----------------------------------------------------------------------------------------------


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values: Sequence[float], percentiles: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, median, std and each percentile (numpy's linear interpolation) of `values` times `scale`;
    all 0 for no values."""
    arr = np.asarray(values, dtype=np.float64) * scale
    if arr.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{percentile_key(p): 0.0 for p in percentiles}}
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    stats.update({percentile_key(p): float(np.percentile(arr, p)) for p in percentiles})
    return stats


def count_good(results: Sequence[RequestResult], slos_ms: dict[str, float]) -> int:
    """Successful requests whose TTFT, TPOT and E2EL (those named in `slos_ms`, in ms) are all within their SLO."""
    good = 0
    for r in results:
        if r.success:
            values_ms = {"ttft": r.ttft * 1e3, "tpot": r.tpot * 1e3, "e2el": r.e2el * 1e3}
            good += all(values_ms[k] <= slo for k, slo in slos_ms.items())
    return good


def token_times(r: RequestResult) -> tuple[np.ndarray, float]:
    """Arrival times (s since the benchmark started) of a request's text chunks, and tokens per chunk."""
    times = r.start + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
    return times, r.output_tokens / len(times)


def output_rate_series(results: Sequence[RequestResult], bucket_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bucket start times, output tok/s in each bucket), chunks weighted by their request's tokens per chunk."""
    ok = [r for r in results if r.success and r.output_tokens > 0]
    if not ok:
        return np.zeros(0), np.zeros(0)
    pairs = [token_times(r) for r in ok]
    times = np.concatenate([t for t, _ in pairs])
    weights = np.concatenate([np.full(len(t), w) for t, w in pairs])
    num = int(times.max() // bucket_s) + 1
    counts = np.bincount((times // bucket_s).astype(np.int64), weights=weights, minlength=num)
    return np.arange(num) * bucket_s, counts / bucket_s


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once (from their start and end times)."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results], key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, delta in events:  # at equal times an end (-1) sorts first: back-to-back requests do not overlap
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The summary: counts, throughputs over `duration_s`, goodput, and latency stats in ms (``mean_ttft_ms``,
    ``p99_itl_ms``, ...) over successful requests."""
    ok = [r for r in results if r.success]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": count_good(ok, slos_ms) / duration_s if slos_ms else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": float(output_rate_series(ok)[1].max(initial=0.0)),
        "max_concurrent_requests": peak_concurrency(results),
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for key, values in samples.items():
        for stat, value in summarize(values, percentiles, scale=1e3).items():
            metrics[f"{stat}_{key}_ms"] = value
    return metrics


# ---- one request ---------------------------------------------------------------------------------------------


def build_payload(args: argparse.Namespace, model: str, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if is_chat(args.endpoint):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    stream = not getattr(args, "no_stream", False)
    body["temperature"] = args.temperature
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; plain OpenAI servers ignore or reject it
    for name in SAMPLING_FLAGS:  # vLLM's bench sends these when given
        value = getattr(args, name, None)
        if value is not None:
            body[name] = value
    if getattr(args, "logprobs", None) is not None:
        if is_chat(args.endpoint):
            body.update(logprobs=True, top_logprobs=args.logprobs)
        else:
            body["logprobs"] = args.logprobs
    if getattr(args, "use_beam_search", False):
        body["use_beam_search"] = True
    body.update(getattr(args, "extra_body", None) or {})
    return body


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


def _error_message(body: bytes | str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body itself."""
    try:
        err = json.loads(body)
        message = err.get("error", err) if isinstance(err, dict) else err
        message = message.get("message", message) if isinstance(message, dict) else message
    except ValueError:
        message = body.decode(errors="replace") if isinstance(body, bytes) else body
    return str(message).strip()[:300]


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return text or ""


def _choice_text(choice: dict[str, Any]) -> str:
    """A non-streamed choice's text: a completion's, or a chat message's content."""
    text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
    return text or ""


async def _post_once(
    client: Any, url: str, headers: dict[str, str], payload: dict[str, Any], result: RequestResult
) -> int | None:
    """--no-stream: one request, one answer (its first choice's text into `result`); its usage's output tokens."""
    resp = await client.post(url, json=payload, headers=headers)
    if resp.status_code != 200:
        result.error = f"HTTP {resp.status_code}: {_error_message(resp.content)}"
        return None
    answer = resp.json()
    result.generated_text = "".join(_choice_text(c) for c in (answer.get("choices") or [])[:1])
    result.success = True
    return (answer.get("usage") or {}).get("completion_tokens")


async def send_request(
    client: Any, url: str, headers: dict[str, str], payload: dict[str, Any], req: SampleRequest, t0: float
) -> RequestResult:
    """Stream one request and time it (with "stream": false, wait for its one answer: TTFT is then its whole
    time); never raises for a failed request (`success=False`, `error` set)."""
    result = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.expected_output_len)
    usage_tokens: int | None = None
    sent = last = time.perf_counter()
    result.start = sent - t0
    first = True
    try:
        if not payload.get("stream", True):
            usage_tokens = await _post_once(client, url, headers, payload, result)
        else:
            async with client.stream("POST", url, json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                else:
                    async for line in resp.aiter_lines():
                        data = line.strip().removeprefix("data:").strip() if line.startswith("data:") else ""
                        if not data:
                            continue
                        if data == "[DONE]":
                            break
                        now = time.perf_counter()
                        chunk = json.loads(data)
                        if "error" in chunk:
                            result.error = f"error in stream: {_error_message(data)}"
                            break
                        if chunk.get("usage"):
                            usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                        text = _chunk_text(chunk)
                        if text:
                            if first:
                                result.ttft, first = now - sent, False
                            else:
                                result.itl.append(now - last)
                            last = now
                            result.generated_text += text
                    result.success = not result.error
    except Exception as e:  # a dropped connection or a malformed stream fails this request, not the run
        result.error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    result.e2el, result.end = end - sent, end - t0
    if result.success and first:  # no text streamed (an immediate eos, or not streamed): the first answer was the last
        result.ttft = result.e2el
    result.output_tokens = usage_tokens if usage_tokens is not None else -1
    return result


def fill_output_tokens(results: Sequence[RequestResult], tokenizer: Any) -> None:
    """Requests the server sent no usage for (output_tokens < 0) count their text's tokens; failed ones 0."""
    for r in results:
        if not r.success:
            r.output_tokens = 0
        elif r.output_tokens < 0:
            r.output_tokens = len(encode(tokenizer, r.generated_text))


# ---- the run -----------------------------------------------------------------------------------------------------


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent (s after the start): gamma inter-arrival times with mean 1/rate and shape
    `burstiness` (1: Poisson); all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:num]


def model_of(index: int, models: Sequence[str], switch_every: int) -> str:
    """The model request `index` names: each of `models` in turn, `switch_every` requests each."""
    return models[(index // switch_every) % len(models)]


async def run_requests(
    args: argparse.Namespace,
    models: Sequence[str],
    requests: list[SampleRequest],
    headers: dict[str, str],
    warmups: Sequence[SampleRequest] = (),
) -> tuple[list[RequestResult], float]:
    """Send `warmups` one after another, untimed (to each model in turn), then every request on schedule (to the
    models in turn, see model_of); returns the results in dataset order and the wall time (s)."""
    import httpx
    from tqdm import tqdm

    url, models_url = server_urls(args)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    limit = args.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit or len(requests))
    bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr, disable=args.disable_tqdm)
    async with httpx.AsyncClient(timeout=httpx.Timeout(HTTP_TIMEOUT_S), limits=limits) as client:
        # One untimed request first: the client's lazy set-up (imports, first connection) would otherwise
        # block the event loop inside the first timed request and delay every other request's start.
        with contextlib.suppress(httpx.HTTPError):
            await client.get(models_url, headers=headers)
        for i, req in enumerate(warmups):  # untimed, uncounted: the server's first steps
            result = await send_request(client, url, headers, build_payload(args, model_of(i, models, 1), req), req, 0)
            if not result.success:
                print(f"WARNING: warm-up request {i} failed: {result.error}", file=sys.stderr)
        t0 = time.perf_counter()

        async def one(index: int, req: SampleRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            payload = build_payload(args, model_of(index, models, args.switch_every), req)
            sent = (
                {**headers, "X-Request-Id": f"{args.request_id_prefix}{index}"} if args.request_id_prefix else headers
            )
            if semaphore is None:
                result = await send_request(client, url, sent, payload, req, t0)
            else:
                async with semaphore:
                    result = await send_request(client, url, sent, payload, req, t0)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i, r, o) for i, (r, o) in enumerate(zip(requests, offsets))))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def server_urls(args: argparse.Namespace) -> tuple[str, str]:
    """(request URL, models URL) from --base-url or --host/--port and --endpoint."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if base.endswith("/v1") and args.endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]  # tolerate the OpenAI-client style http://host:port/v1
    return base + args.endpoint, base + "/v1/models"


def fetch_models(models_url: str, headers: dict[str, str], wait_s: float = 0.0) -> list[dict[str, Any]]:
    """The cards of GET /v1/models; `wait_s`: how long to keep trying while the server does not answer yet."""
    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        try:
            resp = httpx.get(models_url, headers=headers, timeout=30.0)
            break
        except httpx.HTTPError as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the server at {models_url}: {e}") from None
            time.sleep(1.0)
    if resp.status_code != 200:
        raise ValueError(f"GET {models_url} failed: HTTP {resp.status_code}: {_error_message(resp.content)}")
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"GET {models_url} lists no model; pass --model")
    return data


def resolve_tokenizer_path(args: argparse.Namespace) -> str | None:
    """--tokenizer, else --model when it is a local path, else None (the default model's tokenizer)."""
    if args.tokenizer:
        return args.tokenizer
    if args.model and os.path.exists(os.path.expanduser(args.model)):
        return args.model
    return None


def served_root(card: dict[str, Any], cards: Sequence[dict[str, Any]]) -> str | None:
    """The `root` GET /v1/models gives for a model (a LoRA adapter's: its base model's, its `parent`)."""
    parent = card.get("parent")
    if parent:
        card = next((c for c in cards if c.get("id") == parent), card)
    root = card.get("root")
    return root if isinstance(root, str) and root else None


def choose_tokenizer(
    args: argparse.Namespace, card: dict[str, Any], cards: Sequence[dict[str, Any]]
) -> tuple[str | None, Any]:
    """(its path, the tokenizer) that counts tokens: --tokenizer; else the served model's `root` where it is a path
    on this machine that loads (a pagedllm server's is its model file or folder); else `resolve_tokenizer_path`'s
    choice (--model when it is a path, else the default model's), with a warning saying why."""
    if args.tokenizer:
        return args.tokenizer, load_tokenizer(args.tokenizer)
    root = served_root(card, cards)
    if root is None:
        reason = "GET /v1/models gives no root for the model"
    elif not os.path.exists(os.path.expanduser(root)):
        reason = f"the served model's root {root!r} is not a path on this machine"
    else:
        try:
            return root, load_tokenizer(root)
        except Exception as e:  # noqa: BLE001 - any failure to load falls back, named in the warning
            reason = f"the served model's root {root!r} does not load as a tokenizer ({type(e).__name__}: {e})"
    fallback = resolve_tokenizer_path(args)
    print(
        f"WARNING: {reason}: counting tokens with the tokenizer of {fallback or 'the default model'} "
        "(--tokenizer names one)",
        file=sys.stderr,
    )
    return fallback, load_tokenizer(fallback)


# ---- report ------------------------------------------------------------------------------------------------------


def print_summary(metrics: dict[str, Any], args: argparse.Namespace, percentiles: Sequence[float]) -> None:
    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        print(f"{label:<40}{fmt.format(value) if isinstance(value, float) else value}")

    print(f"{' Serving Benchmark Result ':=^50}")
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Maximum request concurrency:", args.max_concurrency or "unlimited")
    row("Request rate configured (RPS):", args.request_rate)
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    if metrics["request_goodput"] is not None:
        row("Request goodput (req/s):", metrics["request_goodput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"])
    row("Peak concurrent requests:", metrics["max_concurrent_requests"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    shown = getattr(args, "percentile_metrics", None) or [k for k, _, _ in LATENCY_METRICS]
    for key, label, title in LATENCY_METRICS:
        if key not in shown:
            continue
        print(f"{title:-^50}")
        row(f"Mean {label} (ms):", metrics[f"mean_{key}_ms"])
        row(f"Median {label} (ms):", metrics[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{percentile_key(p)[1:]} {label} (ms):", metrics[f"{percentile_key(p)}_{key}_ms"])
    print("=" * 50)


def print_errors(results: Sequence[RequestResult]) -> None:
    errors = Counter(r.error for r in results if not r.success)
    for message, count in errors.most_common():
        print(f"{count} request(s) failed: {message}", file=sys.stderr)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def build_record(
    args: argparse.Namespace, model: str, tokenizer_id: str, results: list[RequestResult], metrics: dict[str, Any]
) -> dict[str, Any]:
    """The saved JSON: settings, every argument, the summary and per-request arrays (times in s)."""
    return _jsonable(
        {
            "date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
            "endpoint": args.endpoint,
            "url": server_urls(args)[0],
            "model_id": model,
            "tokenizer_id": tokenizer_id,
            "dataset_name": args.dataset_name,
            "num_prompts": len(results),
            "request_rate": args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": args.goodput,
            "label": getattr(args, "label", None),
            **(getattr(args, "metadata", None) or {}),
            "args": {k: v for k, v in vars(args).items() if k not in ("api_key", "header")},  # no credentials
            **metrics,
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "expected_output_lens": [r.expected_output_len for r in results],
            "ttfts": [r.ttft for r in results],
            "tpots": [r.tpot for r in results],
            "itls": [r.itl for r in results],
            "e2els": [r.e2el for r in results],
            "start_times": [r.start for r in results],
            "end_times": [r.end for r in results],
            "success": [r.success for r in results],
            "errors": [r.error for r in results],
            "generated_texts": [r.generated_text for r in results],
        }
    )


def result_path(args: argparse.Namespace, model: str) -> str:
    if args.result_filename:
        name = args.result_filename
    else:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        label = getattr(args, "label", None) or "serve"
        name = f"{label}-{os.path.basename(model)}-{rate}qps{conc}-{stamp}.json"
    return os.path.join(args.result_dir or ".", name)


def save_plot(path: str, results: Sequence[RequestResult], duration: float) -> None:
    """A PNG: histograms of TTFT, ITL and E2EL (ms) and output tok/s with requests in flight over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (name, values) in zip(
        axes.flat,
        [
            ("TTFT", [r.ttft * 1e3 for r in ok]),
            ("ITL", [g * 1e3 for r in ok for g in r.itl]),
            ("E2EL", [r.e2el * 1e3 for r in ok]),
        ],
    ):
        ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue")
        ax.set(title=f"{name} distribution ({len(values)} samples)", xlabel=f"{name} (ms)", ylabel="count")
    ax = axes.flat[3]
    bucket = max(duration / 60.0, 0.05)
    times, rates = output_rate_series(ok, bucket)
    ax.plot(times + bucket / 2, rates, color="tab:green", label="output tok/s")
    ax.set(title="output throughput over time", xlabel="time since start (s)", ylabel="output tok/s")
    grid = np.linspace(0.0, max(duration, 1e-6), 200)
    running = [sum(r.start <= t < r.end for r in results) for t in grid]
    twin = ax.twinx()
    twin.plot(grid, running, color="tab:orange", alpha=0.6, label="requests in flight")
    twin.set_ylabel("requests in flight")
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- entry points ------------------------------------------------------------------------------------------------


def parse_percentiles(text: str) -> list[float]:
    """ "50,90,99" -> [50.0, 90.0, 99.0]; each in (0, 100]."""
    try:
        values = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles like 50,90,99, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def parse_slo(text: str) -> tuple[str, float]:
    """One goodput SLO "KEY:MS" with KEY in ttft, tpot, e2el and MS >= 0."""
    key, sep, value = str(text).partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not sep or key not in SLO_METRICS or not ms >= 0 or math.isinf(ms):
        raise argparse.ArgumentTypeError(
            f"invalid goodput SLO {text!r}: expected KEY:MS with KEY one of {', '.join(SLO_METRICS)} and MS >= 0"
        )
    return key, ms


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default="/v1/completions", help="/v1/completions (default) or /v1/chat/completions")
    add("--model", default=None, help="served model name (default: the first id from GET /v1/models)")
    add(
        "--models",
        nargs="+",
        default=None,
        metavar="NAME",
        help="served model names taken in turn, --switch-every requests each (a router's models; the tokenizer is "
        "the first one's)",
    )
    add("--switch-every", type=int, default=10, help="with --models: requests per model before the next (default 10)")
    add(
        "--tokenizer",
        default=None,
        help="tokenizer: .gguf or HF folder (default: the served model's root from /v1/models when it is a local "
        "path that loads, else --model if a path, else SmolLM2)",
    )
    add("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    add_dataset_args(parser)
    add("--num-prompts", type=int, default=100, help="number of requests (default 100)")
    add("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default inf: all at once)")
    add("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson)")
    add("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    add("--seed", type=int, default=0, help="dataset and arrival-time seed (default 0)")
    add("--temperature", type=float, default=0.0, help="sampling temperature sent (default 0: greedy)")
    add("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM extension): exact output lengths")
    add("--metric-percentiles", type=parse_percentiles, default=[50.0, 90.0, 99.0], help="default 50,90,99")
    add("--goodput", type=parse_slo, nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    add("--save-result", action="store_true", help="save the result as JSON")
    add("--result-dir", default=None, help="folder of the saved JSON (default: current folder; implies saving)")
    add("--result-filename", default=None, help="file name of the saved JSON (implies --save-result)")
    add("--plot", default=None, metavar="PATH", help="write a PNG of latency distributions (needs matplotlib)")
    add("--disable-tqdm", action="store_true", help="no progress bar")
    # vLLM's bench serve flags, so that its command lines run
    add(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="request shape: openai/vllm (completions) or openai-chat/vllm-chat (chat; the endpoint follows) "
        "(default: the endpoint's)",
    )
    add("--served-model-name", default=None, help="the model name sent (default: --model's, else the first listed)")
    for name in SAMPLING_FLAGS:
        kind = int if name == "top_k" else float
        add(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{name} sent with each request")
    add("--logprobs", type=int, default=None, help="logprobs asked of each request (chat: top_logprobs)")
    add("--use-beam-search", action="store_true", help="send use_beam_search=true (vLLM's)")
    add("--extra-body", type=json_object, default=None, metavar="JSON", help="fields merged into every request body")
    add("--header", nargs="+", default=None, metavar="KEY=VALUE", help="HTTP headers sent with every request")
    add("--request-id-prefix", default=None, help="send X-Request-Id: PREFIX<index> with each request")
    add("--no-stream", action="store_true", help="ask for whole answers: TTFT is then the whole request time")
    add("--num-warmups", type=int, default=0, help="untimed requests sent first, one after another (default 0)")
    add(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="wait up to this long for the server to answer GET /v1/models before starting (default 0: no wait)",
    )
    add(
        "--percentile-metrics",
        default=",".join(k for k, _, _ in LATENCY_METRICS),
        help="which latencies the report shows, comma-separated of ttft,tpot,itl,e2el (default: all)",
    )
    add("--label", default=None, help="a label for the result (its file name's prefix, and a field)")
    add("--metadata", nargs="+", default=None, metavar="KEY=VALUE", help="fields added to the saved result")
    add("--append-result", action="store_true", help="append the result to --result-filename as one more JSON line")
    add("--save-detailed", action="store_true", help="accepted: the saved result always has per-request details")
    add("--trust-remote-code", action="store_true", help="accepted: no remote code runs")
    add("--tokenizer-mode", default="auto", choices=("auto", "hf"), help="accepted: the Hugging Face tokenizer")
    return parser


def json_object(text: str) -> dict[str, Any]:
    """--extra-body's JSON object (argparse turns the ValueError into a usage error naming the flag)."""
    return parse_json_object(text, "--extra-body")


def key_values(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    """KEY=VALUE items as a dict (ValueError naming `flag` for an item without `=`)."""
    out: dict[str, str] = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{flag} takes KEY=VALUE items, got {item!r}")
        out[key] = value
    return out


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        parser.error(f"--burstiness must be a positive number, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.switch_every < 1:
        parser.error(f"--switch-every must be at least 1, got {args.switch_every}")
    if args.models and args.model:
        parser.error("--model and --models are exclusive")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.backend is not None and args.backend.endswith("-chat") and args.endpoint == "/v1/completions":
        args.endpoint = "/v1/chat/completions"  # vLLM's openai-chat backend speaks the chat route
    if not args.endpoint.startswith("/") or not args.endpoint.rstrip("/").endswith("/completions"):
        parser.error(f"--endpoint must be /v1/completions or /v1/chat/completions, got {args.endpoint!r}")
    if args.backend is not None and args.backend.endswith("-chat") != is_chat(args.endpoint):
        parser.error(f"--backend {args.backend} does not send to --endpoint {args.endpoint}")
    if args.num_warmups < 0:
        parser.error(f"--num-warmups must be >= 0, got {args.num_warmups}")
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    known = [k for k, _, _ in LATENCY_METRICS]
    if not shown or any(m not in known for m in shown):
        parser.error(f"--percentile-metrics takes a comma-separated list of {', '.join(known)}, got {shown}")
    args.percentile_metrics = shown
    try:
        args.header = key_values(args.header, "--header")
        args.metadata = key_values(args.metadata, "--metadata")
    except ValueError as e:
        parser.error(str(e))
    if args.append_result and not args.result_filename:
        parser.error("--append-result needs --result-filename (the file it appends to)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'pagedllm[bench]' (or pip install matplotlib)")
    args.goodput = dict(args.goodput) if args.goodput else None
    args.save_result = bool(args.save_result or args.result_dir or args.result_filename)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed, validated `args`; returns the exit status."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(args.header or {})
    url, models_url = server_urls(args)
    named = args.served_model_name or args.model
    try:
        cards = fetch_models(models_url, headers, args.ready_check_timeout_sec)
    except ValueError:
        if named is None:
            raise
        cards = []
        print(f"WARNING: could not list models at {models_url}; using the model name {named!r}", file=sys.stderr)
    models = args.models or [named or cards[0]["id"]]
    model = models[0]
    card = next((c for c in cards if c.get("id") == model), {})
    tokenizer_path, tokenizer = choose_tokenizer(args, card, cards)
    requests = sample_requests(args, tokenizer, args.num_prompts, args.seed, card.get("max_model_len"))
    names = f"model {model!r}" if len(models) == 1 else f"models {models!r}, {args.switch_every} requests each in turn"
    print(f"{names} at {url}; tokenizer {tokenizer_path or 'of the default model'}")
    print(
        f"{len(requests)} requests ({args.dataset_name}): {sum(r.prompt_len for r in requests)} prompt tokens, "
        f"{sum(r.expected_output_len for r in requests)} output tokens asked; request rate {args.request_rate}, "
        f"burstiness {args.burstiness}, max concurrency {args.max_concurrency or 'unlimited'}",
        flush=True,
    )
    # Warm-ups are prompts of their own (another seed): reusing timed prompts would make those hit the prefix cache.
    warmups = []
    if args.num_warmups:
        warmups = sample_requests(args, tokenizer, args.num_warmups, args.seed + 1, card.get("max_model_len"))
    results, duration = asyncio.run(run_requests(args, models, requests, headers, warmups))
    fill_output_tokens(results, tokenizer)
    metrics = calculate_metrics(results, duration, args.metric_percentiles, args.goodput)
    print_summary(metrics, args, args.metric_percentiles)
    print_errors(results)
    record = build_record(args, model, tokenizer_path or "default", results, metrics)
    if args.save_result:
        path = result_path(args, model)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        appending = args.append_result and os.path.exists(path) and os.path.getsize(path) > 0
        with open(path, "a" if appending else "w", encoding="utf-8") as f:
            if appending:
                f.write("\n")  # one JSON document a line after the first (vLLM's --append-result)
            json.dump(record, f, indent=None if args.append_result else 1)
        print(f"saved the result to {path}")
    if args.plot:
        save_plot(args.plot, results, duration)
        print(f"saved the plot to {args.plot}")
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run; bad input prints an error naming it and returns 2."""
    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    _validate(parser, args)
    try:
        return run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
