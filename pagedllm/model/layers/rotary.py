"""Rotary position embedding (HF "rotate half" layout), with the default, linear, llama3, yarn, longrope and dynamic
(NTK) scalings.

The cos/sin table is computed once for every position the engine can reach (the model's max_position_embeddings, or
the engine's max_model_len where that is longer: dynamic NTK), in float32, and indexed by each token's position, so a
batch can hold tokens of any positions (chunks, decodes) in any order. A key is rotated once, when it enters the paged
KV cache, so a table is fixed for the engine's life: the two scalings that transformers re-evaluates from the current
sequence length are evaluated once, at the engine's max_model_len, instead:
  - longrope (Phi-3/3.5/4-mini): transformers divides the frequencies by `long_factor` while the sequence is longer
    than original_max_position_embeddings and by `short_factor` otherwise (switching mid-generation, with the keys
    already cached rotated the other way). As vLLM's Phi3LongRoPEScaledRotaryEmbedding, the factors are chosen once:
    long where max_model_len > original_max_position_embeddings, short otherwise. Both scale cos and sin by the
    attention factor (the config's, else sqrt(1 + ln(factor) / ln(original)) with factor = the config's, else
    max_position_embeddings / original). Identical to transformers wherever both pick the same factors: every
    sequence when max_model_len <= original, sequences longer than the original context otherwise.
  - dynamic (dynamic NTK): transformers raises the base for sequences longer than max_position_embeddings, by its
    current length. Here its rule is evaluated at max_model_len: at or below max_position_embeddings the frequencies
    are the unscaled ones, identical to transformers at every length; beyond it, the base for max_model_len
    (base * (factor * max_model_len / max_position - (factor - 1)) ** (dim / (dim - 2))) for every position, fixed as
    vLLM's DynamicNTKScalingRotaryEmbedding fixes its table (whose base, evaluated at max_position * factor, reduces
    to the unscaled one).
Without a max_model_len (a model built outside the engine) both take max_position_embeddings, vLLM's default.
An unknown scaling type is a ValueError naming it.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn


def _yarn_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], base: float, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5/Qwen3 long context, DeepSeek) as transformers' `_compute_yarn_parameters` computes it: each
    frequency blended between itself (extrapolation, fast rotations) and itself / factor (interpolation, slow ones)
    by a linear ramp over the dimensions whose rotations over the original context fall between beta_slow and
    beta_fast; cos and sin scaled by the attention factor (0.1 ln(factor) + 1 unless the config gives it or
    mscale / mscale_all_dim)."""
    dim = 2 * inv_freq.numel()
    original = float(params.get("original_max_position_embeddings") or max_position)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    blended = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return blended, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], max_position: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE as transformers' `_compute_longrope_parameters` computes it, its long or short factors chosen once by
    max_model_len (see the module docstring)."""
    original = int(params["original_max_position_embeddings"])
    long = max_model_len > original
    factors = params["long_factor" if long else "short_factor"]
    if len(factors) != inv_freq.numel():
        kind = "long_factor" if long else "short_factor"
        raise ValueError(f"longrope {kind} has {len(factors)} entries for {inv_freq.numel()} rotary frequencies")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / torch.tensor(factors, dtype=torch.float64), float(attention_factor)


def _dynamic_ntk_base(base: float, dim: int, params: dict[str, Any], max_position: int, max_model_len: int) -> float:
    """transformers' `_compute_dynamic_ntk_parameters` base at sequence length max_model_len (max_position_embeddings
    is the original context there; shorter lengths keep the base)."""
    factor = float(params["factor"])
    seq_len = max(max_model_len, max_position)
    return base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))


def rope_inv_freq(
    rotary_dim: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    max_position: int,
    max_model_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in float64, the factor cos and sin are scaled by) of a scaling dict as
    transformers writes it (`rope_type` or `type`), for an engine serving up to `max_model_len` tokens (None:
    max_position)."""
    params = rope_scaling or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    served = max_model_len or max_position
    if rope_type == "dynamic":
        base = _dynamic_ntk_base(base, rotary_dim, params, max_position, served)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    attention_factor = 1.0
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(inv_freq, params, base, max_position)
    elif rope_type == "longrope":
        inv_freq, attention_factor = _longrope_inv_freq(inv_freq, params, max_position, served)
    elif rope_type not in ("default", "dynamic"):
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3, yarn, longrope, dynamic)"
        )
    return inv_freq, attention_factor


# The tables computed while a model is built, by what they are computed from: its layers (18 of Gemma 3's, with a 32k
# context: 64 MiB and ~0.1 s a table) share one table instead of each computing its own. Forgotten once the model is
# built (`forget_tables`): two models never share one (sleep mode pages a model's tensors out, the table with them).
_TABLES: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = weakref.WeakValueDictionary()


def forget_tables() -> None:
    """End the sharing of rotary tables: those computed from now on are a new model's."""
    _TABLES.clear()


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
        ops: Any = None,
        max_model_len: int | None = None,
    ) -> None:
        """`max_position`: the model's max_position_embeddings; `max_model_len`: the engine's (None: the same),
        which fixes the longrope and dynamic scalings and, where longer, the table's length."""
        super().__init__()
        self.ops = ops  # the native CPU ops (rotate_heads_ in place), or None
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        scaling_key = json.dumps(rope_scaling, sort_keys=True, default=repr)  # numpy values by their exact repr
        key = (self.rotary_dim, float(base), scaling_key, max_position, max_model_len)
        cache = _TABLES.get(key)
        if cache is None:
            inv_freq, attention_factor = rope_inv_freq(self.rotary_dim, base, rope_scaling, max_position, max_model_len)
            t = torch.arange(max(max_position, max_model_len or 0), dtype=torch.float64)
            freqs = torch.outer(t, inv_freq)
            # [positions, rotary_dim]: cos | sin halves (YaRN and LongRoPE scale both by their attention factor),
            # kept in float32.
            cache = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).float()
            _TABLES[key] = cache
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies (same shapes and dtype)."""
        qk = self.rotate(positions, torch.cat([q, k], dim=1))
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]

    def rotate_heads_(self, positions: torch.Tensor, x: torch.Tensor, heads: int) -> bool:
        """Rotate the first `heads` heads of x [T, H, D] in place with the native kernel; False (x untouched)
        where that kernel does not apply, and the caller uses `rotate`."""
        ops = self.ops
        if ops is None or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 3:
            return False
        ops.rotary_inplace(x, positions, self.cos_sin_cache, heads)
        return True

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (any heads, e.g. queries and keys side by side) -> rotated copy."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim/2] each
        rot = x[..., : self.rotary_dim]
        if rot.dtype != torch.float32:
            rot = rot.float()
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.rotary_dim < self.head_dim:
            out = torch.cat([out, x[..., self.rotary_dim :]], dim=-1)
        return out
