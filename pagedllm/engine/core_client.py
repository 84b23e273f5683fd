"""Clients of the engine core. `InprocClient` calls an EngineCore in this process (tests, debugging).

Every client offers the same calls: add_request, abort_requests, get_output (one step's outputs), and
utility calls by name. The multiprocess clients speak msgpack over ZMQ to an EngineCoreProc.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)

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
