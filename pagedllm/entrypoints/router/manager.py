"""ModelManager: the router's models, each in its own engine-core process, started on first use.

Contract:
* Every model has a state: unloaded (no process), loading (its engine starting, or waking from sleep), loaded
  (awake, serving), sleeping (its process kept, its weights and KV cache freed: `AsyncLLM.sleep(1)`) or failed (its
  load raised; the error is kept and answered to its requests, 503, until `POST /models/load` retries it or
  `/models/unload` clears it; the other models serve on).
* `acquire(name)` returns the model's `ModelStack` (engine and serving objects) once it is loaded, counting one
  request in flight until `release(name)`; it loads or wakes the model first when needed. It waits (for the load,
  or for room, or for its turn) at most `wait_timeout` seconds, then raises `ModelUnavailable`; an unknown name raises
  `UnknownModel`. A waiter that is cancelled (its client left) leaves a load it started running.
* `max_loaded` (--models-max): at most that many models awake (loading or loaded) at once. Room is made by putting
  the least recently used idle model (no request in flight or waiting for it) to sleep, or by unloading it
  (`evict="unload"`, or an engine without sleep mode). A model with requests in flight is never evicted: when every
  awake model is busy, the least recently used one drains (takes no new request; its new requests wait as for a
  load) and is evicted once its requests in flight are done, so a model that is never idle cannot keep another out.
* `sleep_idle_s` (--sleep-idle-seconds): a model awake and idle that long goes to sleep.
* `max_running` (--models-max-running, default 1): at most that many models compute at once. The others' requests
  wait for a turn, in the order their models asked for one. A turn takes every request of its model waiting when it
  began; once another model waits, the oldest turn takes no new request, and a turn whose own model's later request
  finds another model waiting closes too; a closed turn passes when its requests in flight have finished (a waiter
  that gives up reopens what was closed for it). Requests that only tokenize (`compute=False`) take no turn. Two
  models computing side by side share the cores, and each one's thread team then waits on threads the other holds:
  on two cores a stream that changed model every 10 requests ran at 0.40 of the single-model throughput that way
  (bench/RESULTS.md); those that do (max_running > 1) split `total_threads` between them.
* A dead engine (its process killed) is noticed within MONITOR_INTERVAL_S (or by the next request for it): its
  requests in flight have their error (503), its process is reaped, its state becomes unloaded, and the next request
  starts it again. A restart that fails makes the model failed.
* `shutdown()` stops every engine (and a load in progress, when its engine comes up).

All state lives on the event loop; nothing here blocks it: engines are built (`build(spec)`, blocking) and their
processes stopped in worker threads. Engines are built one at a time: the front end's first imports (transformers'
lazy module) fail when two threads make them at once, and two cores gain little from two loads side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from pagedllm.entrypoints.router.entry import (
    ModelEntry,
    ModelState,
    ModelUnavailable,
    UnknownModel,
    engine_dead,
    engine_pids,
    pick_evictee,
    stop_engine,
)
from pagedllm.entrypoints.router.models import ModelSpec

logger = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.5
SHUTDOWN_WAIT_S = 30.0  # for loads in progress at shutdown (a model load cannot be interrupted)


class ModelManager:
    def __init__(
        self,
        specs: Iterable[ModelSpec],
        build: Callable[[ModelSpec], Any],
        max_loaded: int | None = None,
        evict: str = "sleep",
        sleep_idle_s: float | None = None,
        wait_timeout: float = 600.0,
        max_running: int | None = 1,
        total_threads: int | None = None,
    ) -> None:
        """`build(spec)` returns the ModelStack of a started engine (blocking: it runs in a worker thread)."""
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--models-max must be at least 1, got {max_loaded}")
        if evict not in ("sleep", "unload"):
            raise ValueError(f"--models-evict must be sleep or unload, got {evict!r}")
        if sleep_idle_s is not None and not sleep_idle_s > 0:
            raise ValueError(f"--sleep-idle-seconds must be positive, got {sleep_idle_s}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"--models-max-running must be at least 1, got {max_running}")
        if not wait_timeout > 0:
            raise ValueError(f"--models-wait-timeout must be positive, got {wait_timeout}")
        self.entries = {spec.name: ModelEntry(spec) for spec in specs}
        self.build = build
        self.max_loaded = max_loaded
        self.evict = evict
        self.sleep_idle_s = sleep_idle_s
        self.wait_timeout = wait_timeout
        self.max_running = max_running
        self._turns: dict[str, float] = {}  # the models computing now (holding a turn), by the start of their turn
        self._closing: set[str] = set()  # turns that take no new request (another model waits)
        self._queue: list[str] = []  # ready models waiting for a turn, in order
        # Loaded models that take no new request until they have made room: victim -> the model waiting for room.
        self._draining: dict[str, str] = {}
        self.total_threads = total_threads  # shared by the models computing at once (None: left alone)
        self._threads_of: dict[str, int] = {}  # the thread count each model's engine was last given
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task | None = None
        self._closed = False
        self._build_lock = threading.Lock()

    # ---- requests -------------------------------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownModel(f"The model `{name}` does not exist. Available models: {', '.join(self.entries)}.")
        return entry

    def try_acquire(self, name: str, compute: bool = True) -> Any:
        """The model's stack, counted in flight, if it is ready now; else None (then `acquire`). `compute` False:
        a request that only uses the front end (tokenizing): it takes no turn."""
        entry = self.entry(name)
        if not self._serving(entry) or (compute and not self._take_turn(entry, time.monotonic())):
            return None
        entry.in_flight += 1
        entry.last_used = time.monotonic()
        return entry.stack

    async def acquire(self, name: str, compute: bool = True) -> Any:
        """The model's stack once it is loaded, counted in flight (see the module docstring; `compute` as in
        `try_acquire`)."""
        entry = self.entry(name)
        arrived = time.monotonic()
        deadline = arrived + self.wait_timeout
        entry.waiting += 1
        try:
            while True:
                self._reap_if_dead(entry)
                if self._serving(entry) and (not compute or self._take_turn(entry, arrived)):
                    entry.in_flight += 1
                    entry.last_used = time.monotonic()
                    return entry.stack
                if entry.state is ModelState.FAILED:
                    raise ModelUnavailable(f"The model `{name}` failed to load: {entry.error}")
                if entry.task is None and entry.state in (ModelState.UNLOADED, ModelState.SLEEPING):
                    if self._make_room(entry):
                        self._start_bring_up(entry)
                await self._wait_change(deadline, entry)
        finally:
            entry.waiting -= 1
            if not entry.waiting:  # its last waiter gave up (or is served): no model drains for it any more
                self._undrain(name)
            if entry.waiting == 0 and name in self._queue:
                self._queue.remove(name)
                # Turns closed for it alone open again; the models behind it in the queue may go now.
                self._closing = {t for t in self._closing if any(q != t for q in self._queue)}
                self._notify()
            elif entry.evictable:  # it may make room for another model's now
                self._notify()

    def release(self, name: str) -> None:
        entry = self.entries[name]
        entry.in_flight -= 1
        entry.last_used = time.monotonic()
        if entry.in_flight == 0:
            self._turns.pop(name, None)  # its turn ends with its last request
            self._closing.discard(name)
            self._share_threads()
            self._notify()

    @contextlib.asynccontextmanager
    async def use(self, name: str, compute: bool = True) -> AsyncIterator[Any]:
        """The model's stack for the duration of one request (`compute` as in `try_acquire`)."""
        stack = self.try_acquire(name, compute) or await self.acquire(name, compute)
        try:
            yield stack
        finally:
            self.release(name)

    def _take_turn(self, entry: ModelEntry, arrived: float) -> bool:
        """Whether a request for this (ready) model, arrived at `arrived`, may start now (`max_running` in the
        module docstring). A model's turn takes every request that was waiting when it began, and new ones until
        another model waits; a free turn goes to the first ready model in the queue. A request that may not start
        queues its model (once) and closes the oldest open turn, so that one ends."""
        name = entry.name
        if self.max_running is None:
            return True
        began = self._turns.get(name)
        if began is not None:
            if arrived <= began or (name not in self._closing and not any(q != name for q in self._queue)):
                return True
        elif len(self._turns) < self.max_running:
            # Models in the queue that are not ready (reloading after a death, unloaded) hold no one back.
            head = next((q for q in self._queue if self._serving(self.entries[q])), None)
            if head is None or head == name:
                if name in self._queue:
                    self._queue.remove(name)
                self._turns[name] = time.monotonic()
                self._share_threads()
                return True
        if name not in self._queue:  # also a model whose turn closed: its next turn comes in arrival order
            self._queue.append(name)
        if began is not None:
            self._closing.add(name)  # another model waits: this turn takes no new request
        elif len(self._turns) >= self.max_running:
            open_turns = [t for t in self._turns if t not in self._closing]
            if open_turns:
                self._closing.add(min(open_turns, key=self._turns.__getitem__))
        return False

    def _undrain(self, wanted_by: str, but: str | None = None) -> None:
        """The models draining for `wanted_by` (but `but`) take requests again."""
        drained = [v for v, w in self._draining.items() if w == wanted_by and v != but]
        for victim in drained:
            del self._draining[victim]
        if drained:
            self._notify()

    def _serving(self, entry: ModelEntry) -> bool:
        """Whether the model takes requests now: loaded, and not draining to make room for another."""
        return entry.ready and entry.name not in self._draining

    def _share_threads(self) -> None:
        """The models holding a turn split `total_threads` between them (one alone gets them all back): two thread
        teams of two on two cores each wait at every barrier for a thread the other holds."""
        if self.total_threads is None or not self._turns:
            return
        share = max(1, self.total_threads // len(self._turns))
        for name in self._turns:
            engine = self.entries[name].engine
            if self._threads_of.get(name, self.total_threads) != share and hasattr(engine, "set_num_threads"):
                self._threads_of[name] = share
                self._spawn(self._set_threads(engine, name, share), f"threads-{name}")

    async def _set_threads(self, engine: Any, name: str, share: int) -> None:
        try:
            await engine.set_num_threads(share)
        except Exception as e:  # a dead engine is reaped elsewhere; this is only a tuning
            logger.warning("router: could not give model %r %d threads: %s", name, share, e)
            self._threads_of.pop(name, None)

    # ---- operations (POST /models/load, /models/unload) --------------------------------------------------

    async def load(self, name: str) -> ModelEntry:
        """Load (or wake) the model and wait until it is loaded; a failed model is tried again."""
        entry = self.entry(name)
        if entry.state is ModelState.FAILED and entry.task is None:
            entry.state, entry.error = ModelState.UNLOADED, None
        async with self.use(name):
            return entry

    async def unload(self, name: str) -> ModelEntry:
        """Stop the model's engine once its requests in flight have finished (a failed model: forget its error)."""
        entry = self.entry(name)
        deadline = time.monotonic() + self.wait_timeout
        while entry.task is not None:  # a load, wake or sleep under way ends first
            await self._wait_change(deadline, entry)
        if entry.stack is not None:
            entry.task = self._spawn(self._evict(entry, "unload"), f"unload-{name}")
            await asyncio.shield(entry.task)
        elif entry.state is ModelState.FAILED:
            entry.state, entry.error = ModelState.UNLOADED, None
        return entry

    # ---- transitions ------------------------------------------------------------------------------------

    def _make_room(self, entry: ModelEntry) -> bool:
        """True when `entry` may come up now; otherwise an eviction is started if a model is idle (the caller waits
        for a change either way)."""
        if self.max_loaded is None:
            return True
        awake = [e for e in self.entries.values() if e is not entry and e.awake]
        for other in awake:  # a dead engine's room is freed now, not at the monitor's next look
            self._reap_if_dead(other)
        if len(awake) < self.max_loaded:
            self._undrain(entry.name)
            return True
        victim = pick_evictee(awake, {v for v, wanted_by in self._draining.items() if wanted_by == entry.name})
        if victim is None and entry.name not in self._draining.values():
            # Every awake model is busy: the least recently used one computing takes no new request from now on, so
            # that it is idle once its requests in flight are done (a model always busy would keep this one out
            # forever). Not one whose requests only wait for a turn: it would go to sleep at once.
            ready = [e for e in awake if e.ready and e.in_flight and e.name not in self._draining]
            if ready:
                drained = min(ready, key=lambda e: e.last_used)
                self._draining[drained.name] = entry.name
                logger.info("router: %r takes no new request until it makes room for %r (--models-max %d)",
                            drained.name, entry.name, self.max_loaded)  # fmt: skip
                victim = pick_evictee([drained], self._draining)
        if victim is not None:
            self._undrain(entry.name, but=victim.name)
            how = self.evict
            logger.info("router: %s %r to make room for %r (--models-max %d)", how, victim.name, entry.name,
                        self.max_loaded)  # fmt: skip
            victim.task = self._spawn(self._evict(victim, how), f"{how}-{victim.name}")
        return False

    def _start_bring_up(self, entry: ModelEntry) -> None:
        # Loading from now on (not from the task's first step): the next room check counts it awake.
        waking = entry.state is ModelState.SLEEPING
        entry.state = ModelState.LOADING
        entry.task = self._spawn(self._bring_up(entry, waking), f"{'wake' if waking else 'load'}-{entry.name}")
        self._notify()

    async def _bring_up(self, entry: ModelEntry, waking: bool) -> None:
        """Wake the sleeping model, or start its engine; failed when its engine cannot start."""
        started = time.monotonic()
        try:
            if waking:
                await entry.engine.wake_up()
            else:
                entry.stack = await asyncio.to_thread(self._build, entry.spec)
                entry.loads += 1
                entry.max_model_len = int(entry.engine.model_config.max_model_len)
        except Exception as e:
            await self._drop_stack(entry)
            entry.error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            # A model that cannot wake starts afresh on its next request; one that cannot start has failed.
            entry.state = ModelState.UNLOADED if waking else ModelState.FAILED
            logger.error("router: model %r %s: %s", entry.name, "did not wake" if waking else "failed to load",
                         entry.error)  # fmt: skip
        else:
            entry.state, entry.error = ModelState.LOADED, None
            entry.last_used = time.monotonic()
            logger.info("router: model %r %s in %.2f s", entry.name, "woke" if waking else "loaded",
                        time.monotonic() - started)  # fmt: skip
        finally:
            entry.task = None
            self._notify()

    def _build(self, spec: ModelSpec) -> Any:
        """In a worker thread: the model's stack; stopped again if the router closed meanwhile."""
        with self._build_lock:
            stack = self.build(spec)
        if self._closed:
            stack.engine.shutdown()
            raise ModelUnavailable("the server is shutting down")
        return stack

    async def _evict(self, entry: ModelEntry, how: str) -> None:
        """Put the model to sleep ("sleep") or stop its engine ("unload") once no request is in flight for it."""
        try:
            while entry.in_flight:
                await self._changed.wait()
            sleep = getattr(entry.engine, "sleep", None)  # an engine without sleep mode is unloaded instead
            if how == "sleep" and sleep is not None and not engine_dead(entry.engine):
                await sleep(1)
                entry.state = ModelState.SLEEPING
            else:
                await self._drop_stack(entry)
                entry.state = ModelState.UNLOADED
            logger.info("router: model %r is %s", entry.name, entry.state.value)
        except Exception as e:
            logger.error("router: model %r: %s failed (%s); its engine is stopped", entry.name, how, e)
            await self._drop_stack(entry)
            entry.state, entry.error = ModelState.UNLOADED, f"{how} failed: {e}"
        finally:
            entry.task = None
            self._draining.pop(entry.name, None)
            self._notify()

    async def _drop_stack(self, entry: ModelEntry) -> None:
        engine, entry.stack = entry.engine, None
        self._draining.pop(entry.name, None)  # gone (evicted, unloaded, dead): it drains no more
        self._threads_of.pop(entry.name, None)  # a new engine starts on every thread
        if engine is not None:
            try:
                await stop_engine(engine)
            except Exception:
                logger.exception("router: stopping the engine of %r failed", entry.name)

    def _reap_if_dead(self, entry: ModelEntry) -> None:
        """A dead engine (killed process): its stack dropped, the model unloaded (the next request restarts it)."""
        if entry.task is not None or entry.stack is None or not engine_dead(entry.engine):
            return
        pids = engine_pids(entry.engine)
        logger.error("router: the engine of model %r died (pid %s): it restarts on its next request", entry.name,
                     ", ".join(map(str, pids)) or "?")  # fmt: skip
        entry.error = "its engine core process died; it restarts on the next request"
        entry.task = self._spawn(self._reap(entry), f"reap-{entry.name}")

    async def _reap(self, entry: ModelEntry) -> None:
        try:
            await self._drop_stack(entry)
            entry.state = ModelState.UNLOADED
        finally:
            entry.task = None
            self._notify()

    # ---- waiting ------------------------------------------------------------------------------------------

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(coro, name=f"router-{name}")

    def _notify(self) -> None:
        """Wake everyone waiting for a change (a state, a request's end); later waiters wait for the next one."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, deadline: float, entry: ModelEntry) -> None:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
                return
        if entry.ready and entry.name in self._queue:
            why = f"other models computed for {self.wait_timeout:g} s (--models-max-running {self.max_running})"
        elif entry.name in self._draining:
            why = f"it was making room for `{self._draining[entry.name]}` for {self.wait_timeout:g} s"
        elif entry.state is ModelState.LOADING:
            why = f"it is still loading after {self.wait_timeout:g} s"
        elif entry.task is not None:
            why = f"it is still being put to sleep or unloaded after {self.wait_timeout:g} s"
        else:
            why = (
                f"no room to load it within {self.wait_timeout:g} s: --models-max {self.max_loaded} models are "
                "loaded and busy"
            )
        raise ModelUnavailable(f"The model `{entry.name}` is not available: {why} (--models-wait-timeout).")

    # ---- the life cycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching the engines (deaths, idle time); on the event loop. The builder prepares what it can
        ahead of the first load (server.py: a spare engine-core process)."""
        self._monitor = self._spawn(self._watch(), "monitor")
        prepare = getattr(self.build, "prepare", None)
        if prepare is not None:
            prepare()

    async def _watch(self) -> None:
        interval = MONITOR_INTERVAL_S if self.sleep_idle_s is None else min(MONITOR_INTERVAL_S, self.sleep_idle_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self._check_engines()
            except Exception:  # the monitor must outlive a bug in one check
                logger.exception("router: the engine monitor failed")

    def _check_engines(self) -> None:
        now = time.monotonic()
        for entry in self.entries.values():
            self._reap_if_dead(entry)
            idle = self.sleep_idle_s is not None and now - entry.last_used >= self.sleep_idle_s
            if idle and entry.evictable:
                logger.info("router: model %r idle for %g s (--sleep-idle-seconds)", entry.name, self.sleep_idle_s)
                entry.task = self._spawn(self._evict(entry, "sleep"), f"sleep-{entry.name}")

    async def shutdown(self) -> None:
        """Stop every engine (after the loads under way, which cannot be interrupted, have ended)."""
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        pending = [e.task for e in self.entries.values() if e.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=SHUTDOWN_WAIT_S)
        running = [e for e in self.entries.values() if e.stack is not None]
        await asyncio.gather(*(self._drop_stack(e) for e in running))
        await asyncio.to_thread(self._close_builder)
        for entry in running:
            entry.state = ModelState.UNLOADED
        if running:
            logger.info("router: stopped the engines of %s", ", ".join(repr(e.name) for e in running))

    def _close_builder(self) -> None:
        close = getattr(self.build, "close", None)  # the builder's spare engine process (server.py)
        if close is not None:
            close()

    def close(self) -> None:
        """After the event loop ended (a backstop of `shutdown`): stop what still runs."""
        self._closed = True
        self._close_builder()
        for entry in self.entries.values():
            if entry.stack is not None:
                entry.stack.engine.shutdown()
                entry.stack = None

    # ---- what the server shows -----------------------------------------------------------------------------

    def stacks(self) -> list[Any]:
        """The stacks of the models that have one (loaded or sleeping)."""
        return [e.stack for e in self.entries.values() if e.stack is not None]

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        """A model's state for /v1/models and /health."""
        info: dict[str, Any] = {"state": entry.state.value, "in_flight": entry.in_flight, "loads": entry.loads}
        if entry.stack is not None:
            info["pids"] = engine_pids(entry.engine)
        if entry.error is not None:
            info["error"] = entry.error
        return info
