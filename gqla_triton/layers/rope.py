"""Rotary position embedding (rotate-half / NeoX layout) for the shared GQLA rope key and query rope part."""

from __future__ import annotations

import torch

from ..ops._common.validation import (
    INT32_MAX,
    check_dense,
    check_device,
    check_int_type,
    check_positive_real,
    check_same_device,
    check_tensor,
)

__all__ = ["apply_rope", "cached_inv_freq", "rope_cos_sin", "rope_inv_freq"]

_INV_FREQ: dict[tuple[int, float, torch.device], torch.Tensor] = {}  # (d, theta, device) -> float64 [d/2]
INV_FREQ_CACHE = 64  # kept (d, theta, device) entries beside the pinned ones; the others are dropped when full
_PINNED: set[tuple[int, float, torch.device]] = set()  # entries a CUDA-graph capture read: never dropped


def check_rope_dim(name: str, d: object) -> int:
    """A rope width: an even int in ``[0, INT32_MAX]`` (bools and non-integers: ``TypeError``)."""
    check_int_type(name, d, "an even int >= 0")
    if not 0 <= d <= INT32_MAX or d % 2:
        raise ValueError(f"{name}: expected an even int >= 0, got {type(d).__name__} {d!r}")
    return int(d)


def check_positions(positions: object, shape: tuple[int | None, ...]) -> torch.Tensor:
    """``positions``: an integer tensor of exactly ``shape`` (``None``: any size), not uint64 (values past 2**63
    have no int64 form, the type the kernels read)."""
    check_tensor("positions", positions)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions: expected an integer tensor, got {positions.dtype}")
    if positions.dtype == torch.uint64:
        raise TypeError("positions: expected a signed integer tensor or one of at most 32 bits, got torch.uint64")
    if positions.dim() != len(shape):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise ValueError(f"positions: expected shape [{want}] ([B, T]), got {list(positions.shape)}")
    return check_tensor("positions", positions, shape=shape)


def _check_inv_freq(inv_freq: object, half: int | None, device: torch.device) -> torch.Tensor:
    check_tensor("inv_freq", inv_freq, shape=(half,), device=device)
    if not inv_freq.is_floating_point():
        raise TypeError(f"inv_freq: expected a real floating tensor, got {inv_freq.dtype}")
    return inv_freq


def check_rope_inv_freq(inv_freq: object, half: int, what: str = "") -> torch.Tensor:
    """A ``rope_inv_freq`` argument: a real floating tensor ``[half]`` (``what``: how the message names ``half``)
    with finite values (not on meta); a float64 copy of it on the CPU."""
    check_dense("rope_inv_freq", inv_freq)
    if inv_freq.shape != (half,):
        raise ValueError(f"rope_inv_freq: expected a tensor of shape [{half}]{what}, got {list(inv_freq.shape)!r}")
    if not inv_freq.is_floating_point():
        raise TypeError(f"rope_inv_freq: expected a real floating tensor, got {inv_freq.dtype}")
    if inv_freq.device.type == "meta":
        raise ValueError("rope_inv_freq: expected a tensor with values, got one on meta")
    inv = inv_freq.detach().to("cpu", torch.float64, copy=True)
    if not torch.isfinite(inv).all():
        raise ValueError("rope_inv_freq: expected finite values")
    return inv


def rope_inv_freq(d: int, theta: float = 10000.0, *, device=None) -> torch.Tensor:
    """The standard inverse frequencies ``theta^(-2i/d)``, ``i < d/2``, float64 ``[d/2]`` (``d`` even, ``theta``
    positive and finite)."""
    d = check_rope_dim("d", d)
    theta = check_positive_real("theta", theta)
    device = check_device(device)
    return theta ** (-torch.arange(0, d // 2, dtype=torch.float64, device=device) * 2.0 / d)


def _cacheable(device: torch.device) -> bool:
    """A tensor made here may be kept for later calls: not while torch.compile traces (the tensor is a trace
    value) nor inside a CUDA-graph capture (its values would appear only at replay)."""
    if torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def cached_inv_freq(d: int, theta: float, device) -> torch.Tensor:
    """``rope_inv_freq(d, theta)`` on ``device`` (``"cuda"``: the current GPU), made once per ``(d, theta,
    device)`` and kept (outside torch.compile traces and CUDA-graph captures, which make it fresh;
    ``INV_FREQ_CACHE`` entries, beside those that a CUDA-graph capture read, which stay for its replays). Do not
    write to it."""
    d = check_rope_dim("d", d)
    theta = check_positive_real("theta", theta)
    device = check_device(device)
    if device is None:
        raise ValueError("device: expected a torch.device, a device string or a CUDA index, got None")
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: one key per GPU
        device = torch.device("cuda", torch.cuda.current_device())
    key = (d, theta, device)
    hit = _INV_FREQ.get(key)
    if hit is None:
        hit = rope_inv_freq(d, theta, device=device)
        if _cacheable(device):
            if len(_INV_FREQ) >= INV_FREQ_CACHE + len(_PINNED):
                for k in list(_INV_FREQ):
                    if k not in _PINNED:
                        _INV_FREQ.pop(k, None)
            _INV_FREQ[key] = hit
    elif not torch.compiler.is_compiling() and not _cacheable(device):
        _PINNED.add(key)  # a captured graph reads this tensor at every replay
    return hit


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[B, T, 2, d/2]`` float32 ``[cos | sin]`` of the float64 angles ``positions [B, T] · inv_freq [d/2]``: the
    factors ``apply_rope`` applies to float32 / half inputs (and ``gqla_step.norm_rope`` writes). ``positions``:
    an integer tensor (not uint64); ``inv_freq``: a real floating tensor on its device."""
    check_positions(positions, (None, None))
    _check_inv_freq(inv_freq, None, positions.device)
    ang = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return torch.stack([ang.cos(), ang.sin()], -2).to(torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, *,
               inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [B, T, ..., d]`` (a real floating tensor, d even) by the angles of ``positions [B, T]`` (an
    integer tensor, not uint64, of exactly that shape, on ``x``'s device: a ``[T]`` vector is refused, not
    broadcast).

    Pair ``(i, i + d/2)`` turns by ``pos · theta^(-2i/d)`` (``theta`` positive, finite), or by ``pos · inv_freq[i]``
    when ``inv_freq [d/2]`` (real floating, on ``x``'s device) is given (any frequencies, e.g. a converted
    model's). Angles are computed in float64 (so every path sees the same angles) and applied in ``x``'s dtype
    promoted to at least float32; the result has ``x``'s dtype.
    """
    check_tensor("x", x)
    if x.dim() < 3:
        raise ValueError(f"x: expected shape [B, T, ..., d] (at least 3 dimensions), got {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a real floating tensor, got {x.dtype}")
    B, T, d = x.shape[0], x.shape[1], x.shape[-1]
    check_positions(positions, (B, T))
    theta = check_positive_real("theta", theta)
    check_same_device(x=x, positions=positions)
    if d % 2:
        raise ValueError(f"x: the rope width (last dimension) must be even, got {d}")
    if inv_freq is not None:
        _check_inv_freq(inv_freq, d // 2, x.device)
    if d == 0:
        return x
    inv = cached_inv_freq(d, theta, x.device) if inv_freq is None else inv_freq.to(torch.float64)
    ang = positions.to(torch.float64)[..., None] * inv  # [B, T, d/2]
    cdt = torch.promote_types(x.dtype, torch.float32)
    cos, sin = ang.cos().to(cdt), ang.sin().to(cdt)
    for _ in range(x.dim() - ang.dim()):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., : d // 2].to(cdt), x[..., d // 2:].to(cdt)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
