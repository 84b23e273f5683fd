"""Fixtures of the server tests: one shared `pagedllm serve` (with an API key and the debug routes) for the
whole session, its openai client, and a check after every test that used it that the server is idle again
(no request in flight, no KV block in use). See server_utils.py for the harness."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")

from tests.server.server_utils import API_KEY, RemoteServer  # noqa: E402


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer("--enable-debug-routes", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(autouse=True)
def _server_left_idle(request):
    """After each test that used the shared server: no request in flight, no KV block in use."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        if srv.proc.poll() is None:
            srv.wait_idle()
