"""The engine-core child process: started, handshaken with, watched and stopped by its client.

Contract. `CoreProcess(engine_args, ctx)` starts `python -m pagedllm.engine.core_proc` at once (no fork of this
process, no re-import of the caller's `__main__`) and binds, with `ctx`, a ROUTER for requests and a PULL for
outputs on IPC sockets in a private temporary folder; the child connects to both and builds its engine from the
arguments it reads on stdin (JSON). `wait_ready` blocks until its READY (or raises its start-up error),
`watch` reports its death from a thread, `terminate` stops it and removes the folder.

This module imports neither torch nor transformers, nor any pagedllm module that does: `pagedllm serve` starts
the child with it before the front end's own imports, so the two processes load in parallel. The clients that
speak to the child are in core_client.py.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import HandshakeMessage

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0


class CoreProcess:
    """The child process and its sockets; shared by the sync and async clients (see the module docstring)."""

    def __init__(self, engine_args: EngineArgs, ctx: zmq.Context) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
        self.input_addr = f"ipc://{self.tmpdir}/input"
        self.output_addr = f"ipc://{self.tmpdir}/output"
        self.identity = b"engine-core-0"
        self.ctx = ctx
        self.input_socket = ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(self.input_addr)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(self.output_addr)
        args_json = msgspec.json.encode(dataclasses.asdict(engine_args))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.engine.core_proc",
                self.input_addr,
                self.output_addr,
                self.identity.decode(),
            ],
            stdin=subprocess.PIPE,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(args_json)
        self.proc.stdin.close()
        self.shutting_down = False

    def wait_ready(self, sync_socket: zmq.Socket) -> HandshakeMessage:
        """Block until the core reports READY; raise its error if it failed or died."""
        poller = zmq.Poller()
        poller.register(sync_socket, zmq.POLLIN)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None  # checked before the poll: a report sent just before exit wins
            if poller.poll(500):
                _, payload = sync_socket.recv_multipart()
                msg = msgspec.msgpack.decode(payload, type=HandshakeMessage)
                if msg.status == "READY":
                    return msg
                error = msg.error or "unknown error"
                self.terminate()
                if error.startswith("ValueError: "):
                    raise ValueError(error.removeprefix("ValueError: "))
                raise RuntimeError(f"engine core failed to start: {error}")
            if exited:
                raise EngineDeadError(f"engine core exited with status {self.proc.returncode} during start-up")
        self.terminate()
        raise RuntimeError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s")

    def watch(self, on_death: Callable[[], None]) -> None:
        """Call `on_death` (from a watcher thread) if the child exits while we are not shutting it down."""

        def wait() -> None:
            self.proc.wait()
            if not self.shutting_down:
                logger.error("engine core process died (exit status %s)", self.proc.returncode)
                on_death()

        threading.Thread(target=wait, daemon=True, name="engine-monitor").start()

    def terminate(self) -> None:
        self.shutting_down = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def close(self) -> None:
        """Stop the child and close the sockets and their context: for a process never handed to a client (the
        front end failed before connecting), whose clients otherwise do this at shutdown."""
        self.terminate()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
