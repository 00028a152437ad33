"""Public ``mla_decode`` (GQLA absorb path / DeepSeek MLA decode): validation, the ``torch.library`` op and the
eager launcher that picks a kernel, allocates the outputs and merges the splits."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...dispatch import device_info, select_config
from .._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_decode_inputs,
    check_kernel_device,
    check_same_device,
    check_same_dtype,
    check_softmax_scale,
    check_tensor,
    combine_splits,
    sparse_rows,
)
from .._common.alloc import empty
from .._common.boundary import route, runner
from .._common.impl import check_impl
from .._common.memo import CheckedCalls, call_key
from .._common.validation import (
    MAX_KEYS,
    aligned_rows_copy,
    check_flag,
    check_int_in,
    check_num_splits,
    check_rows_aligned,
    contiguous_indices,
    forward_only,
    requires_grad,
    rows_aligned,
    unit_last_stride,
)
from .fp8 import FP8_DTYPES, PAGED, ROW_BYTES, check_kv_format, fp8_layout, is_fp8_latent
from .gluon_sm90 import gluon_unsupported, mla_decode_gluon
from .plan import MLAPlan, config_key, plan
from .reference import mla_decode_ref, mla_sparse_prefill_ref
from .triton import mla_decode_triton

__all__ = ["SparsePrefillOutput", "mla_decode", "mla_decode_fwd", "mla_sparse_prefill", "mla_sparse_prefill_fwd"]

_LOG2E = 1.4426950408889634
_REFERENCE = "gqla_triton.ops.mla.reference.mla_decode_ref"
_PREFILL_REFERENCE = "gqla_triton.ops.mla.reference.mla_sparse_prefill_ref"


def _use_gluon(impl: str, q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int, sparse: bool, scaled: bool,
               layout: str | None = None) -> bool:
    """Whether ``impl`` runs the Gluon kernel: ``"gluon"`` always (ValueError where it cannot), ``"auto"`` where the
    inputs allow it and this GPU's table selects ``impl: "gluon"``. ``scaled``: a per-tensor scaled float8 cache
    (``k_descale``), which the portable kernel reads; ``layout``: the cache's quantised layout (``fp8_layout``; None:
    told by the row width)."""
    if impl == "triton":
        return False
    info = device_info(q)
    why = ("a float8 cache scaled per tensor (k_descale): the portable kernel reads it" if scaled
           else "the Triton interpreter runs no Gluon kernel" if info.interpreter
           else f"{info.name} is not a Hopper GPU (sm_90)" if info.capability[0] != 9
           else gluon_unsupported(q, kv_cache, head_dim_v, layout))
    if impl == "gluon":
        if why is not None:
            raise ValueError(f"impl='gluon': the Gluon MLA kernel cannot run here: {why}")
        return True
    return why is None and select_config("mla_decode", config_key(q, head_dim_v, sparse, "gluon"),
                                         device=q.device).impl == "gluon"


def _prepare(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, head_dim_v: int,
             indices: torch.Tensor | None, num_splits: int, impl: str, k_descale: torch.Tensor | None,
             kv_format: str | None) -> tuple[str | None, bool, MLAPlan]:
    """What a kernel call takes from the inputs' metadata and this GPU's table: (the cache's layout, whether the
    Gluon kernel runs, the plan)."""
    scaled = k_descale is not None
    layout = "e4m3" if scaled else fp8_layout(kv_cache, kv_format)
    if layout in ROW_BYTES:
        _check_fp8_offset(kv_cache, layout)
    sparse = indices is not None
    gluon = _use_gluon(impl, q, kv_cache, head_dim_v, sparse, scaled, layout)
    p = plan(q, kv_cache.shape[1], block_table.shape[1], head_dim_v, indices.shape[-1] if sparse else None,
             num_splits, "gluon" if gluon else "triton")
    return layout, gluon, p


def mla_decode_fwd(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   head_dim_v: int, softmax_scale: float, causal: bool, indices: torch.Tensor | None,
                   topk_length: torch.Tensor | None, num_splits: int, impl: str, q_descale: torch.Tensor | None = None,
                   k_descale: torch.Tensor | None = None, kv_format: str | None = None, out_fp32: bool = False,
                   prepared: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager body of ``mla_decode`` on validated inputs (``impl`` one of ``IMPLS``, ``softmax_scale`` a float).
    ``prepared``: ``_prepare``'s value for these inputs (None: formed here). Returns ``(out [B, s_q, h_q,
    head_dim_v] in default_out_dtype(q) (float32 with out_fp32), lse [B, h_q, s_q] fp32)``."""
    o_dtype = torch.float32 if out_fp32 else default_out_dtype(q)
    if impl == "reference":
        o, lse = mla_decode_ref(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices,
                                topk_length, q_descale=q_descale, k_descale=k_descale, kv_format=kv_format)
        return o.to(device=q.device, dtype=o_dtype), lse.to(device=q.device, dtype=torch.float32)
    if prepared is None:
        prepared = _prepare(q, kv_cache, block_table, head_dim_v, indices, num_splits, impl, k_descale, kv_format)
    layout, gluon, p = prepared
    block_table, cache_seqlens, indices, topk_length = contiguous_indices(block_table, cache_seqlens, indices,
                                                                          topk_length)
    B, s_q, h_q, D = q.shape
    num_pages, page_size = kv_cache.shape[:2]
    sparse = indices is not None
    S = p.num_splits
    q, = unit_last_stride(q)
    if not _kernel_strides(kv_cache, layout):  # (a custom op's body is handed any strides)
        kv_cache = (kv_cache.clone(memory_format=torch.contiguous_format) if layout in PAGED
                    else aligned_rows_copy(kv_cache))
    out = empty(B, s_q, h_q, head_dim_v, dtype=o_dtype, device=q.device)  # the kernels round into its dtype
    lse = empty(B, h_q, s_q, dtype=torch.float32, device=q.device)
    if S > 1:
        o_part = empty(B, S, s_q, h_q, head_dim_v, dtype=torch.float32, device=q.device)
        lse_part = empty(B, S, s_q, h_q, dtype=torch.float32, device=q.device)
    else:  # placeholders the kernel never touches
        o_part, lse_part = out.new_empty(1, 1, 1, 1), lse.new_empty(1, 1, 1)
    rows_src = (sparse_rows(indices, block_table, cache_seqlens, topk_length, page_size=page_size,
                            num_pages=num_pages, causal=causal) if sparse else block_table)
    if gluon:
        unit = mla_decode_gluon(q, kv_cache, rows_src, cache_seqlens, topk_length, head_dim_v, softmax_scale * _LOG2E,
                                causal, sparse, p, out, lse, o_part, lse_part)
    else:
        unit = mla_decode_triton(q, kv_cache, block_table, cache_seqlens, rows_src, topk_length, head_dim_v,
                                 softmax_scale * _LOG2E, causal, sparse, p, out, lse, o_part, lse_part,
                                 q_descale=q_descale, k_descale=k_descale, layout=layout)
    if S > 1:
        combine_splits(o_part, lse_part, out, lse, unit=unit)
    return out, lse


def default_out_dtype(q: torch.Tensor) -> torch.dtype:
    """``mla_decode``'s output dtype: q's, bfloat16 for a float8 q (FlashMLA's)."""
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype


def _wants_fp32(requested, default: torch.dtype) -> bool:
    """The ``out_dtype`` option: None or ``default`` (the output rounded to it), or torch.float32 where ``default``
    is a 16-bit type (the kernels' fp32 accumulator, not rounded)."""
    if requested is None:
        return False
    if not isinstance(requested, torch.dtype):
        raise TypeError(f"out_dtype: expected None or a torch.dtype, got {type(requested).__name__}")
    wide = default in (torch.bfloat16, torch.float16)
    if requested != default and not (wide and requested == torch.float32):
        raise ValueError(f"out_dtype: expected None or {default}{' or torch.float32' if wide else ''} (the "
                         f"output dtype of these inputs{', or the accumulator unrounded' if wide else ''}), got "
                         f"{requested}")
    return requested != default


@torch.library.custom_op("gqla_triton::mla_decode", mutates_args=())
def _mla_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   head_dim_v: int, softmax_scale: float, causal: bool, indices: torch.Tensor | None,
                   topk_length: torch.Tensor | None, num_splits: int, impl: str, q_descale: torch.Tensor | None = None,
                   k_descale: torch.Tensor | None = None, kv_format: str | None = None, out_fp32: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    # a direct torch.ops call reaches here unchecked: the public function's checks (kept per call), but for the
    # strides the body copies (mla_decode_fwd)
    _checked(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length,
             num_splits, impl, q_descale, k_descale, kv_format, any_strides=True)
    return mla_decode_fwd(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices,
                          topk_length, num_splits, impl, q_descale, k_descale, kv_format, out_fp32)


@_mla_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length, num_splits,
      impl, q_descale=None, k_descale=None, kv_format=None, out_fp32=False):
    B, s_q, h_q, _ = q.shape
    o_dtype = torch.float32 if out_fp32 else default_out_dtype(q)
    return q.new_empty(B, s_q, h_q, head_dim_v, dtype=o_dtype), q.new_empty(B, h_q, s_q, dtype=torch.float32)


forward_only(_mla_decode_op, "mla_decode")


def _validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length,
              num_splits, impl, q_descale=None, k_descale=None, kv_format=None,
              any_strides: bool = False) -> tuple[float, str, bool, int]:
    """Every check of ``mla_decode`` (device values are never read); returns ``(softmax_scale, impl, causal,
    num_splits)`` as the kernels take them. ``any_strides``: the cache's strides are not checked (the custom op's
    body copies a cache the kernels cannot read in place)."""
    impl = check_impl(impl, op="mla_decode", gluon=True)
    dtypes = FLOAT_DTYPES + ((torch.float64,) if impl == "reference" else ())
    scaled = k_descale is not None
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn and not scaled:
        raise TypeError("q: a float8_e4m3fn q needs q_descale and k_descale (over a float8_e4m3fn cache scaled per "
                        "tensor)")
    check_tensor("q", q, ndim=4, dtypes=dtypes + ((torch.float8_e4m3fn,) if scaled else ()))
    fp8 = isinstance(kv_cache, torch.Tensor) and is_fp8_latent(kv_cache)
    check_tensor("kv_cache", kv_cache, ndim=4, dtypes=dtypes + FP8_DTYPES)  # the message lists the FP8 layout's
    if not fp8:
        check_same_dtype(q=q, kv_cache=kv_cache)
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                      indices=indices, topk_length=topk_length, q_descale=q_descale, k_descale=k_descale)
    D = q.shape[-1]
    if kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache: expected one latent head (dim 2 == 1), got shape {list(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 and not any_strides:
        raise ValueError("kv_cache: the last dimension must be contiguous (stride 1)")
    if q.shape[2] == 0 or D == 0:
        raise ValueError(f"q: expected at least one head of at least one channel, got shape {list(q.shape)}")
    head_dim_v = _check_head_dim_v(head_dim_v, D)
    if check_kv_format(kv_format) is not None and (not fp8 or scaled or q_descale is not None):
        raise ValueError(f"kv_format: names the layout of one of FlashMLA's quantised caches (uint8 / float8_e4m3fn "
                         f"rows with their own scales), got {kv_format!r} with a {kv_cache.dtype} cache"
                         f"{' scaled per tensor (k_descale)' if scaled or q_descale is not None else ''}")
    if scaled or q_descale is not None:
        _check_descales(q, kv_cache, q_descale, k_descale)
    elif fp8:
        _check_fp8(q, kv_cache, head_dim_v, indices is not None, kv_format, any_strides)
    elif kv_cache.shape[3] != D:
        raise ValueError(f"kv_cache: last dim {kv_cache.shape[3]} != q's last dim {D} (latent + rope)")
    if impl != "reference" and not any_strides and not (fp8 and fp8_layout(kv_cache, kv_format) in PAGED):
        # (paged: bytes in order)
        check_rows_aligned("kv_cache", kv_cache)
    scale = check_softmax_scale(softmax_scale, D ** -0.5)
    check_decode_inputs(q, block_table, cache_seqlens, num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1],
                        indices=indices, topk_length=topk_length, num_splits=num_splits)
    if indices is not None and indices.dim() != 3:
        raise ValueError(f"indices: expected shape [B, s_q, topk] (shared by all heads), got {list(indices.shape)}")
    if impl != "reference":
        check_kernel_device(q.device, _REFERENCE, q.dtype)
    return scale, impl, check_flag("causal", causal), check_num_splits(num_splits)


def _check_descales(q: torch.Tensor, kv_cache: torch.Tensor, q_descale, k_descale) -> None:
    """A per-tensor scaled float8 cache (vLLM's ``kv_cache_dtype="fp8"``, FlashMLA's dense FP8 path): float8_e4m3fn
    rows of q's width D, the keys ``k_descale · row``; a float8_e4m3fn q is ``q_descale · q``. Each descale is
    float32 ``[1]`` (one for the batch) or ``[B]`` (one per sequence)."""
    if k_descale is None:
        raise ValueError("q_descale: given without k_descale (the descales belong to a float8 q over a float8 cache "
                         "scaled per tensor; pass both, or k_descale alone for a bf16 / fp16 / fp32 q)")
    if kv_cache.dtype != torch.float8_e4m3fn or kv_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_descale: scales a float8_e4m3fn cache of q's width {q.shape[3]} (one e4m3 value per "
                         f"channel), got a {kv_cache.dtype} cache of last dim {kv_cache.shape[3]} (FlashMLA's FP8 "
                         "layouts carry their own scales: pass k_descale=None)")
    B = q.shape[0]
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale)):
        if d is not None:
            check_tensor(name, d, ndim=1, dtypes=(torch.float32,))
            if d.shape[0] not in (1, B):
                raise ValueError(f"{name}: expected shape [1] (the batch's) or [B={B}] (one per sequence), got "
                                 f"{list(d.shape)}")
    if (q.dtype == torch.float8_e4m3fn) != (q_descale is not None):
        raise ValueError(f"q_descale: a float8_e4m3fn q needs it and any other q takes none (got q {q.dtype}, "
                         f"q_descale {'a tensor' if q_descale is not None else 'None'})")


def _check_head_dim_v(head_dim_v, D: int) -> int:
    """The value width as an int in ``[1, D]`` (any integral number but a bool; ``check_int_in``)."""
    return check_int_in("head_dim_v", head_dim_v, 1, D)


# FlashMLA's names of the quantised layouts (fp8.py), and the alignment in bytes their in-place views need (float32
# scales, bf16 rope values)
_NAMES = {"v32": "V3.2 FP8", "v32_no_rope": "V3.2 FP8 (no rope)", "model1": "MODEL1 FP8", "v41": "V4.1 FP8",
          "v41_fp4": "V4.1 fp4"}
_ALIGN = {"v32": 4, "v32_no_rope": 4, "model1": 2, "v41": 1, "v41_fp4": 1}


def _check_fp8(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v, sparse: bool, kv_format: str | None,
               any_strides: bool = False) -> None:
    """FlashMLA's quantised layouts (``fp8.py``): rows read in place as bytes, float32 scales and bf16 rope values
    (``v32``, ``v32_no_rope``; dense or sparse), or pages of token data then scales (sparse only)."""
    layout = fp8_layout(kv_cache, kv_format)
    if layout is None and kv_format is not None:
        raise ValueError(f"kv_format: {kv_format!r} is a layout of {ROW_BYTES[kv_format]}-byte rows, got a kv_cache "
                         f"of last dim {kv_cache.shape[3]}")
    if layout is None:
        widths = ", ".join(f"{w} ({name})" for name, w in ROW_BYTES.items())
        raise ValueError(f"kv_cache: a {kv_cache.dtype} cache holds one of FlashMLA's quantised layouts, bytes per "
                         f"token {widths}, got last dim {kv_cache.shape[3]}")
    name = f"FlashMLA's {_NAMES[layout]} {'pages' if layout in PAGED else 'rows'} ({ROW_BYTES[layout]} bytes per token)"
    D = 576 if layout == "v32" else 512
    if q.shape[-1] != D or head_dim_v != 512:
        raise ValueError(f"q / head_dim_v: {name} take q of {D} channels and head_dim_v 512, got q's last dim "
                         f"{q.shape[-1]} and head_dim_v {head_dim_v!r}")
    _check_fp8_q(q)
    num_pages, page = kv_cache.shape[:2]
    if layout in PAGED:
        if not sparse:
            raise ValueError(f"kv_cache: {name} are read by sparse calls only (indices), as FlashMLA reads them")
        if not any_strides and ((page > 1 and kv_cache.stride(1) != ROW_BYTES[layout])
                                or (num_pages > 1 and kv_cache.stride(0) % _ALIGN[layout])):
            raise ValueError(f"kv_cache: {name} are read in place: the view's elements must be each page's bytes in "
                             f"order (strides (page stride, {ROW_BYTES[layout]}, *, 1), a page stride a multiple of "
                             f"{_ALIGN[layout]}), got strides {list(kv_cache.stride())}")
    elif not any_strides and any(st % 4 for st in kv_cache.stride()[:3]):
        raise ValueError(f"kv_cache: {name} are read with their float32 scales in place: the strides of the first "
                         f"three dims must be multiples of 4 bytes, got strides {list(kv_cache.stride())}")
    if not torch.compiler.is_compiling():  # torch.compile cannot trace storage_offset(): the op's body checks it
        _check_fp8_offset(kv_cache, layout)


def _kernel_strides(kv_cache: torch.Tensor, layout: str | None) -> bool:
    """Whether the kernels read ``kv_cache`` (of the quantised ``layout``, None: not quantised) in place: FlashMLA's
    paged layouts with each page's bytes in order (as ``_check_fp8`` asks of the public call's), every other cache
    with unit stride along the last dimension, on a GPU ``rows_aligned`` rows (as the public call asks), elsewhere
    FlashMLA's V3.2 rows with 4-byte strides (their float32 scales). A dim of size 1 is never stepped along."""
    if kv_cache.stride(-1) != 1:
        return False
    if layout in PAGED:
        num_pages, page = kv_cache.shape[:2]
        return ((page <= 1 or kv_cache.stride(1) == ROW_BYTES[layout])
                and (num_pages <= 1 or kv_cache.stride(0) % _ALIGN[layout] == 0))
    if kv_cache.is_cuda:
        return rows_aligned(kv_cache)
    if layout in ("v32", "v32_no_rope"):  # the launch views their float32 scales in place
        return kv_cache.storage_offset() % _ALIGN[layout] == 0 and all(
            n <= 1 or st % _ALIGN[layout] == 0 for n, st in zip(kv_cache.shape[:3], kv_cache.stride()[:3], strict=True))
    return True


def _check_fp8_q(q: torch.Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"q: with an FP8 latent cache q must be bfloat16 or float32 (float64 for impl='reference'), "
                        f"got {q.dtype}")


def _check_fp8_offset(kv_cache: torch.Tensor, layout: str) -> None:
    if kv_cache.storage_offset() % _ALIGN[layout]:
        raise ValueError(f"kv_cache: FP8 rows are read with their scales and rope values in place: the storage offset "
                         f"must be a multiple of {_ALIGN[layout]} bytes, got {kv_cache.storage_offset()}")


def mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v=512, softmax_scale=None, causal=True,
               indices=None, topk_length=None, num_splits=0, *, impl="auto", q_descale=None, k_descale=None,
               kv_format=None, out_dtype=None):
    """MLA decode over a paged latent cache (absorb path), dense or sparse top-k. Forward only.

    Args:
        q: ``[B, s_q, h_q, D]`` bf16/fp16/fp32, ``D = r + d_R`` (latent first, then rope; 512 + 64 tuned).
        kv_cache: ``[num_pages, page_size, 1, D]``, same dtype; the value of a token is the first
            ``head_dim_v`` channels of its row. ``page_size`` a multiple of 16 (any size for sparse calls). Or
            FlashMLA's FP8 latent cache ``[num_pages, page_size, 1, 656]`` float8_e4m3fn (or uint8; ``fp8.py``: 512
            e4m3 latent values, a float32 scale per 128, 64 bf16 rope values) with D = 576, ``head_dim_v`` 512 and q
            bf16 (fp32 exact); ``quantize_latent_fp8`` writes it; or its 528-byte rows without rope (D = 512;
            ``kv_format="v32_no_rope"``). Sparse calls also read FlashMLA's paged layouts (D = ``head_dim_v`` = 512):
            MODEL1 FP8 pages ``[num_pages, page_size, 1, 584]``, V4.1 FP8 pages ``[..., 528]`` and V4.1 fp4 pages
            ``[..., 288]``. Or, with ``k_descale``, a float8_e4m3fn cache ``[num_pages, page_size, 1, D]`` scaled per tensor
            (vLLM's ``kv_cache_dtype="fp8"``): key = ``k_descale · row``.
        block_table: ``[B, max_pages]`` int32 (``max_pages · page_size <= 2**30``); token ``p`` of sequence ``b``
            lives in page ``block_table[b, p // page_size]``. Pages outside the table or the cache are ignored.
        cache_seqlens: ``[B]`` int32 tokens in the cache per sequence; 0 or negative = empty. Any value is safe:
            positions past the block table (``>= max_pages · page_size``) hold no key, so a longer length attends to
            the table's keys (query positions still follow ``cache_seqlens``) and never loops past them.
        head_dim_v: value width (default 512).
        softmax_scale: a finite real number; default ``D ** -0.5``.
        causal: with ``s_q > 1``, query ``j`` sits at ``cache_seqlens - s_q + j`` and sees keys up to it.
        indices: optional ``[B, s_q, topk]`` int32 logical positions shared by all heads (sparse). Entries
            < 0, >= ``cache_seqlens[b]``, past the block table (``>= max_pages · page_size``, or on an invalid
            page) or after the query's position (causal) are ignored, never clamped onto a key; a duplicated
            entry counts once per occurrence. Any value is safe (never addresses outside the cache).
        topk_length: optional ``[B]`` int32: only the first ``topk_length[b]`` entries of each row count.
        num_splits: int in ``[0, 1024]``, the split-KV count; 0 = chosen from shapes (no host sync, CUDA-graph
            safe).
        impl: ``"auto"`` (this GPU's config table: on Hopper the Gluon kernel for bf16/fp16 with latent 512 +
            rope 64, the portable Triton kernel otherwise), ``"triton"``, ``"gluon"`` (ValueError where that
            kernel cannot run) or ``"reference"`` (``mla_decode_ref``, any device, float64 too).
        q_descale, k_descale: float32 ``[1]`` (the batch's) or ``[B]`` (per sequence) on q's device, for a cache
            scaled per tensor (above): the scores are ``softmax_scale · q_descale · k_descale · (q·row)`` and out
            ``k_descale · Σ p·row[:head_dim_v]``, the dots over the exact e4m3 values. ``q_descale`` goes with a
            float8_e4m3fn q (out is then bfloat16, as FlashMLA's), and a bf16 / fp16 / fp32 q takes none. The
            portable kernel runs these calls (``impl="gluon"`` refuses them).
        kv_format: the layout of a quantised cache (``fp8.KV_FORMATS``: ``"v32"``, ``"v32_no_rope"``,
            ``"model1"``, ``"v41"``, ``"v41_fp4"``); None: told by the row width, 528 bytes being ``"v41"``
            (upstream FlashMLA's rule: V3.2 without rope shares that width and is named).
        out_dtype: None (q's dtype, bfloat16 for a float8 q) or, where that is a 16-bit type, torch.float32: out
            as the kernel accumulates it, not rounded, for callers that go on to merge key sets or rescale rows
            (rounding once at their end).

    bf16/fp16 run on tensor cores (the tuned path); fp32 is exact (IEEE dot, small tiles) and slow on GPUs.

    Returns:
        ``out [B, s_q, h_q, head_dim_v]`` in q's dtype (bfloat16 for a float8 q; ``out_dtype``) and
        ``lse [B, h_q, s_q]`` fp32 (natural log). A query that sees no key (or only ``-inf`` scores) gives
        ``out = 0`` and ``lse = -inf``. NaN / inf follow IEEE arithmetic over the keys a query sees and reach no
        other query: a NaN in q or in a key it sees makes its out and lse NaN; a ``+inf`` score gives
        ``lse = +inf``, out NaN (``reference.py`` defines it all).

    Inputs that require grad are accepted, but a backward through the outputs raises (no gradient is defined).
    """
    key, scale, impl, causal, num_splits, out_fp32 = _checked(
        q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length, num_splits,
        impl, q_descale, k_descale, kv_format, out_dtype)
    head_dim_v = int(head_dim_v)  # an integral number (checked): the custom op takes an int
    fn = _runner(key, q, kv_cache, block_table, head_dim_v, indices, num_splits, impl, q_descale, k_descale, kv_format)
    return fn(q, kv_cache, block_table, cache_seqlens, head_dim_v, scale, causal, indices, topk_length, num_splits,
              impl, q_descale, k_descale, kv_format, out_fp32)


# mla_decode's checked calls (``_common.memo``)
_CHECKED = CheckedCalls()


def _checked(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length,
             num_splits, impl, q_descale=None, k_descale=None, kv_format=None, out_dtype=None,
             any_strides: bool = False) -> tuple:
    """``_validate`` and ``out_dtype``'s check, remembered by the call's metadata (``_common.memo``): (the call's
    key or None, softmax_scale, impl, causal, num_splits, out_fp32) as the kernels take them. ``any_strides``: as
    ``_validate``'s (the custom op's body)."""
    key = call_key((q, kv_cache, block_table, cache_seqlens, indices, topk_length, q_descale, k_descale),
                   (head_dim_v, softmax_scale, causal, num_splits, impl, kv_format, out_dtype, any_strides))
    checked = _CHECKED.get(key)
    if checked is None:
        checked = (*_validate(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices,
                              topk_length, num_splits, impl, q_descale, k_descale, kv_format, any_strides),
                   _wants_fp32(out_dtype, default_out_dtype(q)))
        _CHECKED.put(key, checked)
    scale, impl, causal, num_splits, out_fp32 = checked
    if type(softmax_scale) is float:  # its own checked value (0.0 and -0.0 share a key)
        scale = softmax_scale
    return key, scale, impl, causal, num_splits, out_fp32


def _runner(key, q, kv_cache, block_table, head_dim_v, indices, num_splits, impl, q_descale, k_descale, kv_format):
    """What runs a checked call (``_checked``'s values; ``boundary.runner``): the plan is kept under ``key`` (any
    block table of the call's shape)."""
    return runner(_mla_decode_op, mla_decode_fwd, grad=requires_grad(q, kv_cache, q_descale, k_descale), memo=_CHECKED,
                  key=key if impl != "reference" else None,
                  build=None if impl == "reference" else
                  lambda: _prepare(q, kv_cache, block_table, head_dim_v, indices, num_splits, impl, k_descale,
                                   kv_format))


class SparsePrefillOutput(NamedTuple):
    """``mla_sparse_prefill``'s result."""

    out: torch.Tensor  # [s_q, h_q, head_dim_v], q's dtype
    max_logits: torch.Tensor  # [s_q, h_q] fp32: the largest softmax_scale · q·k a query sees
    lse: torch.Tensor  # [s_q, h_q] fp32: natural-log log-sum-exp of those scaled scores


def mla_sparse_prefill_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, head_dim_v: int,
                           softmax_scale: float, topk_length: torch.Tensor | None, num_splits: int,
                           impl: str, out_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager body of ``mla_sparse_prefill`` on validated inputs: ``(out, max_logits, lse)``, out in q's dtype
    (float32 with ``out_fp32``).

    Each query token is one entry of ``mla_decode``'s sparse batch (``s_q = 1``) over ``kv`` as a cache of one-token
    pages: its indices are then the physical rows themselves, translated by ``sparse_rows`` (entries outside
    ``[0, s_kv)`` or past ``topk_length`` become -1) before the portable kernel runs. The kernel writes each split's
    largest score per row; the splits' maxima are reduced here (NaN propagating) when the plan splits."""
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    o_dtype = torch.float32 if out_fp32 else q.dtype
    if impl == "reference":
        o, mx, lse = mla_sparse_prefill_ref(q, kv, indices, head_dim_v, softmax_scale, topk_length)
        f32 = dict(device=q.device, dtype=torch.float32)
        return o.to(device=q.device, dtype=o_dtype), mx.to(**f32), lse.to(**f32)
    if s_q == 0 or s_kv == 0:  # no launch: no query, or no key for any query
        out = torch.zeros(s_q, h_q, head_dim_v, dtype=o_dtype, device=q.device)
        none = torch.full((s_q, h_q), float("-inf"), dtype=torch.float32, device=q.device)
        return out, none, none.clone()
    indices, topk_length = contiguous_indices(indices, topk_length)
    q, kv = unit_last_stride(q, kv)  # (a custom op's body is handed any strides)
    q4 = q.unsqueeze(1)  # [s_q, 1, h_q, D]: a batch of single-token queries
    cache = kv.unsqueeze(1)  # [s_kv, 1, 1, D]: pages of one token, so a page id is a row
    # the translation sees kv as one page of MAX_KEYS (>= s_kv) rows, so an entry in [0, s_kv) is its own row and
    # any other is -1, with a one-entry table whatever s_kv
    table = torch.zeros(1, 1, dtype=torch.int32, device=q.device).expand(s_q, 1)
    lengths = torch.full((s_q,), s_kv, dtype=torch.int32, device=q.device)
    rows = sparse_rows(indices, table, lengths, topk_length, page_size=MAX_KEYS, num_pages=1, causal=False)
    p = plan(q4, 1, s_kv, head_dim_v, topk, num_splits, "triton")
    S = p.num_splits
    out = empty(s_q, 1, h_q, head_dim_v, dtype=o_dtype, device=q.device)
    lse = empty(s_q, h_q, 1, dtype=torch.float32, device=q.device)
    mx = empty(s_q, S, 1, h_q, dtype=torch.float32, device=q.device)
    if S > 1:
        o_part = empty(s_q, S, 1, h_q, head_dim_v, dtype=torch.float32, device=q.device)
        lse_part = empty(s_q, S, 1, h_q, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = out.new_empty(1, 1, 1, 1), lse.new_empty(1, 1, 1)
    unit = mla_decode_triton(q4, cache, table, lengths, rows, topk_length, head_dim_v, softmax_scale * _LOG2E, False,
                             True, p, out, lse, o_part, lse_part, max_logits=mx)
    if S > 1:
        combine_splits(o_part, lse_part, out, lse, unit=unit)
    return out[:, 0], (mx[:, 0, 0] if S == 1 else mx[:, :, 0].amax(1)), lse[..., 0]


@torch.library.custom_op("gqla_triton::mla_sparse_prefill", mutates_args=())
def _mla_sparse_prefill_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, head_dim_v: int,
                           softmax_scale: float, topk_length: torch.Tensor | None, num_splits: int,
                           impl: str, out_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # a direct torch.ops call reaches here unchecked: the public function's checks (kept per call), but for the
    # strides the body copies (mla_sparse_prefill_fwd)
    key = call_key((q, kv, indices, topk_length), (head_dim_v, softmax_scale, num_splits, impl))
    if _PREFILL_CHECKED.get(key) is None:
        _PREFILL_CHECKED.put(key, _validate_prefill(q, kv, indices, head_dim_v, softmax_scale, topk_length,
                                                    num_splits, impl, any_strides=True))
    return mla_sparse_prefill_fwd(q, kv, indices, head_dim_v, softmax_scale, topk_length, num_splits, impl, out_fp32)


@_mla_sparse_prefill_op.register_fake
def _(q, kv, indices, head_dim_v, softmax_scale, topk_length, num_splits, impl, out_fp32=False):
    s_q, h_q, _ = q.shape
    return (q.new_empty(s_q, h_q, head_dim_v, dtype=torch.float32 if out_fp32 else q.dtype),
            q.new_empty(s_q, h_q, dtype=torch.float32),
            q.new_empty(s_q, h_q, dtype=torch.float32))


forward_only(_mla_sparse_prefill_op, "mla_sparse_prefill")


# the sparse prefill op's checked calls (``_common.memo``)
_PREFILL_CHECKED = CheckedCalls()


def _validate_prefill(q, kv, indices, head_dim_v, softmax_scale, topk_length, num_splits,
                      impl, any_strides: bool = False) -> tuple[float, str, int, int]:
    """Every check of ``mla_sparse_prefill`` (device values are never read); returns ``(softmax_scale, impl,
    num_splits, head_dim_v)``. ``any_strides``: kv's strides are not checked (the custom op's body copies a kv
    the kernel cannot read in place)."""
    impl = check_impl(impl, op="mla_sparse_prefill", gluon=False)
    dtypes = FLOAT_DTYPES + ((torch.float64,) if impl == "reference" else ())
    check_tensor("q", q, ndim=3, dtypes=dtypes)
    check_tensor("kv", kv, ndim=3, dtypes=dtypes)
    check_same_dtype(q=q, kv=kv)
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length)
    s_q, h_q, D = q.shape
    if h_q == 0 or D == 0:
        raise ValueError(f"q: expected at least one head of at least one channel, got shape {list(q.shape)}")
    if kv.shape[1] != 1:
        raise ValueError(f"kv: expected one latent head shared by every query head (dim 1 == 1), got shape "
                         f"{list(kv.shape)}")
    if kv.shape[2] != D:
        raise ValueError(f"kv: last dim {kv.shape[2]} != q's last dim {D}")
    if kv.stride(-1) != 1 and not any_strides:
        raise ValueError("kv: the last dimension must be contiguous (stride 1)")
    if impl != "reference" and not any_strides:
        check_rows_aligned("kv", kv)
    if kv.shape[0] > MAX_KEYS:
        raise ValueError(f"kv: at most {MAX_KEYS} rows (int32 row indices), got {kv.shape[0]}")
    check_tensor("indices", indices, shape=(s_q, 1, None), dtypes=INDEX_DTYPES)
    if not 1 <= indices.shape[-1] <= MAX_KEYS:
        raise ValueError(f"indices: topk (last dimension) must be in [1, {MAX_KEYS}], got {indices.shape[-1]}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, shape=(s_q,), dtypes=INDEX_DTYPES)
    head_dim_v = _check_head_dim_v(head_dim_v, D)
    scale = check_softmax_scale(softmax_scale, D ** -0.5)
    if impl != "reference":
        check_kernel_device(q.device, _PREFILL_REFERENCE, q.dtype)
    return scale, impl, check_num_splits(num_splits), head_dim_v


def mla_sparse_prefill(q, kv, indices, head_dim_v=512, softmax_scale=None, topk_length=None, num_splits=0, *,
                       impl="auto", out_dtype=None) -> SparsePrefillOutput:
    """Sparse MLA prefill (DeepSeek sparse attention): every query token attends to its own top-k rows of a
    latent key/value tensor. Forward only; no host sync (CUDA-graph safe).

    Args:
        q: ``[s_q, h_q, D]`` bf16/fp16/fp32, ``D = r + d_R`` (latent first, then rope; 512 + 64, or 512 alone).
        kv: ``[s_kv, 1, D]``, q's dtype, unit stride along D: one latent row per token, shared by every head;
            the value of a row is its first ``head_dim_v`` channels.
        indices: ``[s_q, 1, topk]`` int32 rows of ``kv`` per query token. An entry outside ``[0, s_kv)`` (-1
            included) selects nothing; a duplicated one counts once per occurrence. Any value is safe.
        head_dim_v: value width (default 512).
        softmax_scale: a finite real number; default ``D ** -0.5``.
        topk_length: optional ``[s_q]`` int32: only the first ``topk_length[i]`` entries of row i count (clamped
            to ``[0, topk]``).
        num_splits: int in ``[0, 1024]``, the split count of each query's rows; 0 = chosen from shapes (one split
            once the query tokens fill the GPU).
        impl: ``"auto"`` / ``"triton"`` (the portable kernel of ``mla_decode``, which writes max_logits) or
            ``"reference"`` (``mla_sparse_prefill_ref``, any device, float64 too).
        out_dtype: None (q's dtype) or, for a 16-bit q, torch.float32 (out not rounded; as ``mla_decode``'s).

    Returns:
        ``SparsePrefillOutput(out [s_q, h_q, head_dim_v] in q's dtype (``out_dtype``), max_logits [s_q, h_q] fp32,
        lse [s_q, h_q] fp32)``: the largest scaled score ``softmax_scale · q·k`` and the natural-log log-sum-exp over
        the keys a query sees. A query that sees no key gets ``out = 0`` and ``max_logits = lse = -inf``; NaN and
        inf follow IEEE arithmetic over the keys a query sees (a NaN score makes its out, max_logits and lse NaN).
    """
    scale, impl, num_splits, head_dim_v = _validate_prefill(q, kv, indices, head_dim_v, softmax_scale, topk_length,
                                                            num_splits, impl)
    out_fp32 = _wants_fp32(out_dtype, q.dtype)
    fn = _mla_sparse_prefill_op if requires_grad(q, kv) else route(_mla_sparse_prefill_op, mla_sparse_prefill_fwd)
    return SparsePrefillOutput(*fn(q, kv, indices, head_dim_v, scale, topk_length, num_splits, impl, out_fp32))
