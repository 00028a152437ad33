"""FlashMLA's interface over ``mla_decode`` and ``mla_sparse_prefill``: ``get_mla_metadata``,
``flash_mla_with_kvcache``, ``FlashMLASchedMeta`` and ``flash_mla_sparse_fwd`` with FlashMLA's signatures and
conventions, so code written against FlashMLA runs here by changing its import.

Where FlashMLA's conventions differ from ``mla_decode``'s, these functions follow FlashMLA:

- sparse ``indices`` are physical cache rows (``page · page_size + offset``), not logical positions;
  ``block_table`` and ``cache_seqlens`` may then be None, and ``causal`` must be False. An entry of -1, or one
  outside the cache, selects nothing;
- a query that sees no key gets ``lse = +inf`` (``mla_decode``: ``-inf``) and ``out = 0``;
- ``attn_sink [h_q]`` (fp32) scales each output row by ``1 / (1 + exp(attn_sink - lse))``; lse is returned without
  it;
- ``extra_k_cache`` with ``extra_indices_in_kvcache`` (and ``extra_topk_length``): tokens of a second cache that
  every query attends to as well; the two caches' results are merged by their lse (``combine_splits``);
- ``tile_scheduler_metadata`` (from ``get_mla_metadata``) records the first call's configuration, and a later call
  with another one is a ``ValueError``, as FlashMLA asserts; the split plan here comes from shapes alone, so it
  carries nothing else. ``num_splits`` is FlashMLA's placeholder and must be None.

``flash_mla_sparse_fwd`` (sparse prefill) follows the same conventions: -1 or a row outside ``kv`` selects
nothing, lse is ``+inf`` (and max_logits ``-inf``) for a query that sees no key, and ``attn_sink`` scales out only.

sgl-flash-mla's additions are taken too: ``get_mla_decoding_metadata`` (its two tensors are placeholders here, since
the split plan comes from shapes), ``is_fp8_kvcache=None`` (told by the cache's dtype), ``enable_batch_invariant``
(every call unsplit, so a sequence's result does not depend on the rest of its batch), ``use_legacy`` (one kernel
family here: it only tells a 528-byte cache's layout, as below), ``kv_format`` and its layouts, and its dense FP8 path:
a float8_e4m3fn q and cache of 576 channels scaled per tensor by ``descale_q`` / ``descale_k`` (vLLM's
``kv_cache_dtype="fp8"``), out in bfloat16. The quantised layouts (``fp8.py``) are told by the row width: 656 bytes
per token V3.2, 584 V4 (MODEL1), 288 V4.1 fp4, and 528 either V4.1 or V3.2 without rope, which ``kv_format`` ("V32",
"V32_NO_ROPE", "V4", "V41", "V41_FP4") names; without it 528 bytes are V4.1 (upstream FlashMLA's rule, and
sgl-flash-mla's current kernels) or, with ``use_legacy=True``, V3.2 without rope (sgl-flash-mla's legacy kernels). ``extra_k_cache`` takes ``k_cache``'s layout where
its width is that layout's, else the layout of its width (a V4.1 fp4 extra cache beside a V4.1 one).

Beyond FlashMLA: sparse calls take a bf16 / fp16 cache as well as the FP8 one, dense calls the FP8 one as well as
bf16 / fp16; ``is_fp8_kvcache`` must say which the cache is; the sparse prefill takes any head count and width
``mla_sparse_prefill`` takes. Forward only, CUDA-graph safe (no host sync).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .._common import combine_splits
from .._common.alloc import empty
from .._common.boundary import route
from .._common.validation import (
    MAX_KEYS,
    check_choice,
    check_flag,
    check_scale,
    check_tensor,
    forward_only,
    requires_grad,
)
from .api import default_out_dtype, mla_decode, mla_sparse_prefill
from .fp8 import ROW_BYTES, fp8_layout, is_fp8_latent

__all__ = ["FlashMLASchedMeta", "flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_decoding_metadata",
           "get_mla_metadata"]

_LOG2E = 1.4426950408889634
# FlashMLA's kv_format names -> fp8.py's layouts
FLASH_MLA_KV_FORMATS = {"V32": "v32", "V32_NO_ROPE": "v32_no_rope", "V4": "model1", "V41": "v41", "V41_FP4": "v41_fp4"}


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The scheduling record of ``flash_mla_with_kvcache`` (FlashMLA's name): empty until the first call, which
    stores its configuration in ``config``; every later call on it must have the same one."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None
        enable_batch_invariant: bool = False

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: torch.Tensor | None = None  # sgl-flash-mla's fields: kept, never read here
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """A new, empty ``FlashMLASchedMeta`` and None (FlashMLA's return value). The arguments of FlashMLA's older
    interface (``cache_seqlens``, ``num_q_tokens_per_head_k``, ``num_heads_k``, ...) are accepted and unused."""
    return FlashMLASchedMeta(), None


def get_mla_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False, topk=None,
                              use_legacy=False) -> tuple[torch.Tensor, torch.Tensor]:
    """sgl-flash-mla's precomputed split metadata: ``(tile_scheduler_metadata [0, 8] int32, num_splits [B + 1]
    int32)`` on ``seqlens_k``'s device, placeholders that code may assign onto a ``FlashMLASchedMeta``; the split
    plan here comes from shapes alone, so they carry nothing. ``seqlens_k [B]`` int32 is checked, never read."""
    check_tensor("seqlens_k", seqlens_k, ndim=1, dtypes=(torch.int32,))
    check_flag("is_fp8_kvcache", is_fp8_kvcache)
    check_flag("use_legacy", use_legacy)
    dev = seqlens_k.device
    return (torch.zeros(0, 8, dtype=torch.int32, device=dev),
            torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=dev))


def _check_meta(meta, config: FlashMLASchedMeta.Config) -> None:
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata: expected the FlashMLASchedMeta of get_mla_metadata(), got "
                        f"{type(meta).__name__}")
    if meta.have_initialized and not isinstance(meta.config, FlashMLASchedMeta.Config):
        raise ValueError(f"tile_scheduler_metadata: have_initialized is set but no configuration is recorded (config "
                         f"{meta.config!r}); use a new get_mla_metadata()")
    if meta.have_initialized and meta.config != config:
        changed = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(meta.config, f.name)]
        raise ValueError(f"tile_scheduler_metadata: recorded for another configuration (differs in {changed}); "
                         "use one get_mla_metadata() per configuration")


@contextlib.contextmanager
def _flashmla_names(**ours: str):
    """A ``TypeError`` / ``ValueError`` raised inside names FlashMLA's arguments (``ours``: our name -> FlashMLA's),
    not the names of the op this module calls."""
    try:
        yield
    except (TypeError, ValueError) as e:
        msg = str(e)
        for name, theirs in ours.items():
            msg = msg.replace(name, theirs)
        raise type(e)(msg) from None


def _identity_table(B: int, num_blocks: int, page: int, device: torch.device):
    """Block table and lengths under which a logical position is the physical cache row: page p maps to page p,
    every sequence holds the whole cache. The table is one row expanded over the batch (batch stride 0), which the
    kernels read as it is (``contiguous_indices``)."""
    table = torch.arange(num_blocks, dtype=torch.int32, device=device).expand(B, num_blocks)
    return table, torch.full((B,), num_blocks * page, dtype=torch.int32, device=device)


def _layouts(k_cache, extra_k_cache, kv_format, use_legacy: bool) -> tuple[str | None, str | None]:
    """The ``fp8.py`` layouts of the two caches (module docstring; None: not quantised, or told by the row width)."""
    if kv_format is not None:
        check_choice("kv_format", kv_format, FLASH_MLA_KV_FORMATS, optional=True)
        if not is_fp8_latent(k_cache):
            raise ValueError(f"kv_format: names the layout of a quantised k_cache (uint8 / float8_e4m3fn), got "
                             f"{kv_format!r} with a {k_cache.dtype} cache")
        main = FLASH_MLA_KV_FORMATS[kv_format]
        if ROW_BYTES[main] != k_cache.shape[-1]:
            raise ValueError(f"kv_format: {kv_format!r} is a layout of {ROW_BYTES[main]} bytes per token, got "
                             f"k_cache of last dim {k_cache.shape[-1]}")
    else:
        legacy_528 = use_legacy and is_fp8_latent(k_cache) and k_cache.shape[-1] == ROW_BYTES["v32_no_rope"]
        main = "v32_no_rope" if legacy_528 else None  # else told by the width (528 bytes: V4.1)
    extra = None
    if extra_k_cache is not None and is_fp8_latent(extra_k_cache):
        like = main or fp8_layout(k_cache)
        extra = like if like is not None and ROW_BYTES[like] == extra_k_cache.shape[-1] else None
    return main, extra


def _one_cache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, topk_length,
               name: str, num_splits: int = 0, q_descale=None, k_descale=None, kv_format=None, out_dtype=None):
    """``mla_decode`` of one cache (``name``: its argument name), dense or with physical-row ``indices``; the
    descales: the dense FP8 path's; ``kv_format``: its ``fp8.py`` layout; ``out_dtype``: ``mla_decode``'s."""
    h_k = k_cache.shape[2] if k_cache.dim() == 4 else 0
    if h_k == 0 or (h_k > 1 and indices is not None):
        raise ValueError(f"{name}: expected [num_blocks, page_block_size, h_k, head_dim] (sparse calls: one latent "
                         f"head, h_k 1), got {list(k_cache.shape)}{' with indices' if indices is not None else ''}")
    if not k_cache.shape[0] or not k_cache.shape[1]:
        raise ValueError(f"{name}: expected at least one block of at least one token, got {list(k_cache.shape)}")
    if indices is None:
        if block_table is None or cache_seqlens is None:
            raise ValueError("block_table and cache_seqlens: required without indices (dense attention)")
        if q.shape[2] % h_k:
            raise ValueError(f"q: h_q={q.shape[2]} must be a multiple of k_cache's h_k={h_k} (query head i attends "
                             f"to cache head i // (h_q / h_k))")
        g = q.shape[2] // h_k
        with _flashmla_names(q_descale="descale_q", k_descale="descale_k", kv_cache=name):
            # one mla_decode per cache head over its group of query heads (views: no copies)
            parts = [mla_decode(q[:, :, j * g:(j + 1) * g], k_cache[:, :, j:j + 1], block_table, cache_seqlens,
                                head_dim_v, softmax_scale, causal, num_splits=num_splits, q_descale=q_descale,
                                k_descale=k_descale, kv_format=kv_format, out_dtype=out_dtype) for j in range(h_k)]
        if h_k == 1:
            return parts[0]
        return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 1)
    for arg, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):  # unused by sparse calls
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}: expected None or a tensor (unused with indices), got {type(t).__name__}")
    if k_cache.shape[0] * k_cache.shape[1] > MAX_KEYS:  # the sparse rows address the whole cache as one sequence
        raise ValueError(f"{name}: {k_cache.shape[0]} x {k_cache.shape[1]} token rows, more than the {MAX_KEYS} that "
                         "sparse indices may address")
    table, lengths = _identity_table(q.shape[0], k_cache.shape[0], k_cache.shape[1], q.device)
    with _flashmla_names(kv_cache=name):
        return mla_decode(q, k_cache, table, lengths, head_dim_v, softmax_scale, False, indices, topk_length,
                          num_splits, kv_format=kv_format, out_dtype=out_dtype)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, enable_batch_invariant=False, use_legacy=False, kv_format=None,
                           descale_q=None, descale_k=None):
    """FlashMLA's ``flash_mla_with_kvcache`` (module docstring for its conventions).

    Args:
        q: ``[B, s_q, h_q, 576]`` (512 latent + 64 rope; other ``mla_decode`` widths too).
        k_cache: ``[num_blocks, page_block_size, h_k, 576]`` in q's dtype (dense calls: query head i attends to cache
            head ``i // (h_q / h_k)``; sparse calls take h_k 1), or FlashMLA's FP8 layout
            ``[num_blocks, page_block_size, 1, 656]`` (``is_fp8_kvcache=True``), or (q of 512 channels) its V3.2
            rows without rope ``[..., 528]``, or (sparse, q of 512 channels) its V4 (MODEL1), V4.1 and V4.1 fp4
            pages ``[..., 584 | 528 | 288]``, or (dense, with ``descale_k``) a
            float8_e4m3fn cache ``[num_blocks, page_block_size, 1, 576]`` scaled per tensor.
        block_table: ``[B, max_blocks]`` int32, or None with ``indices``.
        cache_seqlens: ``[B]`` int32, or None with ``indices``.
        head_dim_v: 512.
        tile_scheduler_metadata: the ``FlashMLASchedMeta`` of ``get_mla_metadata()``.
        num_splits: None.
        softmax_scale: default ``q.shape[-1] ** -0.5``.
        causal: dense only; query ``j`` sits at ``cache_seqlens - s_q + j``.
        is_fp8_kvcache: whether ``k_cache`` (and ``extra_k_cache``) hold an FP8 layout; None: told by the dtype.
        indices: ``[B, s_q, topk]`` int32 physical cache rows (sparse); -1 selects nothing.
        attn_sink: ``[h_q]`` float32 or None.
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length: a second cache and its rows ``[B, s_q,
            extra_topk]`` (sparse only).
        topk_length: ``[B]`` int32: only the first ``topk_length[b]`` entries of each row count.
        enable_batch_invariant: every call unsplit (recorded in the metadata like the shapes).
        use_legacy: tells a 528-byte cache without ``kv_format`` (V3.2 without rope; else V4.1).
        kv_format: FlashMLA's name of ``k_cache``'s layout ("V32", "V32_NO_ROPE", "V4", "V41", "V41_FP4") or None.
        descale_q, descale_k: float32 ``[1]`` (or ``[B]``) on q's device: the dense FP8 path, a float8_e4m3fn
            ``k_cache`` of q's width scaled per tensor (key = ``descale_k · row``) and a float8_e4m3fn q
            (``descale_q · q``; a bf16 q takes descale_k alone); ``mla_decode``'s ``q_descale`` / ``k_descale``.

    Returns:
        ``out [B, s_q, h_q, head_dim_v]`` in q's dtype (bfloat16 for a float8 q) and ``lse [B, h_q, s_q]`` fp32
        (``+inf`` for a query that sees no key).
    """
    if num_splits is not None:
        raise ValueError("num_splits: must be None (FlashMLA's placeholder; the split plan here comes from shapes)")
    check_tensor("q", q, ndim=4)
    check_tensor("k_cache", k_cache, ndim=4)
    causal = check_flag("causal", causal)
    is_fp8 = is_fp8_latent(k_cache) if is_fp8_kvcache is None else check_flag("is_fp8_kvcache", is_fp8_kvcache)
    invariant = check_flag("enable_batch_invariant", enable_batch_invariant)
    legacy = check_flag("use_legacy", use_legacy)
    sparse = indices is not None
    if (descale_q is not None or descale_k is not None) and (sparse or extra_k_cache is not None):
        raise ValueError("descale_q / descale_k: the dense FP8 path's (a float8 cache scaled per tensor); sparse "
                         "calls read FlashMLA's FP8 layouts, which carry their own scales")
    extra = extra_k_cache is not None
    if causal and sparse:
        raise ValueError("causal: must be False with indices (FlashMLA's sparse attention has no causal mask)")
    if not sparse and (attn_sink is not None or extra or extra_indices_in_kvcache is not None
                       or topk_length is not None or extra_topk_length is not None):
        raise ValueError("attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length and extra_topk_length: "
                         "must be None without indices (dense attention)")
    if extra != (extra_indices_in_kvcache is not None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache: give both or neither")
    if extra_topk_length is not None and not extra:
        raise ValueError("extra_topk_length: given without extra_k_cache (it limits the extra cache's index rows)")
    B, s_q = q.shape[:2]
    if sparse:
        check_tensor("indices", indices, shape=(B, s_q, None), dtypes=(torch.int32,))
    if extra:
        check_tensor("extra_k_cache", extra_k_cache, ndim=4)
        check_tensor("extra_indices_in_kvcache", extra_indices_in_kvcache, shape=(B, s_q, None), dtypes=(torch.int32,))
    for name, cache in (("k_cache", k_cache), ("extra_k_cache", extra_k_cache)):
        if cache is not None and is_fp8_latent(cache) != is_fp8:
            raise ValueError(f"{name}: is_fp8_kvcache={is_fp8} but the cache is "
                             f"{'' if is_fp8_latent(cache) else 'not '}FlashMLA's FP8 layout ({cache.dtype}, "
                             f"last dim {cache.shape[-1]})")
    _check_sink(attn_sink, q.shape[2], q.device)
    layout, extra_layout = _layouts(k_cache, extra_k_cache, kv_format, legacy)
    config = FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal, is_fp8,
        indices.shape[-1] if sparse else None, extra_k_cache.shape[1] if extra else None,
        extra_indices_in_kvcache.shape[-1] if extra else None, invariant)
    _check_meta(tile_scheduler_metadata, config)

    splits = 1 if invariant else 0
    # with a second key set or a sink, out stays in float32 until both are applied and is rounded once at the end
    wide = torch.float32 if extra or attn_sink is not None else None
    out, lse = _one_cache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices,
                          topk_length, "k_cache", splits, descale_q, descale_k, layout, out_dtype=wide)
    if extra:
        try:
            out2, lse2 = _one_cache(q, extra_k_cache, None, None, head_dim_v, softmax_scale, False,
                                    extra_indices_in_kvcache, extra_topk_length, "extra_k_cache", splits,
                                    kv_format=extra_layout, out_dtype=wide)
        except (TypeError, ValueError) as e:  # mla_decode names its own arguments: say which cache they are
            raise type(e)(f"extra_k_cache / extra_indices_in_kvcache / extra_topk_length: {e}") from None
        merge = _merge_op if requires_grad(q, k_cache, extra_k_cache) else route(_merge_op, _merge)
        out, lse = merge(out, lse, out2, lse2)  # the op is forward-only: a backward through it raises
    if attn_sink is not None:
        out = _sink(out, lse.transpose(1, 2), attn_sink)
    if wide is not None:
        out = out.to(default_out_dtype(q))
    # once the state is checked and the call made, as FlashMLA's own record is set by its first call
    if not tile_scheduler_metadata.have_initialized:
        tile_scheduler_metadata.config = config
        tile_scheduler_metadata.have_initialized = True
    return out, torch.where(lse == float("-inf"), float("inf"), lse)


def _merge(out, lse, out2, lse2):
    """The attention over two key sets from each one's ``(out [B, s_q, h_q, D], lse [B, h_q, s_q])``, out in out's
    dtype (float32 here: the one rounding comes after the merge), both contiguous whatever the inputs' strides."""
    merged = empty(out.shape, dtype=out.dtype, device=out.device)
    merged_lse = empty(lse.shape, dtype=lse.dtype, device=lse.device)
    combine_splits(torch.stack((out, out2), 1).float(), torch.stack((lse, lse2), 1).transpose(2, 3).contiguous(),
                   merged, merged_lse)
    return merged, merged_lse


@torch.library.custom_op("gqla_triton::flash_mla_merge_caches", mutates_args=())
def _merge_op(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor,
              lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _merge(out, lse, out2, lse2)


@_merge_op.register_fake
def _(out, lse, out2, lse2):
    return out.new_empty(out.shape), lse.new_empty(lse.shape)


forward_only(_merge_op, "flash_mla_with_kvcache")


def _check_sink(attn_sink, h_q: int, device: torch.device) -> None:
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, shape=(h_q,), dtypes=(torch.float32,))
        if attn_sink.device != device:
            raise ValueError(f"attn_sink: expected a tensor on {device}, got {attn_sink.device}")


def _sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    """``out [..., h_q, d_v] · 1 / (1 + exp(sink - lse))`` in float32 (``out`` float32, not yet rounded) for lse
    ``[..., h_q]`` (-inf: no key); a query with no key keeps out 0 (with a -inf sink too, where the factor would be
    NaN)."""
    keep = torch.sigmoid(lse - attn_sink).masked_fill(lse == float("-inf"), 0.0)
    return out * keep[..., None]


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False,
                         return_log2_lse=None):
    """FlashMLA's sparse prefill ``flash_mla_sparse_fwd`` over ``mla_sparse_prefill``.

    Args:
        q: ``[s_q, h_q, d_qk]`` (FlashMLA: bf16, h_q 64 or 128, d_qk 512 or 576; here any ``mla_sparse_prefill``
            takes).
        kv: ``[s_kv, 1, d_qk]``, q's dtype.
        indices: ``[s_q, 1, topk]`` int32 rows of kv; -1 or a row ``>= s_kv`` selects nothing.
        sm_scale: the softmax scale (a finite real number; None: ``d_qk ** -0.5``).
        d_v: value width, the first ``d_v`` channels of a row (FlashMLA: 512).
        attn_sink: ``[h_q]`` float32 or None: out is multiplied by ``1 / (1 + exp(attn_sink - lse))`` (-inf: no
            effect, +inf: out 0); max_logits and lse are not.
        topk_length: ``[s_q]`` int32 or None: only the first ``topk_length[i]`` entries of row i count.
        use_legacy: accepted for sgl-flash-mla's signature; there is one kernel here, so it changes nothing.
        return_log2_lse: sgl-flash-mla's option: None (default) returns max_logits and lse in natural-log units,
            False returns None for both, True returns both in base 2.

    Returns:
        ``(out [s_q, h_q, d_v] in q's dtype, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)``; a query that sees
        no key gets out 0, max_logits -inf and lse +inf.
    """
    check_flag("use_legacy", use_legacy)
    if return_log2_lse is not None:
        return_log2_lse = check_flag("return_log2_lse", return_log2_lse)
    check_tensor("q", q, ndim=3)
    if q.shape[-1] == 0:
        raise ValueError(f"q: expected a head dim d_qk >= 1, got shape {list(q.shape)}")
    _check_sink(attn_sink, q.shape[1], q.device)
    sm_scale = check_scale("sm_scale", sm_scale, q.shape[-1] ** -0.5, factor=_LOG2E)
    with _flashmla_names(head_dim_v="d_v"):
        out, max_logits, lse = mla_sparse_prefill(q, kv, indices, d_v, sm_scale, topk_length,
                                                  out_dtype=None if attn_sink is None else torch.float32)
    if attn_sink is not None:  # rounded once, after the sink
        out = _sink(out, lse, attn_sink).to(q.dtype)
    if return_log2_lse is False:
        return out, None, None
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    if return_log2_lse:
        return out, max_logits * _LOG2E, lse * _LOG2E
    return out, max_logits, lse
