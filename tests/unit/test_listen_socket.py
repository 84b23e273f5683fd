"""The server's listening socket (api_server._bind): the connections uvicorn's asyncio loop accepts on it send at once
(TCP_NODELAY). Without it, a response written in two parts (headers, then body) waited 40 ms for the client's
delayed ACK on every request of a kept-alive connection: the OpenAI client's every non-streamed call."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pagedllm.entrypoints.openai.api_server import _bind


async def _accepted_nodelay(sock: socket.socket) -> int:
    """The TCP_NODELAY option of a connection an asyncio server accepts on `sock` (as uvicorn serves it)."""
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[int] = loop.create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await loop.create_server(Probe, sock=sock)
    try:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_send_without_delay() -> None:
    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert asyncio.run(_accepted_nodelay(sock)) != 0  # 0 before: asyncio sets it only where proto says TCP
    finally:
        sock.close()


def test_a_taken_port_is_refused() -> None:
    first = _bind("127.0.0.1", 0)
    first.listen()
    port = first.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        _bind("127.0.0.1", port)
    first.close()
