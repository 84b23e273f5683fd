"""`pagedllm run-batch -i INPUT -o OUTPUT [engine and server flags]`: a file of requests in OpenAI's batch format run
offline, as `vllm run-batch` does.

Contract:
* INPUT (a path, or `-` for stdin) holds one JSON object a line: `{"custom_id": ..., "method": "POST", "url": ...,
  "body": {...}}`, `url` one of BATCH_URLS. Blank lines are skipped.
* Each request runs through the server's own app in this process (the same validation, defaults, errors and
  responses as `pagedllm serve`, without a socket), all of them at once up to MAX_IN_FLIGHT, so the engine batches
  them.
* OUTPUT (a path, or `-` for stdout) gets one line per request, in the input's order: `{"id": "batch_req_...",
  "custom_id": ..., "response": {"status_code": ..., "request_id": ..., "body": ...}, "error": null}`; a request the
  server refuses has `"body": null` and its error (`message`, `type`, `param`, `code`) in `error` with the server's
  status (400, 404, 413, 500, ...), as vLLM writes it. A line that is not such a request (bad JSON, a missing field,
  another method or url, `"stream": true`) is a 400 of its own; an exception in the app is that line's 500; no
  line stops the batch. --max-queued-requests does not apply (the lines wait their turn).
* The exit status is 0 once every line has its answer, whatever the answers; 2 for a bad flag or an unreadable
  INPUT. The engine stops before the command returns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import uuid
from typing import Any, TextIO

logger = logging.getLogger(__name__)

BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/classify",
    "/pooling",
)
MAX_IN_FLIGHT = 1024


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line (- : stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="where the answers go, one a line (- : stdout)")


def _line_error(custom_id: Any, message: str, param: str | None = None) -> dict[str, Any]:
    return _output(custom_id, 400, None, {"message": message, "type": "BadRequestError", "param": param, "code": 400})


def _output(custom_id: Any, status: int, body: Any, error: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
        "error": error,
    }


def parse_line(line: str) -> tuple[Any, str, dict[str, Any]] | dict[str, Any]:
    """(custom_id, url, body) of a request line, or the output line of its error."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return _line_error(None, f"the line is not JSON: {e}")
    if not isinstance(request, dict):
        return _line_error(None, f"a request line must be a JSON object, got {type(request).__name__}")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error(custom_id, "custom_id must be a non-empty string", "custom_id")
    if request.get("method", "POST") != "POST":
        return _line_error(custom_id, f"method must be POST, got {request.get('method')!r}", "method")
    url = request.get("url")
    if url not in BATCH_URLS:
        return _line_error(custom_id, f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}", "url")
    body = request.get("body")
    if not isinstance(body, dict):
        return _line_error(custom_id, "body must be a JSON object", "body")
    if body.get("stream"):
        return _line_error(custom_id, "a batch request cannot stream: leave out stream or set it to false", "stream")
    return custom_id, url, body


async def run_lines(app: Any, lines: list[str]) -> list[dict[str, Any]]:
    """The output line of every request line, through `app` (the server's ASGI app) in this process."""
    import httpx

    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    # an exception the app does not turn into a response is that line's 500, not the end of the batch
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:

        async def one(line: str) -> dict[str, Any]:
            parsed = parse_line(line)
            if isinstance(parsed, dict):
                return parsed
            custom_id, url, body = parsed
            async with gate:
                try:
                    resp = await client.post(url, json=body)
                except Exception as e:  # noqa: BLE001 - reported in the line's answer
                    logger.exception("run-batch: request %r failed", custom_id)
                    error = {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError", "code": 500}
                    return _output(custom_id, 500, None, {**error, "param": None})
            try:
                answer = resp.json()
            except ValueError:
                answer = {"error": {"message": resp.text[:1000], "type": "error", "code": resp.status_code}}
            if resp.status_code == 200:
                return _output(custom_id, 200, answer, None)
            error = answer.get("error") if isinstance(answer, dict) else None
            if not isinstance(error, dict):  # Anthropic's shape, or anything else: its message in ours
                error = {"message": json.dumps(answer)[:1000], "type": "error", "param": None, "code": resp.status_code}
            return _output(custom_id, resp.status_code, None, error)

        return list(await asyncio.gather(*(one(line) for line in lines)))


def _read(path: str) -> list[str]:
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as e:
        raise ValueError(f"cannot read the input file {path!r}: {e}") from None
    return [line for line in text.splitlines() if line.strip()]


@contextlib.contextmanager
def _writer(path: str) -> Any:
    if path == "-":
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


def write_lines(out: TextIO, outputs: list[dict[str, Any]]) -> None:
    for output in outputs:
        out.write(json.dumps(output, ensure_ascii=False) + "\n")


def main(args: argparse.Namespace) -> int:
    """`pagedllm run-batch`: read, run every request, write the answers; the exit status."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import build_app, check_server_args, load_lora_modules, start_engine
    from pagedllm.metrics import stats_log_interval

    lines = _read(args.input_file)
    engine_args = EngineArgs.from_cli_args(args)
    check_server_args(args, engine_args)
    args.api_key = None  # no client here to send one (check_server_args took $PAGEDLLM_API_KEY's)
    args.max_queued_requests = None  # the batch is its own queue: its lines wait their turn, never a 429
    engine = start_engine(args, engine_args, None, stats_log_interval())
    try:
        app = build_app(engine, args)

        async def run() -> list[dict[str, Any]]:
            await load_lora_modules(app)  # --lora-modules, as the server's start-up loads them
            return await run_lines(app, lines)

        outputs = asyncio.run(run())
    finally:
        engine.shutdown()
    with _writer(args.output_file) as out:
        write_lines(out, outputs)
    failed = sum(o["error"] is not None for o in outputs)
    logger.info("run-batch: %d requests, %d answered, %d refused", len(outputs), len(outputs) - failed, failed)
    return 0
