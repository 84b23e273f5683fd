"""MultiprocExecutor: one worker process per tensor-parallel rank on this machine.

Contract (beyond executor/abstract.py).
* Start: each rank is `python -m pagedllm.worker.worker_proc` (no fork of the engine core), given on stdin its
  rank, the engine arguments, the rendezvous port of the ranks' gloo group (tcp://127.0.0.1:<free port>), the
  broadcast ring and the address to answer on. Each rank builds its config and its shard of the model, then
  reports; the executor waits for every report and raises the first error (a ValueError stays a ValueError).
* Every call is serialized once (msgspec: a `WorkerRequest`, the SchedulerOutput inside as msgpack, no pickle)
  and written once into a shared-memory ring (distributed/shm_ring.py) that every rank reads. Answers come back on
  a ZMQ PULL socket: `execute_model` is answered by rank 0 alone (the others answer only with an error),
  `collective_rpc` by every rank.
* A rank that exits, or answers with an error, makes the waiting call raise `RuntimeError` naming the rank within
  about 0.1 s: the engine core dies with it and its client raises `EngineDeadError`.
* No rank outlives the executor: `shutdown()` asks them to stop, then terminates and kills what is left; each rank
  also asks the kernel to kill it when the engine core dies (PR_SET_PDEATHSIG), so a kill -9 of the core leaves no
  worker behind.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.distributed.net import free_port
from pagedllm.distributed.shm_ring import ShmRing
from pagedllm.engine.protocol import WorkerRequest, WorkerResponse
from pagedllm.executor.abstract import RemoteWorkersExecutor

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 5.0
_POLL_MS = 100


class MultiprocExecutor(RemoteWorkersExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.engine_args is None:
            raise ValueError("the multiprocess executor needs a config built by EngineArgs.create_engine_config()")
        self.world_size = config.parallel_config.tensor_parallel_size
        self._call_ids = itertools.count()
        self._response_decoder = msgspec.msgpack.Decoder(WorkerResponse)
        self._stopping = False
        self._dead: str | None = None
        self.procs: list[subprocess.Popen] = []
        self.tmpdir = tempfile.mkdtemp(prefix="pagedllm-workers-")
        self.ctx = zmq.Context()
        self.responses = self.ctx.socket(zmq.PULL)
        self.responses.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self.tmpdir}/responses"
        self.responses.bind(address)
        self.ring = ShmRing.create(num_readers=self.world_size)
        try:
            self._start_workers(config.engine_args, address)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -------------------------------------------------------------------------------------------

    def _start_workers(self, engine_args: dict[str, Any], address: str) -> None:
        port = free_port()
        for rank in range(self.world_size):
            init = {
                "rank": rank,
                "world_size": self.world_size,
                "dist_port": port,
                "engine_args": engine_args,
                "ring": self.ring.handle(),
                "response_address": address,
            }
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.worker.worker_proc"], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(init))
            proc.stdin.close()
            self.procs.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"worker-{rank}-watch").start()
        logger.info("started %d worker processes (tensor parallel, gloo on 127.0.0.1:%d)", self.world_size, port)
        pending = set(range(self.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            resp = self._recv(deadline)
            if resp.call_id != -1:
                continue
            if resp.error is not None:
                if resp.error.startswith("ValueError: "):
                    raise ValueError(resp.error.removeprefix("ValueError: "))
                raise RuntimeError(f"worker rank {resp.rank} failed to start: {resp.error}")
            pending.discard(resp.rank)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        status = proc.wait()
        if not self._stopping and self._dead is None:
            self._dead = f"worker rank {rank} (pid {proc.pid}) exited with status {status}"
            logger.error("%s", self._dead)

    # ---- calls ----------------------------------------------------------------------------------------------

    def _recv(self, deadline: float | None = None) -> WorkerResponse:
        while True:
            if self.responses.poll(_POLL_MS):
                return self._response_decoder.decode(self.responses.recv())
            if self._dead is not None:
                raise RuntimeError(self._dead)
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError("worker processes not ready in time")

    def _alive(self) -> None:
        if self._dead is not None:
            raise RuntimeError(self._dead)

    def check_health(self) -> None:
        self._alive()

    def _call(self, method: str, args: bytes, reply: str) -> list[WorkerResponse]:
        if self._dead is not None:
            raise RuntimeError(self._dead)
        call_id = next(self._call_ids)
        self.ring.write(self._encoder.encode(WorkerRequest(call_id, method, args, reply)), alive=self._alive)
        expected = set(range(self.world_size)) if reply == "all" else {0}
        answers: dict[int, WorkerResponse] = {}
        while expected - answers.keys():
            resp = self._recv()
            if resp.call_id != call_id:
                continue  # a late answer to an earlier call that failed elsewhere
            if resp.error is not None:
                raise RuntimeError(f"worker rank {resp.rank} failed in {method}: {resp.error}")
            answers[resp.rank] = resp
        return [answers[r] for r in sorted(expected)]

    # ---- shutdown -------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.procs and self._dead is None:
            try:
                self.ring.write(self._encoder.encode(WorkerRequest(-1, "shutdown", b"", "none")), timeout=1.0)
            except (TimeoutError, ValueError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.ring.close()
        self.responses.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def worker_pids(self) -> list[int]:
        """The worker processes' ids, in rank order (tests)."""
        return [p.pid for p in self.procs]
