"""EngineCoreProc: the engine core in its own process, behind ZMQ + msgpack.

Sockets: the client binds a ROUTER (requests) and a PULL (outputs); this process connects a DEALER and a
PUSH. Three threads here:
  input thread:  DEALER -> decode msgpack -> input_queue
  busy loop:     drain input_queue, then step the core while it has work, pushing outputs to output_queue;
                 when there is no work it blocks on input_queue (no spinning: on a 2-core machine a
                 spinning loop would steal a core from the model). An encoder pooling model's steps also
                 look at input_queue between two layers (the express lane, engine/core.py `install_express`)
  output thread: output_queue -> encode msgpack -> PUSH
The first message on the DEALER is READY (or FAILED with the error) once the model is loaded. With data
parallelism several of these processes share the client's two sockets: each is started with its engine index,
builds its config as that data-parallel rank, and stamps the index on everything it sends. The process
exits on SIGTERM, on a SHUTDOWN request, or when its parent disappears; it ignores SIGINT (a terminal's Ctrl-C
reaches the whole group, and the client stops it).
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from pagedllm.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HandshakeMessage,
    UtilityOutput,
    UtilityRequest,
)

# Named, not __name__: run as `python -m`, this module is __main__, whose logger is not under "pagedllm".
logger = logging.getLogger("pagedllm.engine.core_proc")

_STOP = object()
HEALTH_CHECK_INTERVAL_S = 1.0


class EngineCoreProc:
    def __init__(
        self, engine_args_json: bytes, input_addr: str, output_addr: str, identity: bytes, engine_index: int = 0
    ) -> None:
        self.engine_index = engine_index
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, identity)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RCVHWM, 0)  # every request the front end sends is queued (core_process.py)
        self.dealer.connect(input_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(output_addr)
        self.engine_args_json = engine_args_json
        self.encoder = msgspec.msgpack.Encoder()
        self.engine_core = None
        # Messages an express poll took from input_queue during a step but left for after it (_express_poll).
        self._deferred: collections.deque[tuple[EngineCoreRequestType, Any]] = collections.deque()
        self._express = False  # whether the engine core has the express lane (install_express)

    # ---- start-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        start = time.perf_counter()
        import torch  # noqa: F401  (imported by the config and the model anyway: timed here, with the imports)

        from pagedllm.engine.arg_utils import EngineArgs
        from pagedllm.engine.core import EngineCore

        logger.info("startup: engine core imports %.2f s", time.perf_counter() - start)

        try:
            args = EngineArgs(**msgspec.json.decode(self.engine_args_json))
            config_start = time.perf_counter()
            config = args.create_engine_config(data_parallel_rank=self.engine_index)
            logger.info("startup: engine config %.2f s", time.perf_counter() - config_start)
            self.engine_core = EngineCore(config)
        except BaseException as e:  # report, then exit: the client raises with this message
            msg = HandshakeMessage(status="FAILED", error=f"{type(e).__name__}: {e}")
            self.dealer.send(self.encoder.encode(msg))
            # The process leaves with os._exit: deliver the report first (up to 2 s), or it dies in the queue.
            self.dealer.setsockopt(zmq.LINGER, 2000)
            self.dealer.close()
            self.push.close(linger=0)
            self.ctx.term()
            raise
        self._express = self.engine_core.install_express(self._express_poll)
        ready = HandshakeMessage(status="READY", num_blocks=self.engine_core.num_blocks, pid=os.getpid())
        self.dealer.send(self.encoder.encode(ready))
        # Everything allocated so far lives until exit: keep the collector from scanning it every cycle.
        gc.collect()
        gc.freeze()
        self.engine_core.froze_gc = True

    # ---- threads ---------------------------------------------------------------------------------

    def _input_thread(self) -> None:
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        utility_decoder = msgspec.msgpack.Decoder(UtilityRequest)
        try:
            while True:
                kind_frame, payload = self.dealer.recv_multipart(copy=False)
                kind = EngineCoreRequestType(bytes(kind_frame.buffer))
                if kind == EngineCoreRequestType.ADD:
                    self.input_queue.put((kind, add_decoder.decode(payload.buffer)))
                elif kind == EngineCoreRequestType.ABORT:
                    self.input_queue.put((kind, abort_decoder.decode(payload.buffer)))
                elif kind == EngineCoreRequestType.UTILITY:
                    self.input_queue.put((kind, utility_decoder.decode(payload.buffer)))
                else:
                    self.input_queue.put((kind, None))
        except zmq.ContextTerminated:
            return

    def _output_thread(self) -> None:
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            self.push.send(self.encoder.encode(item), copy=False)

    def _parent_watch(self, parent: int) -> None:
        # If the front end dies without a goodbye (SIGKILL), do not outlive it.
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(1.0)

    # ---- busy loop -------------------------------------------------------------------------------

    def _wait_for_input(self, core: Any) -> tuple[EngineCoreRequestType, Any]:
        """Block until a request arrives, checking every second that the executor's workers are alive (a rank
        that died while the engine was idle takes the core down now, not at the next request)."""
        while True:
            try:
                return self.input_queue.get(timeout=HEALTH_CHECK_INTERVAL_S)
            except queue.Empty:
                core.check_health()

    def run_busy_loop(self) -> None:
        core = self.engine_core
        assert core is not None
        while True:
            self._handle_deferred()  # what the express polls of the last step left
            if not core.has_unfinished_requests():
                self._handle(*self._wait_for_input(core))  # nothing to do until a request arrives
            while not self.input_queue.empty():
                self._handle(*self.input_queue.get_nowait())
            if self._express:  # short calls waiting at a step's start go first, in a step of their own
                self._run_express()
                self._handle_deferred()  # what its polls left (an abort, a shutdown) goes before the step
            if core.has_unfinished_requests():
                self._send(core.step())

    def _handle_deferred(self) -> None:
        """The messages express polls left for after a step, in arrival order."""
        while self._deferred:
            self._handle(*self._deferred.popleft())

    def _send(self, outputs: EngineCoreOutputs) -> None:
        """A step's outputs to the output thread, stamped with this engine's index (nothing when empty)."""
        if outputs.outputs:
            outputs.engine_index = self.engine_index
            self.output_queue.put(outputs)

    def _express_poll(self) -> None:
        """Between two layers of an encoder step (EngineCore.install_express): requests that arrived meanwhile join
        the scheduler, and those of short calls run now, in an express step. Anything else that arrived (an abort, a
        utility call, a shutdown), and every message after it, waits for the end of the step, in order."""
        if self.input_queue.empty():
            return
        core = self.engine_core
        assert core is not None
        while True:
            try:
                kind, payload = self.input_queue.get_nowait()
            except queue.Empty:
                break
            if kind == EngineCoreRequestType.ADD and not self._deferred:
                core.add_request(payload)
            else:
                self._deferred.append((kind, payload))
        self._run_express()

    def _run_express(self) -> None:
        """An express step of the short calls waiting, if any; their outputs go out at once."""
        assert self.engine_core is not None
        self._send(self.engine_core.express_step())

    def _handle(self, kind: EngineCoreRequestType, payload: Any) -> None:
        core = self.engine_core
        if kind == EngineCoreRequestType.ADD:
            core.add_request(payload)
        elif kind == EngineCoreRequestType.ABORT:
            core.abort_requests(payload)
        elif kind == EngineCoreRequestType.UTILITY:
            self._utility(payload)
        elif kind == EngineCoreRequestType.SHUTDOWN:
            raise SystemExit(0)

    def _utility(self, req: UtilityRequest) -> None:
        out = UtilityOutput(call_id=req.call_id)
        try:
            if req.method.startswith("_"):
                raise ValueError(f"utility method {req.method!r} is not callable")
            out.result = getattr(self.engine_core, req.method)(*req.args)
        except Exception as e:
            out.failure_message = f"{type(e).__name__}: {e}"
        self.output_queue.put(EngineCoreOutputs(utility_output=out, engine_index=self.engine_index))

    def shutdown(self) -> None:
        self.output_queue.put(_STOP)
        if self.engine_core is not None:
            self.engine_core.shutdown()


def run_engine_core(
    engine_args_json: bytes, input_addr: str, output_addr: str, identity: bytes, engine_index: int = 0
) -> None:
    """Entry point of the engine-core process (`python -m pagedllm.engine.core_proc IN OUT IDENTITY INDEX`, with
    the engine arguments as JSON on stdin: nothing of the parent's `__main__` is re-imported). INDEX is the
    engine's data-parallel rank."""
    from pagedllm.logger import configure_logging

    configure_logging()
    parent = os.getppid()

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C in a terminal reaches the whole process group: the client stops this process itself (SIGTERM), so that
    # a server's Ctrl-C is one clean stop, not an engine that died under it (as the workers do, worker_proc.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = EngineCoreProc(engine_args_json, input_addr, output_addr, identity, engine_index)
    threading.Thread(target=proc._parent_watch, args=(parent,), daemon=True, name="parent-watch").start()
    status = 0
    out_thread = threading.Thread(target=proc._output_thread, daemon=True, name="core-output")
    try:
        proc.start()
        # Again: ray.init (the Ray executor) replaces the SIGTERM handler with one that exits with status 15, after a
        # stack dump of its own. A stop is a stop (status 0) here, whichever executor runs the ranks.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=proc._input_thread, daemon=True, name="core-input").start()
        out_thread.start()
        proc.run_busy_loop()
    except SystemExit as e:
        status = int(e.code or 0)
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        logger.error("engine core died")
        status = 1
    finally:
        # Stopping already: a stop asked for now must not cut the executor's shutdown short (its own waits are bounded;
        # the client kills this process if it takes longer than it allows).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        proc.shutdown()
        # Let the output thread flush what is queued, then leave without waiting on blocked sockets.
        if out_thread.is_alive():
            out_thread.join(timeout=2.0)
        sys.stderr.flush()
        os._exit(status)


def run_spare() -> None:
    """A spare engine core (core_process.py `SpareCore`): the imports first, then the engine it is told to be on
    stdin (a JSON line with its sockets, then the engine arguments); nothing on stdin: exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is its owner's to act on
    import torch  # noqa: F401

    import pagedllm.engine.arg_utils  # noqa: F401
    import pagedllm.engine.core  # noqa: F401
    import pagedllm.executor.uniproc  # noqa: F401  (the worker, the model runner, the models' layers)

    header = sys.stdin.buffer.readline()
    if not header.strip():
        os._exit(0)
    where = msgspec.json.decode(header)
    run_engine_core(
        sys.stdin.buffer.read(), where["input"], where["output"], where["identity"].encode(), int(where["index"])
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--spare"]:
        run_spare()
    _in, _out, _identity, _index = sys.argv[1:5]
    run_engine_core(sys.stdin.buffer.read(), _in, _out, _identity.encode(), int(_index))
