"""Public ``gqa_decode`` (GQLA grouped path / GQA decode): validation, the ``torch.library`` op and the eager
launcher that allocates the outputs, runs the kernel and merges the splits."""

from __future__ import annotations

import torch

from .._common import (
    FLOAT_DTYPES,
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
from .._common.boundary import runner
from .._common.impl import check_impl
from .._common.memo import CheckedCalls, call_key
from .._common.validation import (
    check_flag,
    check_num_splits,
    check_rows_aligned,
    contiguous_indices,
    forward_only,
    requires_grad,
    unit_last_stride,
)
from .plan import GQAPlan, plan
from .reference import gqa_decode_reference
from .triton import gqa_decode_triton

__all__ = ["gqa_decode", "gqa_decode_fwd"]

_LOG2E = 1.4426950408889634
_REFERENCE = "gqla_triton.ops.gqa.reference.gqa_decode_reference"


def gqa_decode_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   cache_seqlens: torch.Tensor, k_rope_cache: torch.Tensor | None, softmax_scale: float, causal: bool,
                   indices: torch.Tensor | None, topk_length: torch.Tensor | None, num_splits: int,
                   impl: str, prepared: GQAPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager body of ``gqa_decode`` on validated inputs (``impl`` "auto", "triton" or "reference", ``softmax_scale``
    a float; ``prepared``: ``_prepare``'s plan for these inputs, None: formed here). Returns ``(out [B, s_q, h_q,
    d_v] q.dtype, lse [B, h_q, s_q] fp32)``."""
    if impl == "reference":
        o, lse = gqa_decode_reference(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale,
                                      causal, indices, topk_length)
        return o.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=torch.float32)
    block_table, cache_seqlens, indices, topk_length = contiguous_indices(block_table, cache_seqlens, indices,
                                                                          topk_length)
    # the kernel takes every stride but the last (a custom op's body is handed any strides)
    q, k_cache, v_cache, k_rope_cache = unit_last_stride(q, k_cache, v_cache, k_rope_cache)
    B, s_q, h_q, _ = q.shape
    num_pages, page_size = k_cache.shape[:2]
    d_v = v_cache.shape[-1]
    sparse = indices is not None
    p = prepared or _prepare(q, k_cache, v_cache, block_table, k_rope_cache, indices, num_splits)
    S = p.num_splits
    out = empty(B, s_q, h_q, d_v, device=q.device, dtype=q.dtype)
    lse = empty(B, h_q, s_q, device=q.device, dtype=torch.float32)
    if S > 1:
        o_part = empty(B, S, s_q, h_q, d_v, device=q.device, dtype=torch.float32)
        lse_part = empty(B, S, s_q, h_q, device=q.device, dtype=torch.float32)
    else:  # placeholders the kernel never touches
        o_part, lse_part = out, lse
    rows_src = (sparse_rows(indices, block_table, cache_seqlens, topk_length, page_size=page_size,
                            num_pages=num_pages, causal=causal) if sparse else None)
    unit = gqa_decode_triton(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, rows_src, topk_length,
                             softmax_scale * _LOG2E, causal, p, out, lse, o_part, lse_part)
    if S > 1:
        combine_splits(o_part, lse_part, out, lse, unit=unit)
    return out, lse


def _prepare(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
             k_rope_cache: torch.Tensor | None, indices: torch.Tensor | None, num_splits: int) -> GQAPlan:
    """The kernel's plan, from the inputs' metadata and this GPU's table."""
    _, page_size, g, d_h = k_cache.shape
    d_r = 0 if k_rope_cache is None else k_rope_cache.shape[-1]
    return plan(q, g, page_size, block_table.shape[1], d_h, d_r, v_cache.shape[-1],
                None if indices is None else indices.shape[-1], num_splits)


@torch.library.custom_op("gqla_triton::gqa_decode", mutates_args=())
def _gqa_decode_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cache_seqlens: torch.Tensor, k_rope_cache: torch.Tensor | None, softmax_scale: float, causal: bool,
    indices: torch.Tensor | None, topk_length: torch.Tensor | None, num_splits: int, impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # a direct torch.ops call reaches here unchecked: the public function's checks (kept per call), but for the
    # strides the body copies (gqa_decode_fwd)
    _checked(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal, indices,
             topk_length, num_splits, impl, any_strides=True)
    return gqa_decode_fwd(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal,
                          indices, topk_length, num_splits, impl)


@_gqa_decode_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal, indices,
      topk_length, num_splits, impl):
    B, s_q, h_q, _ = q.shape
    return q.new_empty(B, s_q, h_q, v_cache.shape[-1]), q.new_empty(B, h_q, s_q, dtype=torch.float32)


forward_only(_gqa_decode_op, "gqa_decode")


def check_head_dims(d_h: int, d_v: int, d_r: int, *, names=("d_h", "d_v", "d_R"), rope: bool = True) -> None:
    """The head dims the kernels take: d_h and d_v positive multiples of 16 up to 256, the shared rope key's d_R a
    positive multiple of 16 up to 128 (``rope``: the call has one; else d_r is not looked at)."""
    for name, d in ((names[0], d_h), (names[1], d_v)):
        if d <= 0 or d % 16 != 0 or d > 256:
            raise ValueError(f"{name}: expected a positive multiple of 16 <= 256, got {d}")
    if rope and (d_r <= 0 or d_r % 16 != 0 or d_r > 128):
        raise ValueError(f"{names[2]} must be a positive multiple of 16 <= 128, got {d_r}")


def _validate(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal, indices,
              topk_length, num_splits, impl, any_strides: bool = False) -> tuple[float, str, bool, int]:
    """Every check of ``gqa_decode`` (device values are never read); returns ``(softmax_scale, impl, causal,
    num_splits)`` as the kernel takes them. ``any_strides``: the last strides and row alignment are not checked
    (the custom op's body copies what the kernel cannot read in place)."""
    impl = check_impl(impl, op="gqa_decode", gluon=False)
    dtypes = FLOAT_DTYPES + ((torch.float64,) if impl == "reference" else ())
    check_tensor("q", q, ndim=4, dtypes=dtypes)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes)
    num_pages, page_size, g, d_h = k_cache.shape
    check_tensor("v_cache", v_cache, shape=(num_pages, page_size, g, None), dtypes=dtypes)
    if k_rope_cache is not None:
        check_tensor("k_rope_cache", k_rope_cache, shape=(num_pages, page_size, None), dtypes=dtypes)
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k_rope_cache=k_rope_cache)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, k_rope_cache=k_rope_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens, indices=indices, topk_length=topk_length)
    if impl != "reference":
        check_kernel_device(q.device, _REFERENCE, q.dtype)
    d_v = v_cache.shape[-1]
    d_r = 0 if k_rope_cache is None else k_rope_cache.shape[-1]
    names = ("d_h (k_cache.shape[-1])", "d_v (v_cache.shape[-1])", "k_rope_cache: rope dim d_R")
    if impl != "reference":
        check_head_dims(d_h, d_v, d_r, names=names, rope=k_rope_cache is not None)
    else:  # the torch reference takes any widths
        for name, d in zip(names, (d_h, d_v, d_r if k_rope_cache is not None else 1), strict=True):
            if d <= 0:
                raise ValueError(f"{name}: expected a positive width, got {d}")
    if g == 0:
        raise ValueError("k_cache: number of groups g (dim 2) must be >= 1")
    if q.shape[-1] != d_h + d_r:
        raise ValueError(f"q: last dim must be d_h + d_R = {d_h} + {d_r} = {d_h + d_r}, got {q.shape[-1]}")
    if q.shape[2] == 0 or q.shape[2] % g != 0:
        raise ValueError(f"q: h_q = {q.shape[2]} must be a positive multiple of the number of groups g = {g}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_rope_cache", k_rope_cache)):
        if any_strides:
            continue
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride 1)")
        if name != "q" and impl != "reference":
            check_rows_aligned(name, t)
    scale = check_softmax_scale(softmax_scale, q.shape[-1] ** -0.5)
    check_decode_inputs(q, block_table, cache_seqlens, num_pages=num_pages, page_size=page_size,
                        indices=indices, topk_length=topk_length, num_groups=g, num_splits=num_splits,
                        cache_name="k_cache")
    return scale, impl, check_flag("causal", causal), check_num_splits(num_splits)


def gqa_decode(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache=None, softmax_scale=None, causal=True,
               indices=None, topk_length=None, num_splits=0, *, impl="auto"):
    """Paged GQA / GQLA grouped-path decode attention, dense or sparse top-k. Forward only.

    Args:
        q: ``[B, s_q, h_q, d_h + d_R]`` (bf16 / fp16 / fp32); head ``i`` uses group ``i // (h_q / g)``.
        k_cache: ``[num_pages, page_size, g, d_h]`` per-group keys (no rope part); page_size % 16 == 0 (any size for
            sparse calls).
        v_cache: ``[num_pages, page_size, g, d_v]`` per-group values. The kernel takes d_h and d_v multiples of 16
            up to 256 and d_R a multiple of 16 up to 128; ``impl="reference"`` any widths.
        block_table: ``[B, max_pages]`` int32 (``max_pages · page_size <= 2**30``); token ``p`` of sequence ``b``
            lives in page ``block_table[b, p // page_size]``. Entries outside ``[0, num_pages)`` are never read
            through.
        cache_seqlens: ``[B]`` int32 cached tokens per sequence (0 or negative = empty: out 0, lse -inf). Any value
            is safe: positions past the block table (``>= max_pages · page_size``) hold no key, so a longer length
            attends to the table's keys (query positions still follow ``cache_seqlens``).
        k_rope_cache: ``[num_pages, page_size, d_R]`` rope key stored once for all groups, or None (plain
            GQA, d_R = 0).
        softmax_scale: a finite real number; default ``(d_h + d_R) ** -0.5``.
        causal: query ``j`` sits at position ``cache_seqlens - s_q + j`` and sees keys up to it.
        indices: sparse top-k, ``[B, s_q, topk]`` int32 logical positions shared by all groups, or
            ``[B, s_q, g, topk]`` one set per group. Entries that are -1, outside ``[0, cache_seqlens)``,
            past the block table (``>= max_pages · page_size``, or on an invalid page), (causal) after the
            query's position, or beyond ``topk_length`` are ignored, never clamped onto a key. Duplicates count
            as many times as they appear (exactly like gathering the selected keys, then attending).
        topk_length: ``[B]`` int32; only the first ``topk_length[b]`` entries of each index row count.
        num_splits: int in ``[0, 1024]``, the split-KV count; 0 = chosen from shapes only (no host sync;
            CUDA-graph safe).
        impl: ``"auto"`` or ``"triton"`` (the Triton kernel), ``"reference"`` (``gqa_decode_reference``, any
            device, float64 too); ``"gluon"`` is a ValueError (this op has no Gluon kernel).

    Returns:
        ``out [B, s_q, h_q, d_v]`` in q's dtype and ``lse [B, h_q, s_q]`` fp32 (natural log). A query
        that sees no key (or only ``-inf`` scores) gives ``out = 0``, ``lse = -inf``. NaN / inf follow IEEE
        arithmetic over the keys a query sees and reach no other query: a NaN in q or in a key it sees makes its
        out and lse NaN, a NaN in a value it sees that column of its out (``reference.py`` defines it all).

    Inputs that require grad are accepted, but a backward through the outputs raises (no gradient is defined).
    """
    key, scale, impl, causal, num_splits = _checked(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache,
                                                    softmax_scale, causal, indices, topk_length, num_splits, impl)
    fn = _runner(key, q, k_cache, v_cache, block_table, k_rope_cache, indices, num_splits, impl)
    return fn(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, scale, causal, indices, topk_length,
              num_splits, impl)


# gqa_decode's checked calls (``_common.memo``)
_CHECKED = CheckedCalls()


def _checked(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal, indices,
             topk_length, num_splits, impl, any_strides: bool = False) -> tuple:
    """``_validate`` remembered by the call's metadata (``_common.memo``): (the call's key or None, softmax_scale,
    impl, causal, num_splits) as the kernel takes them. ``any_strides``: as ``_validate``'s (the custom op's
    body)."""
    key = call_key((q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, indices, topk_length),
                   (softmax_scale, causal, num_splits, impl, any_strides))
    checked = _CHECKED.get(key)
    if checked is None:
        checked = _validate(q, k_cache, v_cache, block_table, cache_seqlens, k_rope_cache, softmax_scale, causal,
                            indices, topk_length, num_splits, impl, any_strides)
        _CHECKED.put(key, checked)
    scale, impl, causal, num_splits = checked
    if type(softmax_scale) is float:  # its own checked value (0.0 and -0.0 share a key)
        scale = softmax_scale
    return key, scale, impl, causal, num_splits


def _runner(key, q, k_cache, v_cache, block_table, k_rope_cache, indices, num_splits, impl):
    """What runs a checked call (``_checked``'s values; ``boundary.runner``): the plan is kept under ``key`` (any
    block table of the call's shape)."""
    return runner(_gqa_decode_op, gqa_decode_fwd, grad=requires_grad(q, k_cache, v_cache, k_rope_cache), memo=_CHECKED,
                  key=key if impl != "reference" else None,
                  build=None if impl == "reference" else
                  lambda: _prepare(q, k_cache, v_cache, block_table, k_rope_cache, indices, num_splits))
