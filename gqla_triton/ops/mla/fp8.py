"""FlashMLA's FP8 latent-cache layouts.

DeepSeek V3.2 (``"v32"``): one 656-byte row per token, latent 512 + rope 64.

    bytes [0, 512)    the 512 latent values, float8_e4m3fn, each 128-value tile divided by its scale
    bytes [512, 528)  4 float32 scales, one per 128 latent values (value = fp8 · scale)
    bytes [528, 656)  the 64 rope values, bfloat16 (not quantised)

A cache in this layout is ``[num_pages, page_size, 1, 656]`` of dtype ``float8_e4m3fn`` (FlashMLA's) or ``uint8``
(the same bytes).

FlashMLA's MODEL1 layout (``"model1"``): 512 channels per token (448 quantised, then 64 rope values in bf16), the
value of a token being all 512 (``head_dim_v`` 512), stored per page rather than per token:

    bytes [0, page_size · 576)                     per token: 448 float8_e4m3fn values, then 64 bf16 rope values
    bytes [page_size · 576, page_size · 584)       per token: 7 UE8M0 scales (one per 64 values, value =
                                                   fp8 · 2^(e - 127), e = 255 is NaN) and one byte of padding

A cache in this layout is ``[num_pages, page_size, 1, 584]`` (float8_e4m3fn or uint8) whose elements are the first
``page_size · 584`` bytes of each page in order (strides ``(page stride, 584, 584, 1)``; FlashMLA pads each page to a
multiple of 576 bytes). FlashMLA reads it in sparse decoding only, and so do the kernels here.

``quantize_latent_fp8`` writes either layout, ``dequantize_latent_fp8`` reads it back exactly (what the kernels and
the float64 reference compute from); ``is_fp8_latent`` tells an FP8 cache by its dtype, ``fp8_layout`` its layout
by its row width.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_ROW_BYTES", "FP8_LATENT", "FP8_ROPE", "FP8_TILE", "M1_ROW_BYTES", "M1_TOKEN_BYTES", "M1_NOPE",
           "dequantize_latent_fp8", "fp8_layout", "is_fp8_latent", "quantize_latent_fp8"]

FP8_LATENT = 512  # latent values per token
FP8_ROPE = 64  # rope values per token (bf16)
FP8_TILE = 128  # latent values per scale
FP8_SCALES = FP8_LATENT // FP8_TILE
FP8_SCALE_OFF = FP8_LATENT  # byte offset of the scales
FP8_ROPE_OFF = FP8_LATENT + 4 * FP8_SCALES  # byte offset of the rope values (528)
FP8_ROW_BYTES = FP8_ROPE_OFF + 2 * FP8_ROPE  # 656
_E4M3_MAX = 448.0
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)

M1_NOPE = 448  # quantised values per token (MODEL1)
M1_ROPE = 64  # rope values per token (bf16)
M1_TILE = 64  # values per UE8M0 scale
M1_SCALES = M1_NOPE // M1_TILE  # 7, stored in 8 bytes per token
M1_TOKEN_BYTES = M1_NOPE + 2 * M1_ROPE  # 576: a token's values in the page's first region
M1_ROW_BYTES = M1_TOKEN_BYTES + M1_SCALES + 1  # 584: a token's share of its page
LAYOUTS = {"v32": FP8_ROW_BYTES, "model1": M1_ROW_BYTES}


def is_fp8_latent(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache``'s dtype is one of the FP8 layout's (``float8_e4m3fn`` or ``uint8``)."""
    return kv_cache.dtype in FP8_DTYPES


def fp8_layout(kv_cache: torch.Tensor) -> str | None:
    """``"v32"`` or ``"model1"`` for an FP8 cache of 656- or 584-byte rows, None otherwise."""
    if not is_fp8_latent(kv_cache) or kv_cache.dim() < 1:
        return None
    return {FP8_ROW_BYTES: "v32", M1_ROW_BYTES: "model1"}.get(kv_cache.shape[-1])


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The least power of two at or above each positive ``x``."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def _ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two (NaN / inf for non-finite tiles) -> their UE8M0 bytes (255: NaN)."""
    bits = scale.contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    return torch.where(torch.isfinite(scale), e, torch.full_like(e, 255)).to(torch.uint8)


def _quantize_model1(kv: torch.Tensor) -> torch.Tensor:
    """``kv [num_pages, page_size, 1, 512]`` -> the MODEL1 layout (module docstring), pages padded to 576 bytes."""
    if kv.dim() != 4 or kv.shape[2] != 1 or kv.shape[3] != M1_NOPE + M1_ROPE:
        raise ValueError(f"kv: the MODEL1 layout quantises pages [num_pages, page_size, 1, {M1_NOPE + M1_ROPE}], got "
                         f"shape {list(kv.shape)}")
    nb, bs = kv.shape[:2]
    x = kv[:, :, 0].float()
    nope = x[..., :M1_NOPE].reshape(nb, bs, M1_SCALES, M1_TILE)
    finite = torch.isfinite(nope).all(-1)
    amax = torch.where(finite, nope.abs().amax(-1), torch.zeros_like(finite, dtype=torch.float32))
    # the least power of two >= amax / 448 (2^-126, a normal float32, for an all-zero tile); NaN marks a
    # non-finite tile
    scale = _pow2_ceil((amax / _E4M3_MAX).clamp(min=2.0**-126))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    q8 = (nope / torch.where(finite, scale, 1.0)[..., None]).clamp(-_E4M3_MAX, _E4M3_MAX)
    q8 = torch.where(finite[..., None], q8, nope)
    padded = -(-bs * M1_ROW_BYTES // M1_TOKEN_BYTES) * M1_TOKEN_BYTES
    pages = torch.zeros(nb, padded, dtype=torch.uint8, device=kv.device)
    tok = pages[:, :bs * M1_TOKEN_BYTES].view(nb, bs, M1_TOKEN_BYTES)
    tok[..., :M1_NOPE] = q8.reshape(nb, bs, M1_NOPE).to(torch.float8_e4m3fn).view(torch.uint8)
    tok[..., M1_NOPE:] = x[..., M1_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sc = pages[:, bs * M1_TOKEN_BYTES:bs * M1_ROW_BYTES].view(nb, bs, M1_SCALES + 1)
    sc[..., :M1_SCALES] = _ue8m0_bytes(scale)
    return pages[:, :bs * M1_ROW_BYTES].view(nb, bs, 1, M1_ROW_BYTES).view(torch.float8_e4m3fn)


def quantize_latent_fp8(kv: torch.Tensor, *, pow2_scales: bool = False, layout: str = "v32") -> torch.Tensor:
    """``kv [..., 576]`` (latent 512, then rope 64; any float dtype) -> ``[..., 656]`` float8_e4m3fn rows.

    ``layout="model1"``: ``kv [num_pages, page_size, 1, 512]`` -> FlashMLA's MODEL1 pages ``[num_pages, page_size,
    1, 584]`` (module docstring; UE8M0 scales, the least power of two >= amax / 448 per 64 values, always).

    Each 128-value latent tile gets the scale ``amax / 448`` (``pow2_scales``: rounded up to a power of two, as
    DeepSeek's UE8M0 scales are), so its largest value maps to e4m3's largest finite value; an all-zero tile gets
    scale 0 and zeros. The rope values are stored in bf16. NaN / inf in a tile make its scale NaN / inf, so its
    dequantised values are non-finite (they reach every query that sees the token, as in the bf16 cache)."""
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point() or is_fp8_latent(kv):
        got = kv.dtype if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise TypeError(f"kv: expected a floating tensor of latent + rope values, got {got}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {tuple(LAYOUTS)}, got {layout!r}")
    if not isinstance(pow2_scales, bool):
        raise TypeError(f"pow2_scales: expected a bool, got {pow2_scales!r}")
    if layout == "model1":
        return _quantize_model1(kv)
    if kv.dim() < 1 or kv.shape[-1] != FP8_LATENT + FP8_ROPE:
        raise ValueError(f"kv: expected a last dim of {FP8_LATENT + FP8_ROPE} (latent {FP8_LATENT} + rope "
                         f"{FP8_ROPE}), got shape {list(kv.shape)}")
    lead = kv.shape[:-1]
    lat = kv[..., :FP8_LATENT].float().reshape(*lead, FP8_SCALES, FP8_TILE)
    amax = lat.abs().amax(-1)
    finite = torch.isfinite(lat).all(-1)
    scale = amax / _E4M3_MAX
    if pow2_scales:
        scale = torch.where(scale > 0, _pow2_ceil(scale), scale)
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
    where it is exact; the rope values as stored). MODEL1 pages ``[num_pages, page_size, 1, 584]`` ->
    ``[num_pages, page_size, 1, 512]``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype: expected a floating torch.dtype of 16 bits or more, got {dtype!r}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"kv_cache: expected a float8_e4m3fn or uint8 tensor of FP8 rows, got "
                        f"{kv_cache.dtype if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")
    if kv_cache.dim() == 4 and kv_cache.shape[-1] == M1_ROW_BYTES:
        if kv_cache.shape[2] != 1:
            raise ValueError(f"kv_cache: MODEL1 pages are [num_pages, page_size, 1, {M1_ROW_BYTES}] (one latent head), "
                             f"got shape {list(kv_cache.shape)}")
        return _dequantize_model1(kv_cache, dtype)
    if kv_cache.dim() < 1 or kv_cache.shape[-1] != FP8_ROW_BYTES:
        raise ValueError(f"kv_cache: expected {FP8_ROW_BYTES}-byte rows (or MODEL1 pages [num_pages, page_size, 1, "
                         f"{M1_ROW_BYTES}]), got shape {list(kv_cache.shape)}")
    b = kv_cache.contiguous().view(torch.uint8)
    lead = b.shape[:-1]
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lat = b[..., :FP8_LATENT].contiguous().view(torch.float8_e4m3fn).to(work)
    scale = b[..., FP8_SCALE_OFF:FP8_ROPE_OFF].contiguous().view(torch.float32).to(work)
    lat = (lat.reshape(*lead, FP8_SCALES, FP8_TILE) * scale[..., None]).reshape(*lead, FP8_LATENT)
    rope = b[..., FP8_ROPE_OFF:].contiguous().view(torch.bfloat16).to(work)
    return torch.cat([lat, rope], -1).to(dtype)


def _dequantize_model1(kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    nb, bs = kv_cache.shape[:2]
    pages = kv_cache.contiguous().view(torch.uint8).reshape(nb, bs * M1_ROW_BYTES)  # each page's bytes in order
    tok = pages[:, :bs * M1_TOKEN_BYTES].reshape(nb, bs, M1_TOKEN_BYTES)
    e = pages[:, bs * M1_TOKEN_BYTES:].reshape(nb, bs, M1_SCALES + 1)[..., :M1_SCALES].to(torch.float64)
    scale = torch.where(e == 255, float("nan"), torch.exp2(e - 127))  # exact in float64, and in float32 for e > 0
    work = torch.float64 if dtype == torch.float64 else torch.float32
    nope = tok[..., :M1_NOPE].contiguous().view(torch.float8_e4m3fn).to(work).reshape(nb, bs, M1_SCALES, M1_TILE)
    nope = (nope * scale.to(work)[..., None]).reshape(nb, bs, M1_NOPE)
    rope = tok[..., M1_NOPE:].contiguous().view(torch.bfloat16).to(work)
    return torch.cat([nope, rope], -1).to(dtype)[:, :, None]
