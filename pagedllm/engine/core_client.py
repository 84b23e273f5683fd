"""Clients of the engine core.

- `InprocClient`: calls an EngineCore in this process (tests, debugging).
- `SyncMPClient`: blocking client of an EngineCoreProc (used by `LLM`).
- `AsyncMPClient`: asyncio client of an EngineCoreProc (used by `AsyncLLM`).

The multiprocess clients start the core (core_process.py: `python -m pagedllm.engine.core_proc`, a ROUTER for
requests and a PULL for outputs on IPC sockets), or take one started earlier, and wait for the core's READY. A
monitor thread watches the child: if it dies, every pending and future call raises `EngineDeadError` instead of
hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.engine.core_process import CoreProcess
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

_DEAD = object()


class InprocClient:
    def __init__(self, config: EngineConfig, engine_args: EngineArgs | None = None, connect: bool = True) -> None:
        from pagedllm.engine.core import EngineCore

        self.engine_core = EngineCore(config)

    def connect(self) -> None:
        """Nothing to wait for: the core was built in the constructor."""

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _cleanup(core: CoreProcess, ctx: zmq.Context, stop: threading.Event, reader: threading.Thread | None) -> None:
    """Stop the child, then close each socket from a thread that no longer uses it (ZMQ sockets are not
    thread-safe: closing one another thread is blocked on aborts the process)."""
    core.terminate()
    stop.set()
    if reader is not None and reader.ident is not None and reader is not threading.current_thread():
        reader.join(timeout=2.0)
    if reader is None or not reader.is_alive():
        core.output_socket.close(linger=0)
        core.input_socket.close(linger=0)
        ctx.term()


class SyncMPClient:
    """Blocking client: requests go out on the ROUTER, an output thread drains the PULL into a queue."""

    def __init__(
        self,
        config: EngineConfig | None,
        engine_args: EngineArgs,
        connect: bool = True,
        core: CoreProcess | None = None,
    ) -> None:
        """Starts the core process (or takes `core`, started with a plain zmq.Context); with `connect` (else call
        `connect()`) waits until it is ready. `config` is not needed (the core builds its own from the args)."""
        self.core = core or CoreProcess(engine_args, zmq.Context())
        self.ctx = self.core.ctx
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._output_loop, daemon=True, name="engine-output")
        self._finalizer = weakref.finalize(self, _cleanup, self.core, self.ctx, self._stop, self._reader)
        self.outputs: queue.Queue[Any] = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self.dead = False
        self._encoder = msgspec.msgpack.Encoder()
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for the core's READY (raising its start-up error), then start reading its outputs."""
        self.ready = self.core.wait_ready(self.core.input_socket)
        self._reader.start()
        self.core.watch(self._on_core_death)

    def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        sock = self.core.output_socket
        try:
            while not self._stop.is_set():
                # A blocking poll with a timeout (not a spin) so that shutdown is noticed.
                if not sock.poll(200):
                    continue
                outputs = decoder.decode(sock.recv(copy=False).buffer)
                if outputs.utility_output is not None:
                    fut = self.utility_results.pop(outputs.utility_output.call_id, None)
                    if fut is not None:
                        fut.set_result(outputs.utility_output)
                else:
                    self.outputs.put(outputs)
        except zmq.ZMQError:
            return  # context closed at shutdown

    def _on_core_death(self) -> None:
        self.dead = True
        self.outputs.put(_DEAD)
        for fut in list(self.utility_results.values()):
            fut.set_exception(EngineDeadError())

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead:
            raise EngineDeadError()
        with self._send_lock:
            self.core.input_socket.send_multipart([self.core.identity, kind.value, self._encoder.encode(payload)])

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if item is _DEAD:
            self.outputs.put(_DEAD)  # every later call fails the same way
            raise EngineDeadError()
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut: Future = Future()
        self.utility_results[call_id] = fut
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        result = fut.result()
        if result.failure_message is not None:
            raise RuntimeError(f"engine core utility {method!r} failed: {result.failure_message}")
        return result.result

    def shutdown(self) -> None:
        self._finalizer()


class AsyncMPClient:
    """asyncio client: sends are awaited, one task drains the PULL socket into an asyncio queue."""

    def __init__(self, engine_args: EngineArgs, connect: bool = True, core: CoreProcess | None = None) -> None:
        """Starts the core process (or takes `core`, started with a zmq.asyncio.Context); with `connect` (else call
        `connect()`) waits until it is ready."""
        self.core = core or CoreProcess(engine_args, zmq.asyncio.Context())
        self.ctx = self.core.ctx
        self._finalizer = weakref.finalize(self, _cleanup, self.core, self.ctx, threading.Event(), None)
        self.outputs: asyncio.Queue[Any] | None = None
        self.utility_results: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending_sends: set[asyncio.Future] = set()
        self.dead = False
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for the core's READY (raising its start-up error), then watch the process."""
        # The handshake is read with a plain (blocking) socket on the same address family; the async
        # ROUTER takes over afterwards. zmq.asyncio sockets expose the sync API via `zmq.Socket.shadow`.
        self.ready = self.core.wait_ready(zmq.Socket.shadow(self.core.input_socket.underlying))
        self.core.watch(self._on_core_death)

    def _ensure_started(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self.outputs = asyncio.Queue()
            self._task = self._loop.create_task(self._output_loop(), name="engine-output")
            if self.dead:
                self.outputs.put_nowait(_DEAD)

    async def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        sock = self.core.output_socket
        assert self.outputs is not None
        try:
            while True:
                frame = await sock.recv(copy=False)
                outputs = decoder.decode(frame.buffer)
                if outputs.utility_output is not None:
                    fut = self.utility_results.pop(outputs.utility_output.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(outputs.utility_output)
                else:
                    self.outputs.put_nowait(outputs)
        except (zmq.ZMQError, asyncio.CancelledError):
            return

    def _on_core_death(self) -> None:
        self.dead = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_pending)

    def _fail_pending(self) -> None:
        if self.outputs is not None:
            self.outputs.put_nowait(_DEAD)
        for fut in list(self.utility_results.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError())
        self.utility_results.clear()

    async def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead:
            raise EngineDeadError()
        self._ensure_started()
        await self.core.input_socket.send_multipart([self.core.identity, kind.value, self._encoder.encode(payload)])

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            await self._send(EngineCoreRequestType.ABORT, request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Send an abort from synchronous code (or a cancelled task): the send is attempted at once and,
        if the socket is busy, completed by the event loop on its own, tied to no caller's task."""
        if not request_ids or self.dead:
            return
        fut = self.core.input_socket.send_multipart(
            [self.core.identity, EngineCoreRequestType.ABORT.value, self._encoder.encode(request_ids)]
        )
        if not fut.done():
            self._pending_sends.add(fut)
            fut.add_done_callback(self._pending_sends.discard)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self.outputs is not None
        item = await self.outputs.get()
        if item is _DEAD:
            self.outputs.put_nowait(_DEAD)
            raise EngineDeadError()
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = fut
        await self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        result = await fut
        if result.failure_message is not None:
            raise RuntimeError(f"engine core utility {method!r} failed: {result.failure_message}")
        return result.result

    def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._finalizer()
