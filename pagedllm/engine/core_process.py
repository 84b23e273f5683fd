"""The engine-core child processes: started, handshaken with, watched and stopped by their client.

Contract. `CoreProcess(engine_args, ctx)` starts `engine_args.data_parallel_size` (usually one) processes of
`python -m pagedllm.engine.core_proc` at once (no fork of this process, no re-import of the caller's `__main__`)
and binds, with `ctx`, one ROUTER for requests and one PULL for outputs on IPC sockets in a private temporary
folder. Engine i connects to both with the identity `identities[i]`, builds its engine from the arguments it reads
on stdin (JSON) as data-parallel rank i, and stamps `engine_index = i` on what it sends. `wait_ready` blocks until
every engine reported READY (or raises the first start-up error), `watch` reports the death of any of them from a
thread, `terminate` stops them all and removes the folder. The engines live and die together: one dead engine
makes the whole group dead for its client.

This module imports neither torch nor transformers, nor any pagedllm module that does: `pagedllm serve` starts
the children with it before the front end's own imports, so the processes load in parallel. The clients that
speak to the children are in core_client.py.
"""

from __future__ import annotations

import contextlib
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
    """The child processes and their sockets; shared by the sync and async clients (see the module docstring)."""

    def __init__(self, engine_args: EngineArgs, ctx: zmq.Context, spare: SpareCore | None = None) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
        self.input_addr = f"ipc://{self.tmpdir}/input"
        self.output_addr = f"ipc://{self.tmpdir}/output"
        self.num_engines = max(1, engine_args.data_parallel_size)
        self.identities = [f"engine-core-{i}".encode() for i in range(self.num_engines)]
        self.ctx = ctx
        self.input_socket = ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a ROUTER drops what it cannot queue for a peer, silently. With the default (1,000
        # messages) a burst of a few thousand requests (LLM.embed of a corpus) lost its last ones, and the front end
        # waited for them forever.
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.input_addr)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(self.output_addr)
        self.procs: list[subprocess.Popen] = []
        self.shutting_down = False
        try:
            self._start(engine_args, spare)
        except BaseException:
            self.close()  # the engines started so far, the sockets and the folder
            raise

    def _start(self, engine_args: EngineArgs, spare: SpareCore | None) -> None:
        args_json = msgspec.json.encode(dataclasses.asdict(engine_args))
        for index, identity in enumerate(self.identities):
            if index == 0 and self.num_engines == 1 and spare is not None and spare.alive():
                self.procs.append(spare.hand_over(self.input_addr, self.output_addr, identity, args_json))
                continue
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagedllm.engine.core_proc",
                    self.input_addr,
                    self.output_addr,
                    identity.decode(),
                    str(index),
                ],
                stdin=subprocess.PIPE,
            )
            assert proc.stdin is not None
            proc.stdin.write(args_json)
            proc.stdin.close()
            self.procs.append(proc)

    @property
    def proc(self) -> subprocess.Popen:
        """The first engine's process (the only one without data parallelism)."""
        return self.procs[0]

    @property
    def identity(self) -> bytes:
        """The first engine's ROUTER identity."""
        return self.identities[0]

    def wait_ready(self, sync_socket: zmq.Socket) -> list[HandshakeMessage]:
        """Block until every engine reports READY (their messages, by engine index); raise the first error if one
        failed or died, after stopping the others."""
        poller = zmq.Poller()
        poller.register(sync_socket, zmq.POLLIN)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        ready: dict[bytes, HandshakeMessage] = {}
        while time.monotonic() < deadline:
            # Checked before the poll: a report sent just before an exit wins.
            exited = [i for i, proc in enumerate(self.procs) if proc.poll() is not None]
            if poller.poll(500):
                identity, payload = sync_socket.recv_multipart()
                msg = msgspec.msgpack.decode(payload, type=HandshakeMessage)
                if msg.status == "READY":
                    ready[identity] = msg
                    if len(ready) == self.num_engines:
                        return [ready[i] for i in self.identities]
                    continue
                error = msg.error or "unknown error"
                self.terminate()
                if error.startswith("ValueError: "):
                    raise ValueError(error.removeprefix("ValueError: "))
                raise RuntimeError(f"engine core failed to start: {error}")
            if exited:
                status = self.procs[exited[0]].returncode
                self.terminate()
                which = "engine core" if self.num_engines == 1 else f"engine core {exited[0]}"
                raise EngineDeadError(f"{which} exited with status {status} during start-up")
        self.terminate()
        raise RuntimeError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s")

    def watch(self, on_death: Callable[[], None]) -> None:
        """Call `on_death` (from a watcher thread, once) if any child exits while we are not shutting them down."""
        called = threading.Lock()

        def wait(index: int, proc: subprocess.Popen) -> None:
            proc.wait()
            if not self.shutting_down and called.acquire(blocking=False):
                which = "engine core" if self.num_engines == 1 else f"engine core {index}"
                logger.error("%s process died (exit status %s)", which, proc.returncode)
                on_death()

        for index, proc in enumerate(self.procs):
            threading.Thread(target=wait, args=(index, proc), daemon=True, name=f"engine-monitor-{index}").start()

    def terminate(self) -> None:
        """Stop every engine (SIGTERM to all, then wait; SIGKILL after 10 s) and remove the socket folder. The stop
        of engines that were running is logged once, as a stop (the watcher reports only deaths, which this is not)."""
        self.shutting_down = True
        running = [i for i, proc in enumerate(self.procs) if proc.poll() is None]
        for i in running:
            self.procs[i].terminate()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("engine core process %d did not stop within 10 s: killed", proc.pid)
                proc.kill()
                proc.wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        if running:
            statuses = ", ".join(str(self.procs[i].returncode) for i in running)
            which = "engine core process" if len(self.procs) == 1 else f"{len(running)} engine core processes"
            logger.info("%s stopped (exit status %s)", which, statuses)

    def close(self) -> None:
        """Stop the children and close the sockets and their context: for processes never handed to a client (the
        front end failed before connecting), whose clients otherwise do this at shutdown."""
        self.terminate()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()


class SpareCore:
    """An engine-core process started ahead of need (`python -m pagedllm.engine.core_proc --spare`): it makes the
    engine's imports (torch and the model code, ~1.4 s), then waits on stdin for the sockets and engine arguments of
    the model it is to load (`hand_over`, through `CoreProcess(..., spare=)`). The router keeps one, so that a
    model's cold load skips the imports. Closing an unused one closes its stdin: it exits at once."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", "pagedllm.engine.core_proc", "--spare"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        self.used = False

    def alive(self) -> bool:
        return not self.used and self.proc.poll() is None

    def hand_over(self, input_addr: str, output_addr: str, identity: bytes, args_json: bytes) -> subprocess.Popen:
        """Tell the process which engine to be (one line of JSON, then the engine arguments); returns it."""
        assert self.proc.stdin is not None and not self.used
        header = {"input": input_addr, "output": output_addr, "identity": identity.decode(), "index": 0}
        self.proc.stdin.write(msgspec.json.encode(header) + b"\n" + args_json)
        self.proc.stdin.close()
        self.used = True
        return self.proc

    def close(self) -> None:
        """Stop an unused spare (a used one belongs to its CoreProcess)."""
        if self.used:
            return
        self.used = True
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
