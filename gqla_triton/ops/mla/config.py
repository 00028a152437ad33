"""Launch-config schema of ``mla_decode`` (absorb path)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from .._common.config import TILES, WARPS, KernelConfig
from .._common.split import SPLIT_COST

__all__ = ["MLADecodeConfig"]


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig(KernelConfig):
    """``impl``: the kernel ``impl="auto"`` runs where the inputs allow it (``"gluon"``: the warp-specialised
    Hopper kernel; ``"triton"``: the portable one). ``block_h`` rows (heads x query tokens) and ``block_n`` keys
    per tile. Triton kernel variants: ``paged_tiles`` (one block-table lookup per page-aligned tile),
    ``p_scratch`` (P and its row rescale pass between the warpgroups through a per-program scratch tile),
    ``rows_ahead`` (the next tile's cache rows are loaded one iteration ahead). The Gluon kernel takes 64-key tiles
    in a two-stage shared-memory ring (its P tile takes the consumed rope slab of a stage, and two stages with Q
    and the score exchange fill the 227 KB); ``block_h`` sets its heads per tile; ``tma`` (Gluon only): dense
    tiles that lie in one valid page with every key counting are copied by TMA (64 x 64 boxes) rather than
    ``cp.async`` (bf16 / fp16 caches whose pages are one row range, page size a multiple of 64); ``owner_scores``
    (Gluon only; bf16 / fp16 caches, row tiles of one query token: the launch keeps the split scores for FP8 caches
    and for causal tiles of several MTP tokens): one consumer warpgroup forms each tile's whole score product and
    the other only adds ``P·V``, so no partial scores are exchanged and the second warpgroup's products run beside
    the first's next scores. ``split_cost``:
    the split-KV planner's cost of one partial tile (its write and the combine's read), in units of one unsplit
    program (``plan_splits``)."""

    OP: ClassVar[str] = "mla_decode"
    MATCH: ClassVar[dict] = {"D": int, "DV": int, "sparse": bool, "s_q": int, "impl": Literal["triton", "gluon"],
                             "fp32": bool}

    impl: Literal["triton", "gluon"] = "triton"
    block_h: int = 32
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 1
    paged_tiles: bool = False
    p_scratch: bool = False
    rows_ahead: bool = False
    tma: bool = False
    owner_scores: bool = False
    split_cost: float = SPLIT_COST

    def check(self) -> None:
        self.within("split_cost", 0, 10)
        self.one_of(("block_h", "block_n"), TILES)
        self.one_of("num_warps", WARPS)
        self.within("num_stages", 1, 6)
        if self.impl == "gluon":
            self.one_of("block_n", (64,))
            self.one_of("num_stages", (2,))
