"""--generation-config: the default sampling values a model's creator recommends (vLLM's `get_diff_sampling_param`).

Contract: `sampling_defaults(source, model_dir)` returns the values of a `generation_config.json` that a request
leaving them unset takes, as SamplingParams keyword arguments: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` as `max_tokens`. As vLLM (`GenerationConfig.to_diff_dict()`), a value
equal to transformers' own default (temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0) is no
recommendation and is left out, and so is a null. `source`:
* "auto": the `generation_config.json` of `model_dir` (an HF model's folder; for a GGUF file, the folder it sits in,
  where one downloaded beside it from the original model is read); where there is none, a GGUF file's own
  `general.sampling.*` metadata (`gguf_sampling`: what llama.cpp's converter copies from the original model's
  generation_config.json, and llama.cpp applies as its defaults): temp, top_k, top_p, min_p, and penalty_repeat
  as repetition_penalty, under the same rules; none if neither;
* "vllm": none (SamplingParams' own defaults, as `vllm serve --generation-config vllm`);
* a folder: its `generation_config.json`, which must exist (ValueError otherwise).
A file that is not a JSON object, or a value of the wrong type, is a ValueError naming the file.
`generation_eos_ids(source, model_dir)`: the `eos_token_id` (one or a list) of that file, which vLLM adds to every
request's stop tokens (Llama 3's <|eom_id|>, Phi-3's <|end|>, Gemma's <end_of_turn>).
Reads one small JSON file; imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.config import json_object

GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' GenerationConfig defaults of the keys read here: equal values are not the model creator's choice.
HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# generation_config.json key -> SamplingParams field, and the type it must have.
SAMPLING_KEYS: dict[str, tuple[str, type]] = {
    "repetition_penalty": ("repetition_penalty", float),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "max_new_tokens": ("max_tokens", int),
}


def generation_config_path(source: str, model_dir: str) -> str | None:
    """The generation_config.json that `source` names for a model whose files are in `model_dir` (None: none)."""
    if source == "vllm":
        return None
    if source == "auto":
        path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
        return path if os.path.isfile(path) else None
    folder = os.path.expanduser(source)
    if not os.path.isdir(folder):
        raise ValueError(
            f"generation_config must be auto, vllm or a folder holding {GENERATION_CONFIG_FILE}, got {source!r}"
        )
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"generation_config {source!r}: the folder has no {GENERATION_CONFIG_FILE}")
    return path


# a GGUF file's sampling metadata -> the generation_config.json key it stands for
GGUF_SAMPLING_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(
    source: str, model_dir: str, gguf_sampling: dict[str, Any] | None = None, gguf_path: str | None = None
) -> tuple[dict[str, Any], str | None]:
    """(SamplingParams defaults, the file they came from) for `--generation-config source` (module docstring).
    `gguf_sampling`: the `general.sampling.*` metadata of the GGUF file `gguf_path` when the model is one."""
    path = generation_config_path(source, model_dir)
    if path is None:
        if source != "auto" or not gguf_sampling:
            return {}, None
        where = f"the sampling metadata of {gguf_path}"
        config = {GGUF_SAMPLING_KEYS[k]: _gguf_value(v) for k, v in gguf_sampling.items() if k in GGUF_SAMPLING_KEYS}
        if config.get("top_k") is not None and config["top_k"] <= 0:  # llama.cpp's "off"
            del config["top_k"]
        out = _read_values(config, where)
        return out, (where if out else None)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation config {path}: cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation config {path}: expected a JSON object, got {type(config).__name__}")
    return _read_values(config, path), path


def generation_eos_ids(source: str, model_dir: str) -> tuple[int, ...]:
    """The end-of-sequence token ids of `--generation-config source`'s generation_config.json (none: ())."""
    path = generation_config_path(source, model_dir)
    if path is None:
        return ()
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()  # sampling_defaults reports an unreadable file
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def _gguf_value(value: Any) -> Any:
    """A GGUF metadata number as the JSON value it was converted from: float32 0.699999988 is 0.7."""
    if isinstance(value, float):
        return float(f"{value:.7g}")
    return value


def generation_overrides(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """--override-generation-config as SamplingParams defaults: a JSON object (its text, or a dict) of
    generation_config.json keys, laid over --generation-config's values (vLLM's). Every value given counts, even one
    equal to transformers' default: the operator chose it. An unknown key or a bad value is a ValueError."""
    value = json_object(value, "override_generation_config")
    unknown = sorted(k for k in value if k not in SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"override_generation_config: unknown key {unknown[0]!r} (known: {', '.join(SAMPLING_KEYS)})")
    return _read_values(value, "--override-generation-config", keep_hf_defaults=True)


def _read_values(config: dict[str, Any], path: str, keep_hf_defaults: bool = False) -> dict[str, Any]:
    """The SamplingParams values of a generation config's keys (`path` names its source in errors); a value equal
    to transformers' default is left out unless `keep_hf_defaults`."""
    out: dict[str, Any] = {}
    for key, (name, kind) in SAMPLING_KEYS.items():
        value = config.get(key)
        if value is None or (value == HF_DEFAULTS.get(key) and not keep_hf_defaults):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"generation config {path}: {key} must be {what}, got {value!r}")
        out[name] = kind(value)
    return out
