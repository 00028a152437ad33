"""Launch geometry of ``mla_decode`` from shapes only (no device values), shared by both kernels.

A row tile folds ``HPT`` query heads and ``QPT`` query tokens (token major) into ``BLOCK_H`` rows, so both
products of the decode run on tensor cores. Sparse tiles hold one query token (each token has its own index
row). The grid is (batch entry x split) x (head tiles x token tiles). The portable kernel's tiles and stages are
cut where wide heads would take it past the GPU's shared memory (``shared_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...dispatch import device_info, select_config
from .._common import cdiv, key_capacity, next_pow2, plan_splits
from .._common.host import MAX_GRID_Y
from .config import MLADecodeConfig

__all__ = ["MLAPlan", "config_key", "plan", "shared_bytes"]


@dataclasses.dataclass(frozen=True)
class MLAPlan:
    cfg: MLADecodeConfig
    HPT: int  # query heads per row tile
    QPT: int  # query tokens per row tile
    BLOCK_H: int  # rows of the portable kernel's tile (power of two >= HPT·QPT; the Gluon kernel uses 64)
    h_tiles: int
    q_tiles: int
    num_splits: int


# the Gluon kernel's tiles where this GPU's table has no Gluon entry (its 64-row tiles, 64-key two-stage ring; the
# H200 table's fields without TMA)
GLUON_GEOMETRY = dict(impl="gluon", block_h=64, block_n=64, num_stages=2)


def config_key(q: torch.Tensor, head_dim_v: int, sparse: bool, impl: str) -> dict:
    """Match key of the ``mla_decode`` table; ``impl``: "triton" or "gluon"."""
    return {"D": q.shape[-1], "DV": head_dim_v, "sparse": sparse, "s_q": q.shape[1], "impl": impl,
            "fp32": q.dtype == torch.float32}


def shared_bytes(block_h: int, block_n: int, stages: int, head_dim_v: int, D: int, elt: int) -> int:
    """An upper bound of the portable kernel's shared memory (bytes) at ``block_h`` rows, ``block_n`` keys and
    ``stages`` pipeline stages, for ``D`` channels of which ``head_dim_v`` are values, ``elt`` bytes each: the
    larger of its key-loop buffers (the pipelined key tiles, the query tile, P) and its epilogue's (the fp32
    accumulator's layout change beside the query tile), as Triton 3.6-3.9 allocate them for sm_90."""
    bdv = max(16, next_pow2(head_dim_v))
    width = bdv + max(16, next_pow2(max(D - head_dim_v, 1)))
    loop = (max(stages, 1) * block_n + block_h) * width * elt + block_h * block_n * elt
    return max(loop, block_h * bdv * 4 + block_h * width * elt)


@functools.lru_cache(maxsize=256)
def _fit_shared(cfg: MLADecodeConfig, rows: int, head_dim_v: int, D: int, elt: int, smem: int) -> MLADecodeConfig:
    """The portable kernel's config with its pipeline stages, then its key tile, then its row tile cut until
    ``shared_bytes`` fits ``smem`` (wide heads: a table's tiles are chosen for 512 + 64 channels); a ``ValueError``
    where even one stage of 16 x 16 tiles does not."""
    def need(c):
        return shared_bytes(max(16, min(next_pow2(rows), c.block_h)), c.block_n, c.num_stages, head_dim_v, D, elt)

    for field in ("num_stages", "block_n", "block_h"):
        floor = 1 if field == "num_stages" else 16
        while need(cfg) > smem and getattr(cfg, field) > floor:
            cfg = cfg.replace(**{field: max(floor, getattr(cfg, field) // 2)})
    if need(cfg) > smem:
        raise ValueError(f"q: {D} channels (head_dim_v {head_dim_v}) need {need(cfg)} bytes of shared memory in the "
                         f"portable kernel's smallest tiles, more than this GPU's {smem}")
    return cfg


def plan(q: torch.Tensor, page_size: int, max_pages: int, head_dim_v: int, topk: int | None, num_splits: int,
         impl: str) -> MLAPlan:
    """Geometry for ``q [B, s_q, h_q, D]`` over a cache of ``page_size``-token pages and a ``max_pages``-column
    block table; ``topk``: the index row length (sparse) or None (dense); ``num_splits`` 0: planned here."""
    B, s_q, h_q, _ = q.shape
    sparse = topk is not None
    cfg = select_config("mla_decode", config_key(q, head_dim_v, sparse, impl), device=q)
    if impl == "gluon" and cfg.impl != "gluon":  # a table with no Gluon entry (an explicit impl="gluon"): its geometry
        cfg = cfg.replace(**GLUON_GEOMETRY)
    if impl != "gluon":  # the portable kernel runs: its tiles fit, whichever kernel the config names for "auto"
        rows = h_q if sparse else h_q * s_q
        cfg = _fit_shared(cfg.replace(impl="triton"), rows, head_dim_v, q.shape[-1], 4 if q.dtype == torch.float32 else 2,
                          device_info(q).smem_per_block)
    HPT = min(h_q, cfg.block_h)
    QPT = 1 if sparse else max(1, min(s_q, cfg.block_h // HPT))
    BLOCK_H = max(16, next_pow2(HPT * QPT))
    h_tiles = cdiv(h_q, HPT)
    q_tiles = cdiv(s_q, QPT)
    if num_splits == 0:
        num_splits = plan_splits(B * h_tiles * q_tiles, key_capacity(max_pages, page_size, topk),
                                 device_info(q).sm_count, block_n=cfg.block_n, split_cost=cfg.split_cost)
    # the portable kernel's grid is (B · splits, row tiles): the row tiles lie along its second dimension
    if impl == "triton" and h_tiles * q_tiles > MAX_GRID_Y:
        raise ValueError(f"q: {s_q} query tokens x {h_q} heads make {h_tiles * q_tiles} row tiles of at most "
                         f"{HPT * QPT} rows, more than one launch takes ({MAX_GRID_Y})")
    return MLAPlan(cfg, HPT, QPT, BLOCK_H, h_tiles, q_tiles, num_splits)
