"""RayDistributedExecutor: one Ray actor per tensor-parallel rank, anywhere in a Ray cluster.

Contract (beyond executor/abstract.py).
* Ray is an optional extra (`pip install 'pagedllm[ray]'`); without it the engine arguments already refuse the
  "ray" backend with that command. The executor joins the cluster named by $RAY_ADDRESS (read in config.py), or
  starts a local Ray when there is none.
* A placement group holds one bundle per rank of `ray_cpus_per_worker` CPUs (1 by default, so a cluster of one-CPU
  nodes can hold it; strategy PACK: on one node where they fit, spread where they do not). If the bundles are not
  placed within `PLACEMENT_TIMEOUT_S` (or $PAGEDLLM_RAY_PLACEMENT_TIMEOUT), the group is removed and a
  `RuntimeError` says what was asked and what the cluster has: never a hang.
* Each actor is a `WorkerProc` (worker/worker_proc.py) built in the actor: the same `WorkerRequest` /
  `WorkerResponse` bytes as the multiprocess executor's, handed over as actor-call arguments instead of through
  the shared-memory ring (ranks may be on different machines). The ranks' gloo group meets at rank 0's node
  address and a free port there.
* A dead actor makes the waiting call raise `RuntimeError` naming the rank. While the engine is idle,
  `check_health()` finds it without calling anyone: each actor runs one `watch()` call that never returns, in a
  concurrency group of its own (the calls of the default group stay one at a time, in order); its result turns
  ready, as an error, only when the actor dies, and `ray.wait(timeout=0)` asks for that. `shutdown()` kills the
  actors and removes the placement group (and stops Ray if this executor started it); a cluster that does not answer
  within RELEASE_TIMEOUT_S (it is gone) is left as it is, so that the engine still stops.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import msgspec

from pagedllm.config import EngineConfig, ray_address_from_env, ray_placement_timeout
from pagedllm.engine.protocol import WorkerRequest, WorkerResponse
from pagedllm.executor.abstract import RemoteWorkersExecutor

logger = logging.getLogger(__name__)

WATCH_GROUP = "watch"
# Seconds the cluster gets to kill the actors and remove the placement group at shutdown (see shutdown()).
RELEASE_TIMEOUT_S = 5.0


class _RankActor:
    """The body of each Ray actor: a WorkerProc without sockets."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: Any = None

    def node_address(self) -> tuple[str, int]:
        """This actor's node address and a free port on it (rank 0's: where the gloo group meets)."""
        import socket

        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def start(self, init: dict[str, Any]) -> bytes:
        from pagedllm.logger import configure_logging
        from pagedllm.worker.worker_proc import WorkerProc

        configure_logging()
        self.proc = WorkerProc(init, connect=False)
        try:
            self.proc.start()
        except BaseException as e:
            return msgspec.msgpack.encode(WorkerResponse(-1, self.rank, error=f"{type(e).__name__}: {e}"))
        return msgspec.msgpack.encode(WorkerResponse(-1, self.rank))

    def handle(self, request: bytes) -> bytes | None:
        resp = self.proc.handle(msgspec.msgpack.decode(request, type=WorkerRequest))
        return None if resp is None else msgspec.msgpack.encode(resp)

    def watch(self) -> None:
        """Never returns (in the "watch" concurrency group): its result is an error once the actor is dead."""
        import threading

        threading.Event().wait()


class RayDistributedExecutor(RemoteWorkersExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if config.engine_args is None:
            raise ValueError("the Ray executor needs a config built by EngineArgs.create_engine_config()")
        self._ray = ray
        self._remove_pg = remove_placement_group
        self.world_size = config.parallel_config.tensor_parallel_size
        cpus = config.parallel_config.ray_cpus_per_worker
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=ray_address_from_env(), log_to_driver=False, include_dashboard=False)
        self._call_ids = itertools.count()
        self._response_decoder = msgspec.msgpack.Decoder(WorkerResponse)
        self.actors: list[Any] = []
        self._watches: list[Any] = []
        self._stopped = False
        self.pg = placement_group([{"CPU": cpus}] * self.world_size, strategy="PACK")
        try:
            timeout = ray_placement_timeout()
            ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
            if not ready:
                raise RuntimeError(
                    f"Ray could not place {self.world_size} bundles of {cpus:g} CPU (tensor_parallel_size "
                    f"{self.world_size}, ray_cpus_per_worker {cpus:g}) within {timeout:g} s; the cluster has "
                    f"{ray.cluster_resources().get('CPU', 0):g} CPUs, {ray.available_resources().get('CPU', 0):g} "
                    "free"
                )
            actor_cls = ray.remote(concurrency_groups={WATCH_GROUP: 1})(_RankActor)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                self.actors.append(actor_cls.options(num_cpus=cpus, scheduling_strategy=strategy).remote(rank))
            self._watches = [actor.watch.options(concurrency_group=WATCH_GROUP).remote() for actor in self.actors]
            addresses = ray.get([actor.node_address.remote() for actor in self.actors])
            host, port = addresses[0]
            # Ranks on one machine (one address) also share a shared-memory all-reduce.
            one_machine = len({a[0] for a in addresses}) == 1
            starts = [
                actor.start.remote(
                    {
                        "rank": rank,
                        "world_size": self.world_size,
                        "dist_host": host,
                        "dist_port": port,
                        "engine_args": config.engine_args,
                        "one_machine": one_machine,
                    }
                )
                for rank, actor in enumerate(self.actors)
            ]
            for raw in ray.get(starts):
                resp = self._response_decoder.decode(raw)
                if resp.error is not None:
                    if resp.error.startswith("ValueError: "):
                        raise ValueError(resp.error.removeprefix("ValueError: "))
                    raise RuntimeError(f"Ray worker rank {resp.rank} failed to start: {resp.error}")
            logger.info("started %d Ray workers (gloo at %s:%d)", self.world_size, host, port)
        except BaseException:
            self.shutdown()
            raise

    def check_health(self) -> None:
        done, _ = self._ray.wait(self._watches, num_returns=len(self._watches), timeout=0)
        if done:
            rank = self._watches.index(done[0])
            try:
                self._ray.get(done[0])
                reason = "its watch call returned"
            except self._ray.exceptions.RayError as e:
                reason = type(e).__name__
            raise RuntimeError(f"Ray worker rank {rank} is gone: {reason}")

    def _call(self, method: str, args: bytes, reply: str) -> list[WorkerResponse]:
        request = self._encoder.encode(WorkerRequest(next(self._call_ids), method, args, reply))
        refs = [actor.handle.remote(request) for actor in self.actors]
        answers: list[WorkerResponse] = []
        pending = list(refs)
        while pending:
            done, pending = self._ray.wait(pending, num_returns=1)
            rank = refs.index(done[0])
            try:
                raw = self._ray.get(done[0])
            except self._ray.exceptions.RayError as e:
                raise RuntimeError(f"Ray worker rank {rank} died in {method}: {type(e).__name__}") from e
            if raw is None:
                continue
            resp = self._response_decoder.decode(raw)
            if resp.error is not None:
                raise RuntimeError(f"Ray worker rank {resp.rank} failed in {method}: {resp.error}")
            answers.append(resp)
        return sorted(answers, key=lambda r: r.rank)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        # Killing the actors and removing the placement group are calls to the cluster, which block, retrying, when
        # it is gone (a cluster stopped under a live engine): they get RELEASE_TIMEOUT_S, in a thread of their own,
        # so that the engine still stops (its actors went with the cluster anyway).
        released = threading.Thread(target=self._release, daemon=True, name="ray-release")
        released.start()
        released.join(RELEASE_TIMEOUT_S)
        if released.is_alive():
            logger.warning(
                "the Ray cluster did not answer within %.0f s (gone?): its actors and placement group are left to it",
                RELEASE_TIMEOUT_S,
            )
            return
        if self._started_ray:
            deadline = time.monotonic() + 10
            while self._ray.is_initialized() and time.monotonic() < deadline:
                self._ray.shutdown()

    def _release(self) -> None:
        for actor in self.actors:
            try:
                self._ray.kill(actor)
            except Exception:  # already gone
                pass
        try:
            self._remove_pg(self.pg)
        except Exception:
            pass
