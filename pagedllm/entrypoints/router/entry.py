"""One model of the router: its state, the errors a request for it can meet, and what the manager asks of its engine.

Contract: a model is unloaded, loading, loaded, sleeping or failed (manager.py says when it moves); it is ready
(takes requests) when loaded, alive and not in a transition; it is evictable when ready with no request in flight or
waiting. `pick_evictee` chooses the least recently used evictable model. An engine is anything with AsyncLLM's
`dead`, `errored`, `sleep(level)`, `wake_up()`, `shutdown()` and `model_config`.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.router.models import ModelSpec


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"
    FAILED = "failed"


class UnknownModel(LookupError):
    """A request named a model the router does not serve."""


class ModelUnavailable(RuntimeError):
    """A model could not serve a request: it failed to load, or it did not come up in time."""


@dataclass(eq=False)
class ModelEntry:
    """One model's state (see the module docstring). `task`: the transition under way (load, wake, sleep,
    unload); no request starts on a model while one runs."""

    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    stack: Any = None  # the ModelStack while loaded or sleeping
    error: str | None = None
    in_flight: int = 0
    waiting: int = 0  # requests waiting for this model
    last_used: float = 0.0  # time.monotonic() of its last request's start or end
    loads: int = 0  # engines started for it so far
    max_model_len: int | None = None  # known once it has loaded
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def awake(self) -> bool:
        return self.state in (ModelState.LOADING, ModelState.LOADED)

    @property
    def engine(self) -> Any:
        return None if self.stack is None else self.stack.engine

    @property
    def ready(self) -> bool:
        return self.state is ModelState.LOADED and self.task is None and not engine_dead(self.engine)

    @property
    def evictable(self) -> bool:
        return self.ready and self.in_flight == 0 and self.waiting == 0


def engine_dead(engine: Any) -> bool:
    return engine is not None and (engine.dead or engine.errored is not None)


def engine_pids(engine: Any) -> list[int]:
    """The engine-core process ids of an engine (empty when it has none)."""
    core = getattr(getattr(engine, "engine_core", None), "core", None)
    return [proc.pid for proc in getattr(core, "procs", [])]


def pick_evictee(entries: Iterable[ModelEntry], draining: Container[str] = ()) -> ModelEntry | None:
    """The model to put to sleep (or unload) to make room: the least recently used of the idle loaded ones (a model
    named in `draining` is idle once its requests in flight are done, whoever waits for it)."""
    idle = [e for e in entries if e.evictable or (e.name in draining and e.ready and e.in_flight == 0)]
    return min(idle, key=lambda e: e.last_used) if idle else None


async def stop_engine(engine: Any) -> None:
    """Stop an engine without blocking the event loop: its processes are terminated in a worker thread (that waits
    for them), then the front end is shut down here (its tasks belong to this loop)."""
    core = getattr(getattr(engine, "engine_core", None), "core", None)
    if core is not None:
        await asyncio.to_thread(core.terminate)
    engine.shutdown()
