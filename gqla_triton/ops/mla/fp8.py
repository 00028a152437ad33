"""FlashMLA's FP8 latent-cache layout: one 656-byte row per token.

    bytes [0, 512)    the 512 latent values, float8_e4m3fn, each 128-value tile divided by its scale
    bytes [512, 528)  4 float32 scales, one per 128 latent values (value = fp8 · scale)
    bytes [528, 656)  the 64 rope values, bfloat16 (not quantised)

A cache in this layout is ``[num_pages, page_size, 1, 656]`` of dtype ``float8_e4m3fn`` (FlashMLA's) or ``uint8``
(the same bytes). ``quantize_latent_fp8`` writes it, ``dequantize_latent_fp8`` reads it back exactly (what the
kernels and the float64 reference compute from); ``is_fp8_latent`` tells a cache in this layout by its dtype.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_ROW_BYTES", "FP8_LATENT", "FP8_ROPE", "FP8_TILE", "quantize_latent_fp8", "dequantize_latent_fp8",
           "is_fp8_latent"]

FP8_LATENT = 512  # latent values per token
FP8_ROPE = 64  # rope values per token (bf16)
FP8_TILE = 128  # latent values per scale
FP8_SCALES = FP8_LATENT // FP8_TILE
FP8_SCALE_OFF = FP8_LATENT  # byte offset of the scales
FP8_ROPE_OFF = FP8_LATENT + 4 * FP8_SCALES  # byte offset of the rope values (528)
FP8_ROW_BYTES = FP8_ROPE_OFF + 2 * FP8_ROPE  # 656
_E4M3_MAX = 448.0
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def is_fp8_latent(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache``'s dtype is one of the FP8 layout's (``float8_e4m3fn`` or ``uint8``)."""
    return kv_cache.dtype in FP8_DTYPES


def quantize_latent_fp8(kv: torch.Tensor, *, pow2_scales: bool = False) -> torch.Tensor:
    """``kv [..., 576]`` (latent 512, then rope 64; any float dtype) -> ``[..., 656]`` float8_e4m3fn rows.

    Each 128-value latent tile gets the scale ``amax / 448`` (``pow2_scales``: rounded up to a power of two, as
    DeepSeek's UE8M0 scales are), so its largest value maps to e4m3's largest finite value; an all-zero tile gets
    scale 0 and zeros. The rope values are stored in bf16. NaN / inf in a tile make its scale NaN / inf, so its
    dequantised values are non-finite (they reach every query that sees the token, as in the bf16 cache)."""
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point() or is_fp8_latent(kv):
        got = kv.dtype if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise TypeError(f"kv: expected a floating tensor of latent + rope values, got {got}")
    if kv.dim() < 1 or kv.shape[-1] != FP8_LATENT + FP8_ROPE:
        raise ValueError(f"kv: expected a last dim of {FP8_LATENT + FP8_ROPE} (latent {FP8_LATENT} + rope "
                         f"{FP8_ROPE}), got shape {list(kv.shape)}")
    if not isinstance(pow2_scales, bool):
        raise TypeError(f"pow2_scales: expected a bool, got {pow2_scales!r}")
    lead = kv.shape[:-1]
    lat = kv[..., :FP8_LATENT].float().reshape(*lead, FP8_SCALES, FP8_TILE)
    amax = lat.abs().amax(-1)
    finite = torch.isfinite(lat).all(-1)
    scale = amax / _E4M3_MAX
    if pow2_scales:
        scale = torch.where(scale > 0, torch.exp2(torch.ceil(torch.log2(scale))), scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (lat / div[..., None]).clamp(-_E4M3_MAX, _E4M3_MAX)
    q8 = torch.where(finite[..., None], q8, lat)  # a non-finite tile keeps its NaN / inf (its scale is NaN)
    out = torch.empty(*lead, FP8_ROW_BYTES, dtype=torch.uint8, device=kv.device)
    out[..., :FP8_LATENT] = q8.reshape(*lead, FP8_LATENT).to(torch.float8_e4m3fn).view(torch.uint8)
    out[..., FP8_SCALE_OFF:FP8_ROPE_OFF] = scale.contiguous().view(torch.uint8).reshape(*lead, 4 * FP8_SCALES)
    rope = kv[..., FP8_LATENT:].to(torch.bfloat16).contiguous()
    out[..., FP8_ROPE_OFF:] = rope.view(torch.uint8).reshape(*lead, 2 * FP8_ROPE)
    return out.view(torch.float8_e4m3fn)


def dequantize_latent_fp8(kv_cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``kv_cache [..., 656]`` FP8 rows -> ``[..., 576]`` in ``dtype`` (a float dtype of 16 bits or more; fp8 · scale
    in float32, i.e. the exact product rounded once, as the kernels form it, or in float64 for ``dtype`` float64,
    where it is exact; the rope values as stored)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype: expected a floating torch.dtype of 16 bits or more, got {dtype!r}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"kv_cache: expected a float8_e4m3fn or uint8 tensor of FP8 rows, got "
                        f"{kv_cache.dtype if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")
    if kv_cache.dim() < 1 or kv_cache.shape[-1] != FP8_ROW_BYTES:
        raise ValueError(f"kv_cache: expected {FP8_ROW_BYTES}-byte rows, got shape {list(kv_cache.shape)}")
    b = kv_cache.contiguous().view(torch.uint8)
    lead = b.shape[:-1]
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lat = b[..., :FP8_LATENT].contiguous().view(torch.float8_e4m3fn).to(work)
    scale = b[..., FP8_SCALE_OFF:FP8_ROPE_OFF].contiguous().view(torch.float32).to(work)
    lat = (lat.reshape(*lead, FP8_SCALES, FP8_TILE) * scale[..., None]).reshape(*lead, FP8_LATENT)
    rope = b[..., FP8_ROPE_OFF:].contiguous().view(torch.bfloat16).to(work)
    return torch.cat([lat, rope], -1).to(dtype)
