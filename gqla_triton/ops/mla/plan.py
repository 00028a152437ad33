"""Launch geometry of ``mla_decode`` from shapes only (no device values), shared by both kernels.

A row tile folds ``HPT`` query heads and ``QPT`` query tokens (token major) into ``BLOCK_H`` rows, so both
products of the decode run on tensor cores. Sparse tiles hold one query token (each token has its own index
row). The grid is (batch entry x split) x (head tiles x token tiles).
"""

from __future__ import annotations

import dataclasses

import torch

from ...dispatch import device_info, select_config
from .._common import cdiv, key_capacity, next_pow2, plan_splits
from .config import MLADecodeConfig

__all__ = ["MLAPlan", "config_key", "plan"]


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


def plan(q: torch.Tensor, page_size: int, max_pages: int, head_dim_v: int, topk: int | None, num_splits: int,
         impl: str) -> MLAPlan:
    """Geometry for ``q [B, s_q, h_q, D]`` over a cache of ``page_size``-token pages and a ``max_pages``-column
    block table; ``topk``: the index row length (sparse) or None (dense); ``num_splits`` 0: planned here."""
    B, s_q, h_q, _ = q.shape
    sparse = topk is not None
    cfg = select_config("mla_decode", config_key(q, head_dim_v, sparse, impl), device=q.device)
    if impl == "gluon" and cfg.impl != "gluon":  # a table with no Gluon entry (an explicit impl="gluon"): its geometry
        cfg = cfg.replace(**GLUON_GEOMETRY)
    HPT = min(h_q, cfg.block_h)
    QPT = 1 if sparse else max(1, min(s_q, cfg.block_h // HPT))
    BLOCK_H = max(16, next_pow2(HPT * QPT))
    h_tiles = cdiv(h_q, HPT)
    q_tiles = cdiv(s_q, QPT)
    if num_splits == 0:
        num_splits = plan_splits(B * h_tiles * q_tiles, key_capacity(max_pages, page_size, topk),
                                 device_info(q.device).sm_count, block_n=cfg.block_n, split_cost=cfg.split_cost)
    # the portable kernel's grid is (B · splits, row tiles): CUDA allows 65535 along its second dimension
    if impl == "triton" and h_tiles * q_tiles > 65535:
        raise ValueError(f"q: {s_q} query tokens x {h_q} heads make {h_tiles * q_tiles} row tiles of at most "
                         f"{HPT * QPT} rows, more than one launch takes (65535)")
    return MLAPlan(cfg, HPT, QPT, BLOCK_H, h_tiles, q_tiles, num_splits)
