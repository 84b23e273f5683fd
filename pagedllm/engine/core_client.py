"""Clients of the engine core.

- `InprocClient`: calls an EngineCore in this process (tests, debugging).
- `SyncMPClient`: blocking client of the EngineCoreProc(s) (used by `LLM`).
- `AsyncMPClient`: asyncio client of the EngineCoreProc(s) (used by `AsyncLLM`).

The multiprocess clients start the cores (core_process.py: `python -m pagedllm.engine.core_proc` per
data-parallel engine, one ROUTER for requests and one PULL for outputs on IPC sockets), or take ones started
earlier, and wait for every core's READY. Monitor threads watch the children: if one dies, every pending and
future call raises `EngineDeadError` instead of hanging.

Data parallelism (`data_parallel_size` engines): `EngineRouter` sends each new request to the least-loaded engine
and remembers where it went, so that its abort reaches that engine. An engine's load is the number of requests
the client sent it that it has not finished and the client has not aborted: its waiting and running requests
plus those still on their way to it (vLLM's load-balancing client reads waiting + running from the engines'
stats, a step late; this count is the same thing, kept at the client, with no delay).
Ties go to the engine with fewer waiting requests in its last stats, then to the lower index. The outputs of all
engines arrive on the one PULL socket, each batch stamped with its `engine_index`. Utility calls go to one engine
(`call_utility`) or to all (`call_utility_all`, results by engine index).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
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
    UtilityOutput,
    UtilityRequest,
)

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

_DEAD = object()


class EngineRouter:
    """Least-loaded routing of requests over data-parallel engines (see the module docstring)."""

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self.engine_of: dict[str, int] = {}
        self.load = [0] * num_engines
        self.waiting = [0] * num_engines  # from each engine's last scheduler stats

    def choose(self) -> int:
        """The engine a new request should go to."""
        if self.num_engines == 1:
            return 0
        return min(range(self.num_engines), key=lambda i: (self.load[i], self.waiting[i], i))

    def add(self, request_id: str, engine: int) -> None:
        if request_id not in self.engine_of:
            self.load[engine] += 1
        self.engine_of[request_id] = engine

    def engines_of(self, request_ids: list[str]) -> set[int]:
        """The engines holding these requests (unknown ids: none)."""
        return {self.engine_of[r] for r in request_ids if r in self.engine_of}

    def remove(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forget these requests (aborted); returns them by engine (unknown ids go to every engine: a request
        whose send failed half-way may still have reached one)."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self.engine_of.pop(rid, None)
            if engine is None:
                for i in range(self.num_engines):
                    by_engine.setdefault(i, []).append(rid)
            else:
                self.load[engine] -= 1
                by_engine.setdefault(engine, []).append(rid)
        return by_engine

    def observe(self, outputs: EngineCoreOutputs) -> None:
        """Forget the requests these outputs finish; note the engine's waiting count."""
        if outputs.scheduler_stats is not None:
            self.waiting[outputs.engine_index] = outputs.scheduler_stats.num_waiting_reqs
        engine = outputs.engine_index
        for out in outputs.outputs:
            # Only the engine holding the id releases it (an id aborted and reused may be at another by now).
            if out.finish_reason is not None and self.engine_of.get(out.request_id) == engine:
                del self.engine_of[out.request_id]
                self.load[engine] -= 1


def merge_invariants(results: list[dict[str, Any]]) -> dict[str, Any]:
    """`check_invariants` of several engines as one: their counts summed, each engine's own under "engines"."""
    if len(results) == 1:
        return results[0]
    merged: dict[str, Any] = {k: sum(r[k] for r in results) for k in results[0] if isinstance(results[0][k], int)}
    merged["engines"] = results
    return merged


class InprocClient:
    def __init__(self, config: EngineConfig, engine_args: EngineArgs | None = None, connect: bool = True) -> None:
        from pagedllm.engine.core import EngineCore

        if config.parallel_config.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size {config.parallel_config.data_parallel_size} needs the multiprocess engine "
                "client (engine_client='mp'): the in-process client runs one engine"
            )
        self.engine_core = EngineCore(config)
        self.num_engines = 1
        # Dropping the client stops the engine (an executor's worker processes, a Ray placement group) at once, not
        # at the interpreter's exit; the engine holds no reference back to this client.
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)

    def connect(self) -> None:
        """Nothing to wait for: the core was built in the constructor."""

    def add_request(self, request: EngineCoreRequest, engine: int | None = None) -> int:
        self.engine_core.add_request(request)
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        return getattr(self.engine_core, method)(*args)

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        return [self.call_utility(method, *args)]

    def shutdown(self) -> None:
        self._finalizer()


def _weak_callback(method: Any) -> Callable[[], None]:
    """`method` (a bound method) as a callback that does not keep its object alive: a watcher thread holding the
    client would keep it, and its engine, from ever being collected."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


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
        self.outputs: queue.Queue[Any] = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        # The reader gets what it uses, not this client: a running thread holding the client would keep it alive
        # (and its engine core running) after its last user dropped it. Dropping it runs the finalizer.
        self._reader = threading.Thread(
            target=_sync_output_loop,
            args=(self.core.output_socket, self._stop, self.outputs, self.utility_results),
            daemon=True,
            name="engine-output",
        )
        self._finalizer = weakref.finalize(self, _cleanup, self.core, self.ctx, self._stop, self._reader)
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self.dead = False
        self._encoder = msgspec.msgpack.Encoder()
        self.num_engines = self.core.num_engines
        self.router = EngineRouter(self.num_engines)
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for every core's READY (raising a start-up error), then start reading their outputs."""
        self.ready = self.core.wait_ready(self.core.input_socket)
        self._reader.start()
        self.core.watch(_weak_callback(self._on_core_death))

    def _on_core_death(self) -> None:
        self.dead = True
        self.outputs.put(_DEAD)
        # The reader thread may answer one of these meanwhile (another engine's answer): settle each once.
        for fut in list(self.utility_results.values()):
            _settle(fut, EngineDeadError())

    def _send(self, kind: EngineCoreRequestType, payload: Any, engine: int = 0) -> None:
        if self.dead:
            raise EngineDeadError()
        with self._send_lock:
            self.core.input_socket.send_multipart(
                [self.core.identities[engine], kind.value, self._encoder.encode(payload)]
            )

    def add_request(self, request: EngineCoreRequest, engine: int | None = None) -> int:
        """Send a request to `engine`, or to the least-loaded one; returns the engine's index."""
        engine = self.router.choose() if engine is None else engine
        self.router.add(request.request_id, engine)
        self._send(EngineCoreRequestType.ADD, request, engine)
        return engine

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self.router.remove(request_ids).items():
            self._send(EngineCoreRequestType.ABORT, ids, engine)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if item is _DEAD:
            self.outputs.put(_DEAD)  # every later call fails the same way
            raise EngineDeadError()
        self.router.observe(item)
        return item

    def _start_utility(self, method: str, args: tuple[Any, ...], engine: int) -> Future:
        call_id = next(self._call_ids)
        fut: Future = Future()
        self.utility_results[call_id] = fut
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)), engine)
        return fut

    def call_utility(self, method: str, *args: Any, engine: int = 0) -> Any:
        """Call EngineCore.`method` in engine `engine` and return its result."""
        return _utility_result(method, self._start_utility(method, args, engine).result())

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call EngineCore.`method` in every engine; their results by engine index."""
        futures = [self._start_utility(method, args, i) for i in range(self.num_engines)]
        return [_utility_result(method, fut.result()) for fut in futures]

    def shutdown(self) -> None:
        self._finalizer()


def _sync_output_loop(
    sock: zmq.Socket, stop: threading.Event, outputs: queue.Queue[Any], utility_results: dict[int, Future]
) -> None:
    """SyncMPClient's reader thread: the PULL socket's outputs into `outputs`, utility answers to their futures."""
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    try:
        while not stop.is_set():
            # A blocking poll with a timeout (not a spin) so that shutdown is noticed.
            if not sock.poll(200):
                continue
            item = decoder.decode(sock.recv(copy=False).buffer)
            if item.utility_output is not None:
                fut = utility_results.pop(item.utility_output.call_id, None)
                if fut is not None:
                    _settle(fut, item.utility_output)
            else:
                outputs.put(item)
    except zmq.ZMQError:
        return  # context closed at shutdown


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
        self.num_engines = self.core.num_engines
        self.router = EngineRouter(self.num_engines)
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for every core's READY (raising a start-up error), then watch the processes."""
        # The handshake is read with a plain (blocking) socket on the same address family; the async
        # ROUTER takes over afterwards. zmq.asyncio sockets expose the sync API via `zmq.Socket.shadow`.
        self.ready = self.core.wait_ready(zmq.Socket.shadow(self.core.input_socket.underlying))
        self.core.watch(_weak_callback(self._on_core_death))

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

    async def _send(self, kind: EngineCoreRequestType, payload: Any, engine: int = 0) -> None:
        if self.dead:
            raise EngineDeadError()
        self._ensure_started()
        await self.core.input_socket.send_multipart(
            [self.core.identities[engine], kind.value, self._encoder.encode(payload)]
        )

    async def add_request_async(self, request: EngineCoreRequest, engine: int | None = None) -> int:
        """Send a request to `engine`, or to the least-loaded one; returns the engine's index."""
        engine = self.router.choose() if engine is None else engine
        # Counted before the send completes: a request added meanwhile sees this one's load, and an abort of a
        # request whose send is cut short still reaches its engine.
        self.router.add(request.request_id, engine)
        await self._send(EngineCoreRequestType.ADD, request, engine)
        return engine

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            for engine, ids in self.router.remove(request_ids).items():
                await self._send(EngineCoreRequestType.ABORT, ids, engine)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Send an abort from synchronous code (or a cancelled task): the send is attempted at once and,
        if the socket is busy, completed by the event loop on its own, tied to no caller's task."""
        if not request_ids or self.dead:
            return
        for engine, ids in self.router.remove(request_ids).items():
            fut = self.core.input_socket.send_multipart(
                [self.core.identities[engine], EngineCoreRequestType.ABORT.value, self._encoder.encode(ids)]
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
        self.router.observe(item)
        return item

    async def call_utility_async(self, method: str, *args: Any, engine: int = 0) -> Any:
        """Call EngineCore.`method` in engine `engine` and return its result."""
        self._ensure_started()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = fut
        await self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)), engine)
        return _utility_result(method, await fut)

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        """Call EngineCore.`method` in every engine; their results by engine index."""
        calls = [self.call_utility_async(method, *args, engine=i) for i in range(self.num_engines)]
        return list(await asyncio.gather(*calls))

    def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._finalizer()


def _settle(fut: Future, outcome: Any) -> None:
    """Give `fut` its result (or exception) unless another thread already did."""
    try:
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
    except InvalidStateError:
        pass


def _utility_result(method: str, result: UtilityOutput) -> Any:
    if result.failure_message is not None:
        raise RuntimeError(f"engine core utility {method!r} failed: {result.failure_message}")
    return result.result
