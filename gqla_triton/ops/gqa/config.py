"""Launch-config schema of ``gqa_decode`` (grouped path)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._common.config import TILES, WARPS, KernelConfig

__all__ = ["GQADecodeConfig"]


@dataclasses.dataclass(frozen=True)
class GQADecodeConfig(KernelConfig):
    """``block_n`` keys per tile (halved until the pipelined K/V tiles fit ``smem`` bytes), at most ``max_m``
    query rows per tile; ``acc_elems_4w``: largest fp32 accumulator (rows x d_v) run with 4 warps (larger ones
    take 8); ``waves``: split-KV aims at this many programs per SM. Match key ``fill``: the (sequence, group) pairs
    per SM, rounded up (1: one sequence's groups or a few sequences leave SMs idle before any split). Variants: ``paged`` (dense, block_n divides
    the page: one block-table lookup per tile), ``rows_ahead`` (sparse: the next tile's cache rows loaded one
    iteration ahead)."""

    OP: ClassVar[str] = "gqa_decode"
    MATCH: ClassVar[dict] = {"sparse": bool, "G": int, "rows": int, "d_h": int, "d_r": int, "d_v": int,
                             "fill": int}

    block_n: int = 64
    max_m: int = 64
    num_warps: int = 4
    num_stages: int = 2
    smem: int = 90000
    acc_elems_4w: int = 4096
    waves: int = 4
    paged: bool = False
    rows_ahead: bool = False

    def check(self) -> None:
        self.one_of(("block_n", "max_m"), TILES)
        self.one_of("num_warps", WARPS)
        self.within(("num_stages", "smem", "acc_elems_4w", "waves"), 1)
