"""PoolingParams and PoolerConfig: what a pooling request asks for, and how the served model pools by default.

Contract. A pooling request carries a `PoolingParams` instead of sampling settings: its `task` ("embed", "classify",
"score" or "encode": per-token states), `normalize` and `dimensions` (embed, encode), `use_activation` (classify,
score; vLLM's older `softmax`/`activation` are accepted as aliases), `truncate_prompt_tokens`, and for a
cross-encoder's pair the position where the second text's token type starts (`token_type_split`); set by the server,
the prompt tokens of the API call the request is part of (`call_tokens`: short calls take the express lane). Field
names and errors follow vLLM's `PoolingParams`; it is a msgspec Struct so that it crosses the engine-core boundary as
msgpack.
`verify(task, pooler)` fills what the request left unset from the model's `PoolerConfig` and raises `ValueError`
naming a parameter the task does not take.

`PoolerConfig` is the served model's pooling: type (MEAN, CLS, LAST, ALL), normalize, activation, and the Matryoshka
dimensions the model allows. `pooler_config_for(folder, ...)` reads sentence-transformers' `modules.json` and its
Pooling module's `config.json` (`--pooler-config` overrides any field). This module imports neither torch nor any
other pagedllm module: the front end and the CLI use it before torch loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

import msgspec

POOLING_TYPES = ("MEAN", "CLS", "LAST", "ALL")
POOLING_TASKS = ("embed", "classify", "score", "encode")
# What each task may set (vLLM's valid_parameters).
_TASK_PARAMS = {
    "embed": ("dimensions", "normalize"),
    "encode": ("dimensions", "normalize"),
    "classify": ("use_activation",),
    "score": ("use_activation",),
}
# sentence-transformers' Pooling modes (1_Pooling/config.json keys) -> ours; the others are refused.
_ST_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A pooling request's settings (vLLM's names). Unset (None) fields take the model's defaults in `verify`."""

    task: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    softmax: bool | None = None  # older vLLM name of use_activation
    activation: bool | None = None  # older vLLM name of use_activation
    truncate_prompt_tokens: int | None = None
    # A cross-encoder's pair: tokens from this position on have token type 1 (None: all type 0).
    token_type_split: int | None = None
    # Set by the server: the prompt tokens of the whole API call this request is one input of. The engine core's
    # express lane runs the requests of short calls between two layers of an encoder's step (config.express_tokens).
    call_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        for name in ("normalize", "use_activation", "softmax", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"Dimensions must be greater than 0, got dimensions={self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < -1 or t == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}")

    def clone(self, **changes: Any) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)

    def _activation_setting(self) -> bool | None:
        for value in (self.softmax, self.activation, self.use_activation):
            if value is not None:
                return value
        return None

    def verify(self, task: str, pooler: PoolerConfig, model_name: str = "model") -> PoolingParams:
        """These parameters for `task`, unset fields filled from the model's `pooler`; ValueError for a parameter the
        task does not take, another task already set, or dimensions the model does not allow."""
        if task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {task!r}")
        if self.task is not None and self.task != task:
            raise ValueError(f"You cannot overwrite self.task={self.task!r} with task={task!r}")
        given = {
            "dimensions": self.dimensions,
            "normalize": self.normalize,
            "use_activation": self._activation_setting(),
        }
        invalid = [name for name, value in given.items() if value is not None and name not in _TASK_PARAMS[task]]
        if invalid:
            raise ValueError(
                f"Task {task} only supports {list(_TASK_PARAMS[task])} parameters, does not support {invalid} "
                "parameters"
            )
        if self.dimensions is not None:
            allowed = pooler.matryoshka_dimensions
            if allowed is None:
                raise ValueError(
                    f'Model "{model_name}" does not support matryoshka representation, changing output dimensions '
                    "will lead to poor results."
                )
            if allowed and self.dimensions not in allowed:
                raise ValueError(f'Model "{model_name}" only supports {allowed} matryoshka dimensions, got '
                                 f"dimensions={self.dimensions}")  # fmt: skip
        normalize = self.normalize
        use_activation = given["use_activation"]
        if task in ("embed", "encode") and normalize is None:
            normalize = pooler.normalize
        if task in ("classify", "score") and use_activation is None:
            use_activation = pooler.use_activation
        return msgspec.structs.replace(
            self, task=task, normalize=normalize, use_activation=use_activation, softmax=None, activation=None
        )


@dataclass(frozen=True)
class PoolerConfig:
    """How the served model pools. `matryoshka_dimensions`: None when the model does not allow `dimensions`; an
    empty tuple when any number up to the hidden size is allowed; else the allowed numbers."""

    pooling_type: str = "LAST"
    normalize: bool = True
    use_activation: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"  # where the pooling type came from, for the start-up log

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


def parse_pooler_override(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """--pooler-config's JSON (vLLM's keys: pooling_type, normalize, softmax, activation, use_activation, dimensions
    are not a model setting) -> the PoolerConfig fields it sets; ValueError naming a bad key or value."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pooler-config must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--pooler-config must be a JSON object, got {value!r}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key == "pooling_type":
            kind = str(item).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(
                    f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, got {item!r}"
                )
            out["pooling_type"] = kind
        elif key in ("normalize", "softmax", "activation", "use_activation"):
            if not isinstance(item, bool):
                raise ValueError(f"--pooler-config {key} must be true or false, got {item!r}")
            out["normalize" if key == "normalize" else "use_activation"] = item
        else:
            keys = "pooling_type, normalize, softmax, activation, use_activation"
            raise ValueError(f"--pooler-config has an unknown key {key!r} (known: {keys})")
    return out


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sentence_transformers_pooling(folder: str) -> dict[str, Any]:
    """The PoolerConfig fields a sentence-transformers folder sets (its modules.json, its Pooling module's config and
    whether a Normalize module follows), {} when it has none; ValueError for a pooling mode pagedllm does not run."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    modules = _read_json(modules_path)
    out: dict[str, Any] = {
        "normalize": any(m.get("type", "").endswith("models.Normalize") for m in modules),
        "source": "sentence-transformers modules.json",
    }
    pooling = next((m for m in modules if m.get("type", "").endswith("models.Pooling")), None)
    if pooling is None:
        return out
    config_path = os.path.join(folder, pooling.get("path", ""), "config.json")
    if not os.path.isfile(config_path):
        return out
    config = _read_json(config_path)
    unsupported = [k.removeprefix("pooling_mode_") for k in _ST_UNSUPPORTED if config.get(k)]
    if unsupported:
        raise ValueError(
            f"{config_path}: pooling mode {', '.join(unsupported)} is not supported (mean, cls and lasttoken are); "
            'override it with --pooler-config \'{"pooling_type": "MEAN"}\''
        )
    modes = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    if len(modes) > 1:
        raise ValueError(f"{config_path}: several pooling modes at once ({', '.join(modes)}) are not supported")
    if modes:
        out["pooling_type"] = modes[0]
    return out


def pooler_config_for(
    folder: str | None, default_type: str, override: str | dict[str, Any] | None = None, hf_config: Any = None
) -> PoolerConfig:
    """The served model's PoolerConfig: `default_type` (the architecture's: CLS for BERT-style classifiers, LAST
    for decoders), then what a sentence-transformers folder says, then --pooler-config's fields. Matryoshka
    dimensions come from the HF config's `matryoshka_dimensions` / `is_matryoshka` (vLLM's keys)."""
    config = PoolerConfig(pooling_type=default_type)
    if folder is not None and os.path.isdir(folder):
        config = replace(config, **sentence_transformers_pooling(folder))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        config = replace(config, matryoshka_dimensions=tuple(int(d) for d in dims))
    elif getattr(hf_config, "is_matryoshka", False):
        config = replace(config, matryoshka_dimensions=())
    fields = parse_pooler_override(override)
    if fields:
        config = replace(config, **fields, source="--pooler-config")
    return config
