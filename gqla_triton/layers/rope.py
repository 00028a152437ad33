"""Rotary position embedding (rotate-half / NeoX layout) for the shared GQLA rope key and query rope part."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "cached_inv_freq", "rope_cos_sin", "rope_inv_freq"]

_INV_FREQ: dict[tuple[int, float, torch.device], torch.Tensor] = {}  # (d, theta, device) -> float64 [d/2]


def rope_inv_freq(d: int, theta: float = 10000.0, *, device=None) -> torch.Tensor:
    """The standard inverse frequencies ``theta^(-2i/d)``, ``i < d/2``, float64 ``[d/2]``."""
    return theta ** (-torch.arange(0, d // 2, dtype=torch.float64, device=device) * 2.0 / d)


def _cacheable(device: torch.device) -> bool:
    """A tensor made here may be kept for later calls: not while torch.compile traces (the tensor is a trace
    value) nor inside a CUDA-graph capture (its values would appear only at replay)."""
    if torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def cached_inv_freq(d: int, theta: float, device) -> torch.Tensor:
    """``rope_inv_freq(d, theta)`` on ``device``, made once per ``(d, theta, device)`` and kept (outside
    torch.compile traces and CUDA-graph captures, which make it fresh). Do not write to it."""
    device = torch.device(device)
    key = (d, float(theta), device)
    hit = _INV_FREQ.get(key)
    if hit is None:
        hit = rope_inv_freq(d, theta, device=device)
        if _cacheable(device):
            _INV_FREQ[key] = hit
    return hit


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[B, T, 2, d/2]`` float32 ``[cos | sin]`` of the float64 angles ``positions [B, T] · inv_freq [d/2]``: the
    factors ``apply_rope`` applies to float32 / half inputs (and ``gqla_step.norm_rope`` writes)."""
    ang = positions.to(device=inv_freq.device, dtype=torch.float64)[..., None] * inv_freq.to(torch.float64)
    return torch.stack([ang.cos(), ang.sin()], -2).to(torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, *,
               inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [B, T, ..., d]`` (d even) by the angles of ``positions [B, T]``.

    Pair ``(i, i + d/2)`` turns by ``pos · theta^(-2i/d)``, or by ``pos · inv_freq[i]`` when ``inv_freq [d/2]``
    is given (any frequencies, e.g. a converted model's). Angles are computed in float64 (so every path sees the
    same angles) and applied in ``x``'s dtype promoted to at least float32; the result has ``x``'s dtype.
    """
    d = x.shape[-1]
    if d == 0:
        return x
    if d % 2:
        raise ValueError(f"rope_dim: expected an even size, got {d}")
    if inv_freq is None:
        inv = cached_inv_freq(d, theta, x.device)
    else:
        if inv_freq.shape != (d // 2,):
            raise ValueError(f"inv_freq: expected shape [{d // 2}], got {list(inv_freq.shape)}")
        inv = inv_freq.to(device=x.device, dtype=torch.float64)
    ang = positions.to(device=x.device, dtype=torch.float64)[..., None] * inv  # [B, T, d/2]
    cdt = torch.promote_types(x.dtype, torch.float32)
    cos, sin = ang.cos().to(cdt), ang.sin().to(cdt)
    for _ in range(x.dim() - ang.dim()):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., : d // 2].to(cdt), x[..., d // 2:].to(cdt)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
