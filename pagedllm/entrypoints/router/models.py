"""The router's models: which files and folders are models, what they are called, and their engine arguments.

Contract:
* `discover(models_dir, paths)`: every `*.gguf` file and every folder holding a `config.json` directly inside
  `models_dir` (`--models-dir`; symbolic links followed, hidden entries and anything else skipped), plus each path
  of `paths` (`--models`: a .gguf file or an HF folder with config.json; anything else a ValueError naming it).
  Nothing is read but directory entries: a broken model is found out when it is loaded.
* A model is named by its file without `.gguf` (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct.Q4_1`)
  or by its folder's name. Two models of one name (or one path given twice) are a ValueError naming both paths; no
  model at all is a ValueError. The specs come sorted by name.
* `model_engine_args(base, spec)`: the flags of `pagedllm serve` apply to every model, with the model's path and
  name; `--max-model-len` is a ceiling (a model whose own limit is lower gets its limit, so that one value serves a
  2k-context embedder beside an 8k generator). The runner is each model's own: `--runner auto` (the default) runs
  an embedder or a classifier as a pooling model and a causal LM as a generator.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.engine.arg_utils import EngineArgs

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model of the router: its name in the API and its absolute path (a .gguf file or an HF folder)."""

    name: str
    path: str


def model_kind(path: str) -> str | None:
    """The kind of model at `path`: "gguf" (a .gguf file), "hf" (a folder with config.json), else None."""
    if os.path.isfile(path) and path.endswith(GGUF_SUFFIX):
        return "gguf"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    return None


def model_name(path: str) -> str:
    """The API name of the model at `path`: the file's name without .gguf, or the folder's name."""
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(GGUF_SUFFIX)] if base.endswith(GGUF_SUFFIX) else base


def scan_dir(models_dir: str) -> list[str]:
    """The model paths directly inside `models_dir` (see the module docstring), sorted."""
    folder = os.path.abspath(os.path.expanduser(models_dir))
    if not os.path.isdir(folder):
        raise ValueError(f"--models-dir {models_dir!r} is not a folder")
    found = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if not entry.startswith(".") and model_kind(path) is not None:
            found.append(path)
    return found


def discover(models_dir: str | None = None, paths: Iterable[str] = ()) -> list[ModelSpec]:
    """The models of `--models-dir` and `--models`, by name (ValueError: a path that is no model, a name twice, or
    no model at all)."""
    candidates = scan_dir(models_dir) if models_dir else []
    for given in paths:
        path = os.path.abspath(os.path.expanduser(given))
        if model_kind(path) is None:
            raise ValueError(f"--models: {given!r} is neither a .gguf file nor a folder with config.json")
        candidates.append(path)
    by_name: dict[str, str] = {}
    for path in candidates:
        name = model_name(path)
        if name in by_name:
            raise ValueError(
                f"two models are named {name!r}: {by_name[name]} and {path} (a model is named by its file or folder; "
                "rename one)"
            )
        by_name[name] = path
    if not by_name:
        where = f"in --models-dir {models_dir!r}" if models_dir else "given"
        raise ValueError(f"no model {where}: the router serves .gguf files and folders with config.json")
    return [ModelSpec(name, by_name[name]) for name in sorted(by_name)]


def model_engine_args(base: EngineArgs, spec: ModelSpec) -> EngineArgs:
    """The engine arguments of one model (see the module docstring). Reads the model's config when --max-model-len
    is given (to cap it), so it runs off the event loop, with the engine's start."""
    args = dataclasses.replace(base, model=spec.path, served_model_name=spec.name)
    if base.max_model_len is None:
        return args
    limit = dataclasses.replace(args, max_model_len=None).create_model_config().max_model_len
    return dataclasses.replace(args, max_model_len=min(base.max_model_len, limit))
