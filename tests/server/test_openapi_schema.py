"""Schema fuzzing: the served /openapi.json tells the truth about what the server answers.

schemathesis reads /openapi.json of a real `pagedllm serve` on 127.0.0.1 (its own, started here: with an API key
and --max-queued-requests, so that the 401 and 429 are declared too, and a small --max-model-len, see below).
For every operation it sends the request examples of the description, then generated requests: valid ones by
the schema, and for the routes with a body invalid ones too. Every answer is checked: no 5xx, a documented status
code, a documented content type, a body that matches the documented schema (for an event stream, every event),
and the documented headers. A contradiction fails the test with the request that found it.

Bounded to run well under a minute once the server is up (~15 s on an idle machine): six generated requests per
operation and mode, no shrinking, no coverage phase, and short generations. The server's --max-model-len 48 caps
prompt + output tokens of every generation; before a generation request is sent, `n` is capped at 2 and
`max_tokens` / `max_completion_tokens` / `max_output_tokens` at 4, because up to 128 choices of up to 48 tokens
take tens of seconds on two cores and exercise nothing a short one does not (the bounds themselves are tested in
test_chat.py and test_completions.py). A timeout makes a hang fail fast, and the server is stopped either way.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.server.server_utils import API_KEY, RemoteServer

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = 6  # generated requests per operation and mode
MAX_CHOICES = 2
MAX_TOKENS = 4
REQUEST_TIMEOUT_S = 60
# Server start (20-90 s on two busy cores) plus the fuzzing (~15 s on an idle machine).
TEST_TIMEOUT_S = 300
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")


@pytest.fixture(scope="module")
def fuzzed_server():
    srv = RemoteServer(
        *("--max-model-len", "48", "--max-queued-requests", "8", "--enable-debug-routes"), api_key=API_KEY
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served_schema(fuzzed_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    config = schemathesis.Config.from_dict(
        {
            "base-url": fuzzed_server.url,
            "headers": auth,
            # The description names the bearer scheme; without this, schemathesis fills it with tokens of its own.
            "auth": {"openapi": {"bearer": {"bearer": API_KEY}}},
            "request-timeout": REQUEST_TIMEOUT_S,
            "generation": {"mode": "all", "max-examples": EXAMPLES},
            # The coverage phase alone sends hundreds of boundary cases per generation route: over the budget.
            "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
        }
    )
    return schemathesis.openapi.from_url(
        fuzzed_server.url + "/openapi.json", config=config, headers=auth, timeout=REQUEST_TIMEOUT_S
    )


def _bounded(case: Any) -> None:
    """Cap `n` and the output length of a generation request (see the module docstring); the rest goes as
    generated."""
    body = case.body
    if case.path not in GENERATION_PATHS or not isinstance(body, dict):
        return
    capped = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for field, cap in (("n", MAX_CHOICES), *((name, MAX_TOKENS) for name in capped)):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap


def _checks() -> list[Any]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        response_headers_conformance,
    ]


def _run(strategy: Any, max_examples: int, statuses: Counter) -> None:
    """Send `max_examples` requests drawn from `strategy`; the first contradiction raises."""
    checks = _checks()

    # No shrinking: every extra request costs server time, and the failing request is reported as sent.
    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=strategy)
    def run(case: Any) -> None:
        _bounded(case)
        response = case.call_and_validate(checks=checks, timeout=REQUEST_TIMEOUT_S)
        statuses[(case.operation.label, response.status_code, response.headers.get("content-type", [""])[0])] += 1

    run()


# schemathesis' pytest plugin (`schemathesis.pytest.from_fixture`) does not run on pytest 9.2 (it sets a node
# attribute pytest no longer has), so the operations are walked here: for each, the request examples of the
# description, then generated requests (valid ones, and invalid ones for the routes with a body). Every
# operation is tried and all contradictions are reported together.
@pytest.mark.timeout(TEST_TIMEOUT_S, method="signal")
def test_served_openapi_description_holds(served_schema, fuzzed_server):
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup  # several failures at once: not an Exception subclass

    failures: list[str] = []
    statuses: Counter = Counter()
    operations = [result.ok() for result in served_schema.get_all_operations()]
    for operation in operations:
        runs = [("examples", s, 1) for s in served_schema.get_strategies_from_examples(operation)]
        runs.append(("positive", operation.as_strategy(generation_mode=GenerationMode.POSITIVE), EXAMPLES))
        if operation.body:  # only a request body can be made invalid: these routes take no parameters
            runs.append(("negative", operation.as_strategy(generation_mode=GenerationMode.NEGATIVE), EXAMPLES))
        for kind, strategy, count in runs:
            try:
                _run(strategy, count, statuses)
            except (Exception, FailureGroup) as e:  # collected: every operation is tried
                failures.append(f"{operation.label} ({kind}): {type(e).__name__}: {e}")
    assert not failures, "\n\n".join(failures)
    # The examples reached the answers they are there for: JSON and event streams from both generation routes.
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):
        for media_type in ("application/json", "text/event-stream"):
            assert any(k[0] == label and k[1] == 200 and k[2].startswith(media_type) for k in statuses), (
                label,
                media_type,
                statuses,
            )
    fuzzed_server.wait_idle()  # nothing left running or holding KV blocks


@pytest.mark.parametrize("api_key, queue_limit", [(None, None), ("k", 3)])
def test_description_declares_the_flag_dependent_statuses_only_with_their_flags(api_key, queue_limit):
    """401 (and the bearer scheme) only with an API key, 429 only with --max-queued-requests; never FastAPI's 422."""
    import argparse
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.api_server import build_app

    model_config = SimpleNamespace(served_model_name="m", max_model_len=48, model="m")
    engine = SimpleNamespace(model_config=model_config, tokenizer=None)
    app = build_app(engine, argparse.Namespace(api_key=api_key, max_queued_requests=queue_limit))
    spec = app.openapi()
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            statuses = set(operation["responses"])
            assert "422" not in statuses and "200" in statuses
            assert ("401" in statuses) == (api_key is not None and path not in ("/health", "/ping")), path
            assert ("429" in statuses) == (queue_limit is not None and path in GENERATION_PATHS), path
            query = any(p["in"] == "query" for p in operation.get("parameters", []))  # /sleep?level=
            assert ("400" in statuses) == ("requestBody" in operation or query), path
    assert ("securitySchemes" in spec["components"]) == (api_key is not None)
    assert not {"HTTPValidationError", "ValidationError"} & set(spec["components"]["schemas"])
    for path in ("/health", "/ping"):
        assert "content" not in spec["paths"][path]["get"]["responses"]["200"]  # an empty body
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path in GENERATION_PATHS:
        assert set(spec["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json",
            "text/event-stream",
        }
