"""Rotary position embedding (rotate-half / NeoX layout) for the shared GQLA rope key and query rope part."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_inv_freq"]


def rope_inv_freq(d: int, theta: float = 10000.0, *, device=None) -> torch.Tensor:
    """The standard inverse frequencies ``theta^(-2i/d)``, ``i < d/2``, float64 ``[d/2]``."""
    return theta ** (-torch.arange(0, d // 2, dtype=torch.float64, device=device) * 2.0 / d)


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
        inv = rope_inv_freq(d, theta, device=x.device)
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
