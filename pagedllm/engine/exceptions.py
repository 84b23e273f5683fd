"""Errors the front end raises about the engine itself (not about a request)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete. Raised once per call, never a hang."""

    def __init__(self, message: str = "the engine core process died; restart the engine") -> None:
        super().__init__(message)


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode): it frees its memory until woken; requests are refused meanwhile."""

    def __init__(self, message: str = "the engine is asleep: wake it up first (POST /wake_up, LLM.wake_up())") -> None:
        super().__init__(message)
