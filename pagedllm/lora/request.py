"""`LoRARequest`: the adapter a request runs with, as vLLM names it (`vllm.lora.request.LoRARequest`).

Contract. `LoRARequest(lora_name, lora_int_id, lora_path)`: `lora_int_id` (> 0) identifies the adapter inside the
engine (its weights are loaded once per id, and the prefix cache keys a request's blocks by it), `lora_name` is what
the server's `model` field names, `lora_path` is a PEFT folder (adapter_config.json + adapter_model.safetensors) or a
llama.cpp LoRA GGUF file. Two requests are the same adapter when their names are equal. It is a msgspec struct: it
travels to the engine core inside `EngineCoreRequest`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


class LoRARegistry:
    """The front end's record of the adapters its engines hold, by id: an id names one adapter (name and path)."""

    def __init__(self) -> None:
        self.by_id: dict[int, LoRARequest] = {}

    def needs_loading(self, lora: LoRARequest) -> bool:
        """Whether `lora` must be sent to the engines; ValueError when its id is another adapter's."""
        known = self.by_id.get(lora.lora_int_id)
        if known is None:
            return True
        if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                f"{lora.lora_name!r} ({lora.lora_path}) needs an id of its own"
            )
        return False

    def added(self, lora: LoRARequest) -> None:
        self.by_id[lora.lora_int_id] = lora

    def removed(self, lora_id: int) -> LoRARequest | None:
        return self.by_id.pop(lora_id, None)

    def by_name(self, name: str) -> LoRARequest | None:
        return next((r for r in self.by_id.values() if r.lora_name == name), None)


@contextlib.contextmanager
def lora_errors() -> Iterator[None]:
    """Turn an engine's failure to load an adapter (a utility call's RuntimeError carrying the worker's ValueError)
    back into the ValueError it was."""
    try:
        yield
    except RuntimeError as e:
        message = str(e)
        at = message.rfind("ValueError: ")
        if at < 0:
            raise
        raise ValueError(message[at + len("ValueError: ") :]) from None


def parse_lora_modules(values: list[str] | None, first_id: int = 1) -> list[LoRARequest]:
    """--lora-modules: each `name=path` or JSON {"name", "path", "base_model_name"}, numbered from `first_id`;
    ValueError naming a malformed or repeated entry."""
    out: list[LoRARequest] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{"):
            try:
                spec = json.loads(value)
                name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {value!r}: JSON needs "name" and "path"') from None
        else:
            name, sep, path = value.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or JSON")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoRARequest(str(name), first_id + len(out), str(path), base))
    return out
