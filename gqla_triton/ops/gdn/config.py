"""Launch-config schemas of the Gated DeltaNet kernels (``gdn_chunk``, ``gdn_decode``).

Chunk fields are ``<stage>_<field>``, one stage per kernel: ``wy`` (the WY inverse), ``wu`` (w and u),
``state`` (the sequential state pass), ``sout`` (the forward's state pass that also forms the output), ``seg``
(per-segment state maps for sequence splitting), ``out`` (output), ``dvl`` (the local dv term), ``state_bwd``,
``grad`` and ``wy_bwd`` (backward). ``bk`` / ``bv`` are tile widths along K / V, ``num_warps`` / ``num_stages``
Triton's launch options.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from .._common.config import WARPS, KernelConfig

__all__ = ["WY_BWD_TILES", "ChunkConfig", "DecodeConfig"]

_POW2 = (16, 32, 64, 128, 256)
WY_BWD_TILES = (32, 64, 128, 256)  # wy_bwd tile widths along K and V: never 16 (see ChunkConfig.check)


@dataclasses.dataclass(frozen=True)
class ChunkConfig(KernelConfig):
    """``gdn_chunk``. ``wy_prec``: dot precision of the merges of the 16x16 diagonal-block inverses, ``"ieee"``
    (fp32 FMA) or ``"tf32x3"`` (three tf32 tensor-core products, fp32-level accuracy). One tf32 product is not
    offered: on chunks of correlated keys its rounding leaves fp16 outputs 2-3x less accurate than torch at fp16.
    ``seg_units > 0`` splits sequences when there are fewer than ``seg_below`` (sequence x value head) units, into
    about ``seg_units`` units of at least ``seg_min`` chunks each, so the sequential state passes run on more SMs. ``*_trans``: a term of dk taken as a
    transposed dot result. ``*_early``: the loads that follow a kernel's K / V loop are issued before it.
    ``*_late``: in the GVA sums of dq / dk the later value heads wait for the earlier ones' running sum after
    their other work, while the first passes its sum on before it. ``sout_chunks`` / ``sout_waves``: a forward
    without gradient runs as ``wy`` and one sequential pass forming w and u's products, the state and the output
    (``sout``: no w, u, h or v_new round trip through HBM) when no state program has more than ``sout_chunks``
    chunks and there are at most ``sout_waves`` of them per SM: it adds the products of ``wu`` and ``out`` to
    sequential programs, which pays where they are short or many. ``sout_impl`` ``"gluon"``: on sm_90, inputs the
    warp-specialised kernel takes (``kernels/state_out_sm90.py``: bf16, K 128, chunk 64, V a multiple of 32) run
    ``sout`` there, for any length (its output products leave the state's chain), in V blocks of up to
    ``sout_gluon_bv`` (32, 64 or 128, narrowed as the portable kernel's), blocks at least ``sout_gluon_split`` wide
    (64 or 128; 0: none) in the split-chain kernel (``kernels/state_out_sm90_wide.py``: the state and v_new in
    warpgroups of their own, which a V block of 128 needs), with ``sout_gluon_stages_v32`` / ``_v64`` / ``_v128``
    ring stages (1-3; 1-2 at 128) at V blocks of 32 / 64 / 128, where the call has at least
    ``sout_gluon_units`` (chunk x value head) units: its launch costs the host more than the portable kernel's,
    which outweighs the GPU time it saves on the smallest calls (on the H200, an eager 512-token chunk of 32 value
    heads). Other calls run the portable kernel under the rule above."""

    OP: ClassVar[str] = "gdn_chunk"
    MATCH: ClassVar[dict] = {"K": int, "V": int}

    wy_bk: int = 64
    wy_num_warps: int = 4
    wy_num_stages: int = 3
    wy_prec: Literal["ieee", "tf32x3"] = "ieee"
    wu_bk: int = 64
    wu_bv: int = 64
    wu_num_warps: int = 8
    wu_num_stages: int = 3
    state_bv: int = 32
    state_num_warps: int = 8
    state_num_stages: int = 2
    sout_chunks: int = 0
    sout_waves: int = 2
    sout_bv: int = 32
    sout_impl: Literal["triton", "gluon"] = "triton"
    sout_gluon_units: int = 0
    sout_num_warps: int = 8
    sout_num_stages: int = 3
    sout_gluon_bv: int = 64
    sout_gluon_split: int = 0
    sout_gluon_stages_v32: int = 2
    sout_gluon_stages_v64: int = 2
    sout_gluon_stages_v128: int = 2
    seg_units: int = 0
    seg_below: int = 16
    seg_min: int = 16
    seg_bv: int = 64
    seg_num_warps: int = 4
    seg_num_stages: int = 2
    out_bk: int = 64
    out_bv: int = 64
    out_num_warps: int = 8
    out_num_stages: int = 2
    out_early: bool = False
    dvl_bk: int = 64
    dvl_bv: int = 64
    dvl_num_warps: int = 8
    dvl_num_stages: int = 2
    dvl_early: bool = False
    state_bwd_bv: int = 32
    state_bwd_num_warps: int = 8
    state_bwd_num_stages: int = 2
    grad_bv: int = 16
    grad_num_warps: int = 8
    grad_num_stages: int = 2
    grad_trans: bool = False
    grad_early: bool = False
    grad_late: bool = False
    wy_bwd_bk: int = 32
    wy_bwd_bv: int = 32
    wy_bwd_num_warps: int = 8
    wy_bwd_num_stages: int = 1
    wy_bwd_trans: bool = False
    wy_bwd_late: bool = False

    def check(self) -> None:
        names = self.field_names()
        self.one_of([n for n in names if n.endswith(("_bk", "_bv"))], _POW2)
        # 16-wide tiles in wy_bwd miscompile on sm_90 (Triton 3.6): along K when the value heads sum dk (HV > H),
        # along V in its dv loop (V <= 16): out-of-range shared-memory addresses, run-to-run different results; the
        # launcher runs such head dims as masked 32-wide tiles
        self.one_of(("wy_bwd_bk", "wy_bwd_bv"), WY_BWD_TILES)
        # wy_bwd's loops each feed several dots; software-pipelined (3 stages) on sm_90 under Triton 3.6 its first K
        # loop's k kᵀ (KK, which only dg and dbeta use) differed from call to call (B4 T2048 H8 K=V=64 fp16: dg
        # 1.4e-2 to 2.2e-2 from float64 against 1.7e-3 in one stage; dq, dk, dv unaffected), so it runs unpipelined
        self.within("wy_bwd_num_stages", 1, 1)
        self.one_of([n for n in names if n.endswith("_num_warps")], WARPS)
        self.within([n for n in names if n.endswith("_num_stages")], 1, 6)
        self.within(("seg_units", "seg_below", "seg_min", "sout_chunks", "sout_waves", "sout_gluon_units"), 0)
        # the Gluon ring's stages and the kernel's other buffers fit 227 KB up to 3 (up to 2 at V blocks of 128)
        self.within(("sout_gluon_stages_v32", "sout_gluon_stages_v64"), 1, 3)
        self.within("sout_gluon_stages_v128", 1, 2)
        self.one_of("sout_gluon_bv", (32, 64, 128))
        self.one_of("sout_gluon_split", (0, 64, 128))
        if self.sout_gluon_bv == 128 and not self.sout_gluon_split:
            raise ValueError("gdn_chunk config: sout_gluon_bv 128 needs sout_gluon_split 64 or 128 (the single-chain "
                             "Gluon kernel takes V blocks of at most 64)")

    def launch(self, stage: str) -> dict:
        """Triton launch options of one stage."""
        return {"num_warps": getattr(self, f"{stage}_num_warps"), "num_stages": getattr(self, f"{stage}_num_stages")}


@dataclasses.dataclass(frozen=True)
class DecodeConfig(KernelConfig):
    """``gdn_decode``: the recurrent step's V tile and launch options."""

    OP: ClassVar[str] = "gdn_decode"
    MATCH: ClassVar[dict] = {"K": int, "V": int}

    bv: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def check(self) -> None:
        self.one_of("bv", _POW2)
        self.one_of("num_warps", WARPS)
        self.within("num_stages", 1, 6)
