"""Launch geometry of ``gqa_decode`` from shapes only (no device values).

One program serves one group's query heads (and, dense, all ``s_q`` query tokens folded into the rows) as tiles
of ``BLOCK_M >= 16`` rows; ``BLOCK_N`` keys per tile, halved until the pipelined K/V tiles fit the config's
shared-memory limit. Grid: (groups x row tiles, splits, batch entries (x query tokens, sparse)).
"""

from __future__ import annotations

import dataclasses

import torch

from ...dispatch import device_info, select_config
from .._common import cdiv, key_capacity, next_pow2, plan_splits
from .._common.host import MAX_GRID_Y
from .config import GQADecodeConfig

__all__ = ["GQAPlan", "fill", "plan", "shared_bytes"]


@dataclasses.dataclass(frozen=True)
class GQAPlan:
    cfg: GQADecodeConfig
    G: int  # query heads per group
    BLOCK_M: int
    BLOCK_N: int
    BDH: int
    BDR: int
    BDV: int
    num_warps: int
    num_mt: int  # row tiles per group
    nbq: int  # batch entries (dense) or batch entries x query tokens (sparse)
    num_splits: int


def shared_bytes(block_m: int, block_n: int, stages: int, bdh: int, bdr: int, bdv: int, elt: int) -> int:
    """An upper bound of the kernel's shared memory (bytes) at padded head dims ``bdh`` / ``bdr`` (rope, at least 16)
    / ``bdv``: the larger of its key loop's buffers (the pipelined K, rope and V tiles, the query tile) and its
    epilogue's (the fp32 accumulator's layout change beside the query tile)."""
    q_tile = block_m * (bdh + bdr) * elt
    return max(stages * block_n * (bdh + bdv + bdr) * elt + q_tile, block_m * bdv * 4 + q_tile)


def fill(entries: int, g: int, sm_count: int) -> int:
    """The table match key ``fill``: the (batch entry, group) pairs per SM, rounded up."""
    return cdiv(entries * g, max(1, sm_count))


def plan(q: torch.Tensor, g: int, page_size: int, max_pages: int, d_h: int, d_r: int, d_v: int, topk: int | None,
         num_splits: int) -> GQAPlan:
    """Geometry for ``q [B, s_q, h_q, d_h + d_r]`` over ``g`` groups; ``topk``: the index row length (sparse) or
    None (dense); ``num_splits`` 0: planned here."""
    B, s_q, h_q, _ = q.shape
    G = h_q // g
    sparse = topk is not None
    rows = G if sparse else G * s_q
    info = device_info(q)
    nbq = B * s_q if sparse else B
    key = {"sparse": sparse, "G": G, "rows": rows, "d_h": d_h, "d_r": d_r, "d_v": d_v,
           "fill": fill(nbq, g, info.sm_count)}
    cfg = select_config("gqa_decode", key, info=info)
    block_m = min(cfg.max_m, max(16, next_pow2(rows)))
    block_n = cfg.block_n
    bdh, bdr, bdv = (next_pow2(d) for d in (d_h, d_r, d_v))
    elt = 4 if q.dtype == torch.float32 else 2
    # keep the pipelined K/V tiles within the shared-memory limit (d_R excluded: zero-rope == plain GQA)
    while block_n > 16 and cfg.num_stages * block_n * (bdh + bdv + 64) * elt + block_m * (bdh + 64) * elt > cfg.smem:
        block_n //= 2
    # ... and every buffer within the GPU's block (fp32 rows of 256 channels past 99 KB): fewer rows per tile, then
    # fewer pipeline stages
    smem = info.smem_per_block

    def need(bm):
        return shared_bytes(bm, block_n, cfg.num_stages, bdh, max(bdr, 16), bdv, elt)

    while need(block_m) > smem and (block_m > 16 or cfg.num_stages > 1):
        if block_m > 16:
            block_m //= 2
        else:
            cfg = cfg.replace(num_stages=cfg.num_stages - 1)
    if need(block_m) > smem:
        raise ValueError(f"q / v_cache: head dims d_h {d_h}, d_r {d_r}, d_v {d_v} in {q.dtype} need {need(block_m)} "
                         f"bytes of shared memory at the smallest tiles, more than this GPU's {smem}")
    warps = cfg.num_warps
    if block_m * bdv > cfg.acc_elems_4w:  # fp32 accumulator too large for 4 warps
        warps = max(warps, 8)
    num_mt = cdiv(rows, block_m)
    if nbq > MAX_GRID_Y:  # the grid's third dimension
        raise ValueError(f"q: batch {B}{f' x {s_q} query tokens (sparse)' if sparse else ''} = {nbq} exceeds "
                         f"the {MAX_GRID_Y} sequences one launch takes")
    if num_splits == 0:
        num_splits = plan_splits(nbq * g * num_mt, key_capacity(max_pages, page_size, topk),
                                 info.sm_count, block_n=block_n, waves=cfg.waves)
    return GQAPlan(cfg, G, block_m, block_n, bdh, max(bdr, 16), bdv, warps, num_mt, nbq, num_splits)
