"""FlashMLA's quantised latent-cache layouts (sgl-flash-mla's names in brackets).

DeepSeek V3.2 (``"v32"``, "V32"): one 656-byte row per token, latent 512 + rope 64.

    bytes [0, 512)    the 512 latent values, float8_e4m3fn, each 128-value tile divided by its scale
    bytes [512, 528)  4 float32 scales, one per 128 latent values (value = fp8 · scale)
    bytes [528, 656)  the 64 rope values, bfloat16 (not quantised)

V3.2 without rope (``"v32_no_rope"``, "V32_NO_ROPE"): the first 528 bytes of that row (512 channels, no rope).

A cache in these layouts is ``[num_pages, page_size, 1, 656 | 528]`` of dtype ``float8_e4m3fn`` (FlashMLA's) or
``uint8`` (the same bytes).

The paged layouts store each page's token data first and the tokens' scales after them; the value of a token is
all 512 channels (``head_dim_v`` 512):

    ``"model1"`` ("V4", DeepSeek V4; 584 bytes per token): per token 448 float8_e4m3fn values, then 64 bf16 rope
        values (576 bytes); then per token 7 UE8M0 scales, one per 64 values, and a byte of padding
    ``"v41"`` ("V41", DeepSeek V4.1; 528 bytes per token): per token 512 float8_e4m3fn values (the rope channels
        quantised too); then per token 16 UE8M0 scales, one per 32 values
    ``"v41_fp4"`` ("V41_FP4"; 288 bytes per token): per token 256 bytes of 512 e2m1 values (two per byte, the
        even-indexed one in the low nibble); then per token 32 float8_e4m3fn scales, one per 16 values

A UE8M0 scale byte ``e`` is ``2^(e - 127)`` (255: NaN). A cache in a paged layout is ``[num_pages, page_size, 1,
row]`` (float8_e4m3fn or uint8) whose elements are the first ``page_size · row`` bytes of each page in order
(strides ``(page stride, row, row, 1)``; FlashMLA pads each page to a multiple of 576 bytes (model1) or 512 bytes
(v41, v41_fp4)). FlashMLA reads them in sparse decoding only, and so do the kernels here.

V3.2 without rope and V4.1 share 528 bytes per token: a 528-byte cache is ``"v41"`` unless the caller names
``"v32_no_rope"`` (upstream FlashMLA's rule for its ``kv_format``). ``quantize_latent_fp8`` writes every layout,
``dequantize_latent_fp8`` reads it back exactly (what the kernels and the float64 reference compute from);
``is_fp8_latent`` tells a quantised cache by its dtype, ``fp8_layout`` its layout by its row width and the name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._common.validation import check_choice

__all__ = ["E4M3_MAX", "FP8_ROW_BYTES", "FP8_LATENT", "FP8_ROPE", "FP8_TILE", "KV_FORMATS", "M1_ROW_BYTES", "M1_TOKEN_BYTES",
           "M1_NOPE", "PAGED", "ROW_BYTES", "check_kv_format", "dequantize_latent_fp8", "fp8_layout", "is_fp8_latent",
           "quantize_latent_fp8"]

FP8_LATENT = 512  # latent values per token
FP8_ROPE = 64  # rope values per token (bf16)
FP8_TILE = 128  # latent values per scale
FP8_SCALES = FP8_LATENT // FP8_TILE
FP8_SCALE_OFF = FP8_LATENT  # byte offset of the scales
FP8_ROPE_OFF = FP8_LATENT + 4 * FP8_SCALES  # byte offset of the rope values (528)
FP8_ROW_BYTES = FP8_ROPE_OFF + 2 * FP8_ROPE  # 656
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by the code's three low bits (bit 3: the sign)
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


class Paged(NamedTuple):
    """A paged layout: a token's bytes in its page's first region (``token``) and second (``scales``), the values
    it quantises (``quant``, then ``512 - quant`` bf16 rope values), the values per scale (``tile``), whether the
    values are e2m1 (else e4m3) and the scales e4m3 (else UE8M0), and FlashMLA's page padding."""

    token: int
    scales: int
    quant: int
    tile: int
    fp4: bool
    pad: int


PAGED = {"model1": Paged(576, 8, 448, 64, False, 576), "v41": Paged(512, 16, 512, 32, False, 512),
         "v41_fp4": Paged(256, 32, 512, 16, True, 512)}
M1_NOPE = PAGED["model1"].quant  # quantised values per token (MODEL1)
M1_TOKEN_BYTES = PAGED["model1"].token  # 576: a token's values in the page's first region
M1_ROW_BYTES = M1_TOKEN_BYTES + PAGED["model1"].scales  # 584: a token's share of its page
ROW_BYTES = {"v32": FP8_ROW_BYTES, "v32_no_rope": FP8_ROPE_OFF,
             **{name: lay.token + lay.scales for name, lay in PAGED.items()}}
KV_FORMATS = tuple(ROW_BYTES)
_BY_WIDTH = {656: "v32", 528: "v41", 584: "model1", 288: "v41_fp4"}  # 528: V4.1, as FlashMLA (no rope: by name)


def is_fp8_latent(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache``'s dtype is one of the FP8 layouts' (``float8_e4m3fn`` or ``uint8``)."""
    return kv_cache.dtype in FP8_DTYPES


def check_kv_format(kv_format) -> str | None:
    """``kv_format`` as the kernels take it: None (the layout told by the row width) or one of ``KV_FORMATS``."""
    return check_choice("kv_format", kv_format, KV_FORMATS, optional=True)


def fp8_layout(kv_cache: torch.Tensor, kv_format: str | None = None) -> str | None:
    """The layout of a quantised cache: ``kv_format`` where its row width is that layout's, else (``kv_format``
    None) the layout of that width (528 bytes: ``"v41"``); None for another dtype or width."""
    if not is_fp8_latent(kv_cache) or kv_cache.dim() < 1:
        return None
    if kv_format is not None:
        return kv_format if ROW_BYTES.get(kv_format) == kv_cache.shape[-1] else None
    return _BY_WIDTH.get(kv_cache.shape[-1])


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The least power of two at or above each positive ``x``."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def _ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two (NaN / inf for non-finite tiles) -> their UE8M0 bytes (255: NaN)."""
    bits = scale.contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    return torch.where(torch.isfinite(scale), e, torch.full_like(e, 255)).to(torch.uint8)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8) of float32 ``x``: the nearest value, ties to the even code, saturated at ±6 (NaN: 0;
    the NaN is carried by its tile's scale)."""
    mags = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)
    a = torch.nan_to_num(x.abs(), nan=0.0, posinf=6.0).clamp_max(6.0).contiguous()
    mids = (mags[:-1] + mags[1:]) / 2
    lo, hi = torch.bucketize(a, mids), torch.bucketize(a, mids, right=True)  # they differ on a tie only
    code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def _page_bytes(kv: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A zeroed paged cache of ``kv``'s pages in ``layout``: (its ``[num_pages, page_size, 1, row]`` float8 view,
    the tokens' data bytes ``[num_pages, page_size, token]`` and scale bytes ``[num_pages, page_size, scales]``)."""
    lay = PAGED[layout]
    nb, bs = kv.shape[:2]
    row = lay.token + lay.scales
    padded = -(-bs * row // lay.pad) * lay.pad
    pages = torch.zeros(nb, padded, dtype=torch.uint8, device=kv.device)
    tok = pages[:, :bs * lay.token].view(nb, bs, lay.token)
    sc = pages[:, bs * lay.token:bs * row].view(nb, bs, lay.scales)
    return pages[:, :bs * row].view(nb, bs, 1, row).view(torch.float8_e4m3fn), tok, sc


def _quantize_paged(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """``kv [num_pages, page_size, 1, 512]`` -> a paged layout (module docstring), pages padded as FlashMLA's.

    e4m3 values: per tile the UE8M0 scale, the least power of two >= amax / 448 (2^-126, a normal float32, for an
    all-zero tile); a non-finite tile keeps its NaN / inf values and gets the NaN scale byte. e2m1 values: per tile
    the e4m3 scale amax / 6 (within [2^-9, 448]); a non-finite tile gets the NaN scale."""
    lay = PAGED[layout]
    if kv.dim() != 4 or kv.shape[2] != 1 or kv.shape[3] != FP8_LATENT:
        raise ValueError(f"kv: the {layout} layout quantises pages [num_pages, page_size, 1, {FP8_LATENT}], got "
                         f"shape {list(kv.shape)}")
    nb, bs = kv.shape[:2]
    x = kv[:, :, 0].float()
    vals = x[..., :lay.quant].reshape(nb, bs, lay.quant // lay.tile, lay.tile)
    finite = torch.isfinite(vals).all(-1)
    amax = torch.where(finite, vals.abs().amax(-1), torch.zeros_like(finite, dtype=torch.float32))
    out, tok, sc = _page_bytes(kv, layout)
    if lay.fp4:
        scale = (amax / 6.0).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn)
        scale = torch.where(finite, scale.float(), float("nan"))
        codes = _e2m1_codes(vals / scale.nan_to_num(1.0)[..., None]).reshape(nb, bs, lay.quant)
        tok[:] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        sc[:] = scale.to(torch.float8_e4m3fn).view(torch.uint8)
        return out
    scale = _pow2_ceil((amax / E4M3_MAX).clamp(min=2.0**-126))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    q8 = (vals / torch.where(finite, scale, 1.0)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    q8 = torch.where(finite[..., None], q8, vals)
    tok[..., :lay.quant] = q8.reshape(nb, bs, lay.quant).to(torch.float8_e4m3fn).view(torch.uint8)
    if lay.quant < FP8_LATENT:  # the bf16 rope values (MODEL1; V4.1 quantises every channel)
        tok[..., lay.quant:] = x[..., lay.quant:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sc[..., :lay.quant // lay.tile] = _ue8m0_bytes(scale)
    return out


def quantize_latent_fp8(kv: torch.Tensor, *, pow2_scales: bool = False, layout: str = "v32") -> torch.Tensor:
    """``kv [..., 576]`` (latent 512, then rope 64; any float dtype) -> ``[..., 656]`` float8_e4m3fn rows.

    ``layout="v32_no_rope"``: ``kv [..., 512]`` -> ``[..., 528]`` rows (the same without the rope part).
    ``layout="model1"`` / ``"v41"`` / ``"v41_fp4"``: ``kv [num_pages, page_size, 1, 512]`` -> FlashMLA's pages
    ``[num_pages, page_size, 1, 584 | 528 | 288]`` (module docstring; UE8M0 scales, the least power of two >= amax /
    448 per tile, always; e4m3 scales amax / 6 for e2m1 values). ``"v41_fp4"``'s range is the format's: its e4m3
    tile scales lie in [2^-9, 448] and e2m1 values reach 6, so larger magnitudes saturate at ±2688 and, in a tile
    whose scale is clamped to 2^-9, values below 2^-11 round to 0 (the UE8M0 layouts' scales span float32's range).

    Each 128-value latent tile gets the scale ``amax / 448`` (``pow2_scales``: rounded up to a power of two, as
    DeepSeek's UE8M0 scales are), so its largest value maps to e4m3's largest finite value; an all-zero tile gets
    scale 0 and zeros (a float32 subnormal scale is rounded up). The rope values are stored in bf16. The latent
    values are taken in float32 (a float64 value past its range is ±inf there). A NaN or inf in a tile makes its scale
    NaN, so its dequantised values are NaN (they reach every query that sees the token, as in the bf16 cache)."""
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point() or is_fp8_latent(kv):
        got = kv.dtype if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise TypeError(f"kv: expected a floating tensor of latent + rope values, got {got}")
    check_choice("layout", layout, KV_FORMATS)
    if not isinstance(pow2_scales, bool):
        raise TypeError(f"pow2_scales: expected a bool, got {pow2_scales!r}")
    if layout in PAGED:
        return _quantize_paged(kv, layout)
    rope = FP8_ROPE if layout == "v32" else 0
    if kv.dim() < 1 or kv.shape[-1] != FP8_LATENT + rope:
        raise ValueError(f"kv: expected a last dim of {FP8_LATENT + rope} (latent {FP8_LATENT} + rope {rope}) for "
                         f"the {layout} layout, got shape {list(kv.shape)}")
    lead = kv.shape[:-1]
    lat = kv[..., :FP8_LATENT].float().reshape(*lead, FP8_SCALES, FP8_TILE)
    amax = lat.abs().amax(-1)
    finite = torch.isfinite(lat).all(-1)
    scale = amax / E4M3_MAX
    # a float32 subnormal scale keeps few bits: where amax / 448 rounded down (or to 0, amax < 448 · 2^-150) the
    # next float32 up, so the tile's values never saturate past 448 and a nonzero tile never gets scale 0
    low = (scale < torch.finfo(torch.float32).tiny) & (scale.double() * E4M3_MAX < amax.double())
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    if pow2_scales:
        scale = torch.where(scale > 0, _pow2_ceil(scale), scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (lat / div[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    q8 = torch.where(finite[..., None], q8, lat)  # a non-finite tile keeps its NaN / inf (its scale is NaN)
    out = torch.empty(*lead, ROW_BYTES[layout], dtype=torch.uint8, device=kv.device)
    out[..., :FP8_LATENT] = q8.reshape(*lead, FP8_LATENT).to(torch.float8_e4m3fn).view(torch.uint8)
    out[..., FP8_SCALE_OFF:FP8_ROPE_OFF] = scale.contiguous().view(torch.uint8).reshape(*lead, 4 * FP8_SCALES)
    if rope:
        out[..., FP8_ROPE_OFF:] = kv[..., FP8_LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(
            *lead, 2 * FP8_ROPE)
    return out.view(torch.float8_e4m3fn)


def dequantize_latent_fp8(kv_cache: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                          kv_format: str | None = None) -> torch.Tensor:
    """A quantised cache -> its values in ``dtype`` (a float dtype of 16 bits or more; value · scale in float32,
    i.e. the exact product rounded once, as the kernels form it, or in float64 for ``dtype`` float64, where it is
    exact; the rope values as stored): ``[..., 656]`` rows -> ``[..., 576]``, ``[..., 528]`` rows -> ``[..., 512]``,
    paged layouts ``[num_pages, page_size, 1, row]`` -> ``[num_pages, page_size, 1, 512]``. ``kv_format``: the
    layout (``KV_FORMATS``; None: told by the row width, 528 bytes being ``"v41"``)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype: expected a floating torch.dtype of 16 bits or more, got {dtype!r}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"kv_cache: expected a float8_e4m3fn or uint8 tensor of FP8 rows, got "
                        f"{kv_cache.dtype if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")
    layout = fp8_layout(kv_cache, check_kv_format(kv_format))
    if layout is None:
        raise ValueError(f"kv_cache: expected rows of {sorted(set(ROW_BYTES.values()))} bytes"
                         f"{'' if kv_format is None else f' ({ROW_BYTES[kv_format]} for {kv_format!r})'}, got shape "
                         f"{list(kv_cache.shape)}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if layout in PAGED:
        if kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
            hint = " (528-byte rows without rope: kv_format='v32_no_rope')" if layout == "v41" else ""
            raise ValueError(f"kv_cache: {layout} pages are [num_pages, page_size, 1, {ROW_BYTES[layout]}] (one "
                             f"latent head), got shape {list(kv_cache.shape)}{hint}")
        return _dequantize_paged(kv_cache, layout, work).to(dtype)
    b = kv_cache.contiguous().view(torch.uint8)
    lead = b.shape[:-1]
    lat = b[..., :FP8_LATENT].contiguous().view(torch.float8_e4m3fn).to(work)
    scale = b[..., FP8_SCALE_OFF:FP8_ROPE_OFF].contiguous().view(torch.float32).to(work)
    lat = (lat.reshape(*lead, FP8_SCALES, FP8_TILE) * scale[..., None]).reshape(*lead, FP8_LATENT)
    if layout == "v32_no_rope":
        return lat.to(dtype)
    rope = b[..., FP8_ROPE_OFF:].contiguous().view(torch.bfloat16).to(work)
    return torch.cat([lat, rope], -1).to(dtype)


def _dequantize_paged(kv_cache: torch.Tensor, layout: str, work: torch.dtype) -> torch.Tensor:
    lay = PAGED[layout]
    nb, bs = kv_cache.shape[:2]
    pages = kv_cache.contiguous().view(torch.uint8).reshape(nb, bs * (lay.token + lay.scales))  # each page in order
    tok = pages[:, :bs * lay.token].reshape(nb, bs, lay.token)
    sc = pages[:, bs * lay.token:].reshape(nb, bs, lay.scales)[..., :lay.quant // lay.tile]
    if lay.fp4:
        codes = torch.stack((tok & 0xF, tok >> 4), -1).reshape(nb, bs, lay.quant)
        mags = torch.tensor(_E2M1, dtype=work, device=tok.device)[(codes & 7).long()]
        vals = torch.where((codes & 8) != 0, -mags, mags)
        scale = sc.contiguous().view(torch.float8_e4m3fn).to(work)  # exact (e2m1 · e4m3 is exact in float32)
    else:
        vals = tok[..., :lay.quant].contiguous().view(torch.float8_e4m3fn).to(work)
        e = sc.to(torch.float64)
        scale = torch.where(e == 255, float("nan"), torch.exp2(e - 127)).to(work)  # exact, e = 0 too
    deq = (vals.reshape(nb, bs, lay.quant // lay.tile, lay.tile) * scale[..., None]).reshape(nb, bs, lay.quant)
    rope = tok[..., lay.quant:].contiguous().view(torch.bfloat16).to(work)
    return torch.cat([deq, rope], -1)[:, :, None]
