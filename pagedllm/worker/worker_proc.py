"""A worker process: one tensor-parallel rank of the multiprocess executor (executor/multiproc.py).

Run as `python -m pagedllm.worker.worker_proc` with a JSON object on stdin: rank, world_size, dist_port (the gloo
rendezvous, on 127.0.0.1), engine_args, ring (the broadcast ring's handle) and response_address (a ZMQ PULL socket
of the executor). The process asks the kernel to kill it when its parent dies, joins the gloo group, builds its
Worker (config, its shard of the model), reports (`WorkerResponse` with call_id -1, or the error), then serves the
ring's `WorkerRequest`s in order until "shutdown". A call that raises is answered with the error whatever its
`reply`, and the process goes on (the executor decides what an error means).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
from typing import Any

import msgspec
import zmq

from pagedllm.engine.protocol import WorkerRequest, WorkerResponse

logger = logging.getLogger("pagedllm.worker.worker_proc")

# A collective waits this long for a peer before failing (gloo's default is 30 minutes).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux); elsewhere a thread polls the parent's pid."""
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() == parent:  # the parent may have died before the call
                return
            os._exit(1)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def init_tensor_parallel(rank: int, world_size: int, host: str, port: int, device: str, one_machine: bool) -> Any:
    """Join the ranks' process group (gloo on the CPU, nccl on CUDA) at `host`:`port` (rank 0's machine; 127.0.0.1
    for ranks on one machine); the rank's TensorParallelGroup. CPU ranks on `one_machine` also share a
    shared-memory all-reduce (float32 sums go through it, and the fused decoder calls it), where it is built."""
    import torch.distributed as dist

    from pagedllm.distributed.parallel_state import TensorParallelGroup

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    group = dist.group.WORLD
    shm = None
    if device == "cpu" and one_machine:
        from pagedllm.distributed import shm_allreduce

        if shm_allreduce.available():
            shm = shm_allreduce.ShmAllReduce.create(f"tp{port}", rank, world_size, group=group)
        elif rank == 0:
            logger.warning("all-reduce through gloo: %s", shm_allreduce.unavailable_reason())
    return TensorParallelGroup(rank, world_size, group, shm)


class WorkerProc:
    """One rank: its Worker and the requests it answers. The multiprocess executor's ranks read requests from the
    ring and answer on a socket (`serve`); a Ray actor (executor/ray_executor.py) calls `handle` directly."""

    def __init__(self, init: dict[str, Any], connect: bool = True) -> None:
        self.rank = int(init["rank"])
        self.encoder = msgspec.msgpack.Encoder()
        self.init = init
        self.worker: Any = None
        if connect:
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.PUSH)
            self.sock.setsockopt(zmq.LINGER, 2000)
            self.sock.connect(init["response_address"])

    def send(self, call_id: int, result: bytes = b"", error: str | None = None) -> None:
        self.sock.send(self.encoder.encode(WorkerResponse(call_id, self.rank, result, error)))

    def start(self) -> None:
        from pagedllm.engine.arg_utils import EngineArgs
        from pagedllm.worker.worker import Worker

        init = self.init
        config = EngineArgs(**init["engine_args"]).create_engine_config()
        device = config.device_config.device
        host = init.get("dist_host", "127.0.0.1")
        one_machine = bool(init.get("one_machine", True))
        world = int(init["world_size"])
        tp = init_tensor_parallel(self.rank, world, host, int(init["dist_port"]), device, one_machine)
        self.worker = Worker(config, tp)

    def handle(self, req: WorkerRequest) -> WorkerResponse | None:
        """Run one request on the worker: its answer, or None where its `reply` asks none of this rank. An error is
        always answered."""
        from pagedllm.core.sched_output import SchedulerOutput
        from pagedllm.structured_output import GrammarOutput

        try:
            if req.method == "execute_model":
                result: Any = self.worker.execute_model(msgspec.msgpack.decode(req.args, type=SchedulerOutput))
            elif req.method == "sample_tokens":
                grammar = msgspec.msgpack.decode(req.args, type=GrammarOutput | None)
                result = self.worker.sample_tokens(grammar)
            elif req.method.startswith("_"):
                raise ValueError(f"worker method {req.method!r} is not callable")
            else:
                args = msgspec.msgpack.decode(req.args) if req.args else []
                result = getattr(self.worker, req.method)(*args)
        except Exception as e:
            logger.exception("rank %d: %s failed", self.rank, req.method)
            return WorkerResponse(req.call_id, self.rank, error=f"{type(e).__name__}: {e}")
        if req.reply == "all" or (req.reply == "driver" and self.rank == 0):
            return WorkerResponse(req.call_id, self.rank, self.encoder.encode(result))
        return None

    def serve(self) -> None:
        """Answer the ring's requests until "shutdown"."""
        from pagedllm.distributed.shm_ring import ShmRing

        ring = ShmRing.attach(self.init["ring"], self.rank)
        request_decoder = msgspec.msgpack.Decoder(WorkerRequest)
        try:
            while True:
                req = request_decoder.decode(ring.read())
                if req.method == "shutdown":
                    return
                resp = self.handle(req)
                if resp is not None:
                    self.sock.send(self.encoder.encode(resp))
        finally:
            ring.close()


def main() -> None:
    die_with_parent()
    from pagedllm.logger import configure_logging

    configure_logging()
    # Ctrl-C in a terminal reaches the whole process group: the engine core stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    init = msgspec.json.decode(sys.stdin.buffer.read())
    proc = WorkerProc(init)
    try:
        proc.start()
    except BaseException as e:
        logger.exception("rank %d failed to start", proc.rank)
        proc.send(-1, error=f"{type(e).__name__}: {e}")
        proc.sock.close()
        proc.ctx.term()
        os._exit(1)
    proc.send(-1)
    status = 0
    try:
        proc.serve()
    except BaseException:
        logger.exception("rank %d died", proc.rank)
        status = 1
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
