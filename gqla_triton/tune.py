"""Per-GPU tuner: ``python -m gqla_triton.tune [--ops ...] [--budget-minutes N] [--out PATH] [--jobs N]
[--start table|default]``.

On the GPU it runs on, for each op it searches the launch-config fields of the table entries the standard workloads
select (coordinate descent from the start entry: one field, or one group of fields that move together, at a time
over its candidate values, the rest held; repeated while a pass improves, at most ``PASSES``), checks every
candidate against the float64 reference before it may win (a candidate that fails to compile, errs, is less accurate
than twice the start entry's error plus a small floor, or whose results differ between identical calls is dropped),
times the survivors on the standard workloads (decode steps in CUDA graphs), re-times the winner against the start
entry side by side, and measures both GQLA decode paths' steps for the path choice (``decode_path.POINTS``). It
writes a complete table (every op of the start one, the tuned entries replaced) that ``dispatch`` reads for this
GPU: by default into the user config directory (``GQLA_TRITON_CONFIG_DIR``, else ``~/.config/gqla_triton``), which
takes precedence over the shipped ``configs/<gpu>.json``, as ``<gpu>.json`` (``dispatch.gpu_table``: a GPU without
a shipped table writes one under its own name, not ``default.json``). Measurements, finished targets and the search
time spent go to ``<out>.partial.json`` as they are made, so an interrupted run resumes where it stopped, with what
is left of its ``--budget-minutes`` (a run after a finished one starts a new time limit and reuses the
measurements).

- A candidate's workloads are timed one by one; its timing stops once those timed show it cannot beat the best
  entry (``HOPELESS_SPEEDUP``), so a slow candidate costs little.

- The GDN op (eight kernels) judges a move within one stage (``wy_*``, ``wu_*``, ..., ``wy_bwd_*``) by that stage's
  kernels' GPU time (torch.profiler), the whole forward + backward only guarding against a loss elsewhere: a
  few per cent of one kernel is below the noise of the whole op.
- ``--budget-minutes`` bounds the search, shared among the targets by their number of candidates (the best so far
  is kept when a target's share runs out).
- ``--jobs N`` compiles candidates in N worker processes before they are timed one by one here (Triton's on-disk
  cache hands the kernels over): first every target's start entry and its one-move changes in one wave (at most
  0.4 of the time limit), then, each time a target's best entry changes, the configs one move away from the new
  one along the fields its pass has still to try (the next pass compiles the others); the timing waits for a wave
  (at most 180 s), so no worker shares the GPU with a measurement.
- ``--start default`` searches from ``configs/default.json`` (the table of GPUs without one of their own) instead
  of this GPU's table and times this GPU's shipped entry beside the winner: whether the search finds a table as
  good as the shipped one from scratch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import dispatch, roofline
from .dispatch import user_config_dir
from .ops._common.validation import check_choice, check_int_in, check_positive_real

__all__ = ["Target", "targets", "tune", "user_config_dir", "main"]


@dataclass
class Target:
    """One table entry to tune: ``op``'s entry whose ``match`` equals ``key``; ``calls`` build the timed calls of
    the standard workloads (each returns a no-argument callable), ``check`` runs a small case under the active
    config and returns its relative error against float64; ``space`` maps fields to candidate values (a key
    ``"a+b"`` moves fields together: its values are ``(a, b)`` tuples)."""

    op: str
    key: dict
    calls: list[Callable[[], Callable[[], Any]]]
    check: Callable[[], float]
    space: dict[str, tuple]
    graph: bool = True  # time in a CUDA graph (decode) or eagerly (the chunked GDN forward + backward)
    name: str = field(default="")
    # op made of several kernels: config-field prefix -> the names of the kernels those fields launch. A move of
    # fields of one stage is then judged by the GPU time of that stage's kernels (a few per cent of one kernel
    # is far below the noise of the whole op's time), the whole time only guarding against a loss elsewhere
    stages: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)  # fields the target's kernel takes at one value only

    def stage_kernels(self, key: str) -> tuple[str, ...]:
        """The kernels of the one stage every field of space entry ``key`` belongs to (empty: none, or several)."""
        found = set()
        for f in key.split("+"):
            pre = max((p for p in self.stages if f.startswith(p + "_")), key=len, default=None)
            if pre is None:
                return ()
            found.add(pre)
        return self.stages[found.pop()] if len(found) == 1 else ()

    def label(self) -> str:
        return self.name or f"{self.op} {json.dumps(self.key, sort_keys=True)}"


# ------------------------------------------------------------------------------------------------ timing
def _time_ms(fn: Callable[[], Any], graph: bool) -> float:
    if dispatch.is_interpreter():  # the CPU interpreter: one wall-clock call (what tests of the tuner need)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    fn()
    torch.cuda.synchronize()
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _repeatable(run: Callable[[], list[torch.Tensor]], times: int = 3) -> list[torch.Tensor]:
    """``run()``'s results, after checking that ``times`` identical calls give bitwise-equal results (the kernels
    checked here promise that): a config whose results change from call to call is miscompiled or racy (Triton 3.6
    on Hopper can miscompile pipelined loops) and raises."""
    first = [t.detach().clone() for t in run()]
    for _ in range(times - 1):
        again = run()
        if any(not torch.equal(a, b) for a, b in zip(first, again, strict=True)):
            raise RuntimeError("results differ between identical calls (a miscompiled or racy config)")
    return first


# decode batches where split-KV decides the time (a few sequences, long caches), timed beside the standard
# workloads so that the split planner's fields (mla_decode split_cost, gqa_decode waves) are tuned where they act
SPLIT_REGIME = ((1, 4096), (1, 32768), (8, 8192), (16, 2048))
SPLIT_COSTS = (0.02, 0.05, 0.1, 0.2, 0.5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------------- targets
def _dev() -> str:
    return "cpu" if dispatch.is_interpreter() else "cuda"


def _lowp() -> torch.dtype:
    return torch.float16 if dispatch.is_interpreter() else torch.bfloat16


def _combine_target(tiny: bool) -> Target:
    from .ops._common.combine import combine_splits

    def case(B, S, Q, H, D):
        def build():
            o = torch.randn(B, S, Q, H, D, device=_dev())
            lse = torch.randn(B, S, Q, H, device=_dev())
            out = torch.empty(B, Q, H, D, device=_dev(), dtype=_lowp())
            lo = torch.empty(B, H, Q, device=_dev())
            return lambda: combine_splits(o, lse, out, lo)
        return build

    def check() -> float:
        o = torch.randn(2, 3, 1, 4, 32, device=_dev())
        lse = torch.randn(2, 3, 1, 4, device=_dev())
        out = torch.empty(2, 1, 4, 32, device=_dev())
        lo = torch.empty(2, 4, 1, device=_dev())
        combine_splits(o, lse, out, lo)
        w = torch.softmax(lse.double(), 1)[..., None]
        return _rel(out, (w * o.double()).sum(1))

    # large batches (tiles at their largest) and single sequences of many splits (tiles shrunk to fill the GPU)
    shapes = [(2, 2, 1, 4, 32)] if tiny else [(128, 4, 1, 128, 512), (32, 16, 2, 128, 128), (1, 64, 1, 128, 128),
                                               (1, 32, 1, 128, 512)]
    return Target("combine", {}, [case(*s) for s in shapes], check,
                  {"elems": (1024, 2048, 4096), "min_elems": (64, 128, 256), "waves": (1, 2, 4),
                   "step_elems": (4096, 8192, 16384), "num_warps": (2, 4, 8)})


def _gdn_inputs(B, T, H, HV, K, V, dtype, seed=0):
    """Random GDN inputs drawn on the device (G1's 270M values drawn on the CPU would cost each candidate seconds,
    and each single-threaded compile worker far more)."""
    dev = _dev()
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, HV, V)
    gate = torch.nn.functional.logsigmoid(rnd(B, T, HV)) / 8
    beta = torch.sigmoid(rnd(B, T, HV))
    return [t.to(dtype if i < 3 else torch.float32) for i, t in enumerate((q, k, v, gate, beta))]


def _gdn_decode_target(tiny: bool) -> Target:
    from .ops.gdn import gated_delta_rule_decode
    from .ops.gdn.reference import recurrent_gated_delta_rule_ref

    B, HV, H, K = (2, 2, 1, 16) if tiny else (256, 32, 16, 128)

    def build():
        x = _gdn_inputs(B, 1, H, HV, K, K, _lowp())
        pool = torch.randn(B, HV, K, K, device=_dev())
        return lambda: gated_delta_rule_decode(*x, pool)

    def check() -> float:
        x = _gdn_inputs(2, 1, 1, 2, K, K, _lowp(), seed=1)
        s0 = torch.randn(2, 2, K, K, device=_dev()) * 0.1
        pool = s0.clone()
        o = gated_delta_rule_decode(*x, pool)
        ref, _ = recurrent_gated_delta_rule_ref(*(t.double().cpu() for t in x), initial_state=s0.double().cpu(),
                                                output_final_state=True)
        return _rel(o, ref)

    return Target("gdn_decode", {}, [build], check, {"bv": (16, 32, 64, 128), "num_warps": (1, 2, 4, 8),
                                                      "num_stages": (1, 2)})


def _gdn_chunk_target(tiny: bool) -> Target:
    from .ops.gdn import chunk_gated_delta_rule
    from .ops.gdn.reference import recurrent_gated_delta_rule_ref

    K = 16 if tiny else 128
    shapes = [(1, 80, 1, 2)] if tiny else [(w["B"], w["T"], w["H"], w["HV"]) for n, w in
                                          roofline.GDN_WORKLOADS.items() if n in ("G1", "G3", "G5")]

    def case(B, T, H, HV):
        def build():
            x = [t.requires_grad_() for t in _gdn_inputs(B, T, H, HV, K, K, _lowp())]
            do = torch.randn(B, T, HV, K, device=_dev(), dtype=_lowp())

            def step():
                o, _ = chunk_gated_delta_rule(*x, output_final_state=True)
                torch.autograd.grad(o, x, do)
            return step
        return build

    def grads_of(x):
        def run():
            o, _ = chunk_gated_delta_rule(*x, output_final_state=True)
            return [o, *torch.autograd.grad(o.float().square().sum(), x)]
        return run

    def check() -> float:
        if not tiny:  # a race in a pipelined loop shows with hundreds of programs in flight, not with a few
            _repeatable(grads_of([t.requires_grad_() for t in _gdn_inputs(4, 1024, 8, 8, K, K, _lowp(), seed=3)]))
        x = [t.requires_grad_() for t in _gdn_inputs(1, 150, 1, 2, K, K, _lowp(), seed=2)]
        o, *grads = _repeatable(grads_of(x))
        x64 = [t.detach().double().cpu().requires_grad_() for t in x]
        r, _ = recurrent_gated_delta_rule_ref(*x64, output_final_state=True)
        refs = torch.autograd.grad(r.square().sum(), x64)
        return max([_rel(o, r)] + [_rel(a, b) for a, b in zip(grads, refs, strict=True)])

    space: dict[str, tuple] = {"wy_prec": ("ieee", "tf32x3"), "seg_units": (0, 32, 64, 128)}
    for stage, bk, bv in (("wy", (32, 64), ()), ("wu", (32, 64), (32, 64)), ("state", (), (32, 64)),
                          ("out", (), (64, 128)), ("dvl", (), (64, 128)), ("state_bwd", (), (32, 64)),
                          ("grad", (), (16, 32, 64)), ("wy_bwd", (32, 64), (32, 64))):
        warps = (1, 4, 8) if stage == "wy" else (4, 8)
        tile = f"{stage}_bv" if bv else f"{stage}_bk"
        if bk and bv:
            space[f"{stage}_bk"] = bk
        # a tile width and the warps that hold it move together (either alone can be a worse local step)
        space[f"{tile}+{stage}_num_warps"] = tuple(itertools.product(bv or bk, warps))
        space[f"{stage}_num_stages"] = (1,) if stage == "wy_bwd" else (1, 2, 3)  # ChunkConfig.check says why
    for flag in ("out_early", "dvl_early", "grad_early", "grad_late", "grad_trans", "wy_bwd_late", "wy_bwd_trans"):
        space[flag] = (False, True)
    stages = {"wy": ("gdn_wy_fwd_kernel",), "wu": ("gdn_wu_fwd_kernel",),
              "state": ("gdn_state_fwd_kernel",), "out": ("gdn_output_fwd_kernel",), "dvl": ("gdn_dv_local_kernel",),
              "state_bwd": ("gdn_state_bwd_kernel",), "grad": ("gdn_grad_chunk_kernel",),
              "wy_bwd": ("gdn_wy_bwd_kernel",)}
    return Target("gdn_chunk", {}, [case(*s) for s in shapes], check, space, graph=False, stages=stages)


def _paged(B, S, page, width, dtype, groups=None):
    pages = B * (-(-S // page))
    bt = torch.randperm(pages).to(torch.int32).view(B, -1).to(_dev())
    lens = torch.full((B,), S, dtype=torch.int32, device=_dev())
    shape = (pages, page, 1, width) if groups is None else (pages, page, groups, width)
    return bt, lens, torch.randn(*shape, device=_dev(), dtype=dtype)


def _mla_targets(tiny: bool, hopper: bool) -> list[Target]:
    from .ops.mla import mla_decode, mla_decode_ref

    r, dr, hq, page = (32, 16, 16, 16) if tiny else (512, 64, 128, 64)

    def case(B, S, topk, impl):
        def build():
            bt, lens, kv = _paged(B, S, page, r + dr, _lowp())
            q = torch.randn(B, 1, hq, r + dr, device=_dev(), dtype=_lowp())
            idx = torch.randint(0, S, (B, 1, topk), device=_dev(), dtype=torch.int32) if topk else None
            return lambda: mla_decode(q, kv, bt, lens, r, indices=idx, impl=impl)
        return build

    def checker(sparse, impl):
        def check() -> float:
            bt, lens, kv = _paged(2, 300 if not tiny else 40, page, r + dr, _lowp())
            q = torch.randn(2, 2, hq, r + dr, device=_dev(), dtype=_lowp())
            idx = torch.randint(-5, 320, (2, 2, 64), device=_dev(), dtype=torch.int32) if sparse else None
            out = _repeatable(lambda: [mla_decode(q, kv, bt, lens, r, indices=idx, impl=impl)[0]])[0]
            ref, _ = mla_decode_ref(q.double().cpu(), kv.double().cpu(), bt.cpu(), lens.cpu(), r,
                                    indices=None if idx is None else idx.cpu())
            return _rel(out, ref)
        return check

    work = {n: w for n, w in roofline.MLA_WORKLOADS.items() if w["s_q"] == 1}
    dense = [(2, 40, 0)] if tiny else [(w["batch"], w["seqlen"], 0) for n, w in work.items() if "topk" not in w]
    dense += [] if tiny else [(b, s, 0) for b, s in SPLIT_REGIME]
    sparse = [(2, 40, 16)] if tiny else [(w["batch"], w["seqlen"], w["topk"]) for w in work.values() if "topk" in w]
    tri = {"block_h+num_warps": tuple(itertools.product((32, 64), (4, 8))), "block_n": (32, 64),
           "num_stages": (1, 2, 3),
           "paged_tiles": (False, True), "p_scratch": (False, True), "rows_ahead": (False, True),
           "split_cost": SPLIT_COSTS}
    out = [Target("mla_decode", {}, [case(*s, "triton") for s in dense], checker(False, "triton"), tri,
                  name="mla_decode triton dense"),
           Target("mla_decode", {"sparse": True}, [case(*s, "triton") for s in sparse], checker(True, "triton"), tri,
                  name="mla_decode triton sparse")]
    if hopper:
        glu = {"block_h": (32, 64), "split_cost": SPLIT_COSTS}
        ring = {"block_n": 64, "num_stages": 2}  # the Gluon kernel's one key ring
        out += [Target("mla_decode", {"impl": "gluon"}, [case(*s, "gluon") for s in dense], checker(False, "gluon"),
                       glu, name="mla_decode gluon dense", fixed=ring),
                Target("mla_decode", {"impl": "gluon", "sparse": True}, [case(*s, "gluon") for s in sparse],
                       checker(True, "gluon"), glu, name="mla_decode gluon sparse", fixed=ring)]
    return out


def _gqa_targets(tiny: bool) -> list[Target]:
    from .ops.gqa import gqa_decode, gqa_decode_reference
    from .ops.gqa.plan import fill

    g, dh, dr, page = (2, 16, 16, 16) if tiny else (8, 128, 64, 64)
    hq = 16 * g

    def case(B, S, topk, hq=hq, dr=dr):
        def build():
            bt, lens, kc = _paged(B, S, page, dh, _lowp(), groups=g)
            vc = torch.randn_like(kc)
            kr = torch.randn(kc.shape[0], page, dr, device=_dev(), dtype=_lowp()) if dr else None
            q = torch.randn(B, 1, hq, dh + dr, device=_dev(), dtype=_lowp())
            idx = torch.randint(0, S, (B, 1, topk), device=_dev(), dtype=torch.int32) if topk else None
            return lambda: gqa_decode(q, kc, vc, bt, lens, kr, indices=idx)
        return build

    def checker(sparse, hq=hq, dr=dr, s_q=2):
        def check() -> float:
            bt, lens, kc = _paged(2, 300 if not tiny else 40, page, dh, _lowp(), groups=g)
            vc = torch.randn_like(kc)
            kr = torch.randn(kc.shape[0], page, dr, device=_dev(), dtype=_lowp()) if dr else None
            q = torch.randn(2, s_q, hq, dh + dr, device=_dev(), dtype=_lowp())
            idx = torch.randint(-5, 320, (2, 2, 64), device=_dev(), dtype=torch.int32) if sparse else None
            out = _repeatable(lambda: [gqa_decode(q, kc, vc, bt, lens, kr, indices=idx)[0]])[0]
            ref, _ = gqa_decode_reference(*(t.double().cpu() for t in (q, kc, vc)), bt.cpu(), lens.cpu(),
                                          k_rope_cache=None if kr is None else kr.double().cpu(),
                                          indices=None if idx is None else idx.cpu())
            return _rel(out, ref)
        return check

    work = [w for w in roofline.GQA_WORKLOADS.values() if w["s_q"] == 1 and "num_heads" not in w]
    dense = [(2, 40, 0)] if tiny else [(w["batch"], w["seqlen"], 0) for w in work if "topk" not in w]
    dense += [] if tiny else [(b, s, 0) for b, s in SPLIT_REGIME]
    sparse = [(2, 40, 16)] if tiny else [(w["batch"], w["seqlen"], w["topk"]) for w in work if "topk" in w]
    # smem first: it bounds the pipelined tiles the other fields can ask for
    space = {"smem": (90000, 160000, 220000), "block_n+num_warps": tuple(itertools.product((32, 64, 128), (4, 8))),
             "num_stages": (2, 3, 4), "waves": (1, 2, 4, 6, 8), "max_m": (32, 64), "paged": (False, True),
             "rows_ahead": (False, True)}
    # plain GQA with 4 query heads per group and one query token (no rope key: Q4's LLaMA layout) has an entry
    # of its own
    plain_hq = 4 * g
    plain = [(2, 40, 0)] if tiny else [(w["batch"], w["seqlen"], 0) for w in roofline.GQA_WORKLOADS.values()
                                       if w.get("rope_dim") == 0] + [(b, s, 0) for b, s in SPLIT_REGIME]
    # dense steps whose (sequence, group) pairs fill one or two programs per SM have entries of their own (match
    # key ``fill``, as ``gqa.plan`` forms it on this GPU)
    sm = dispatch.device_info().sm_count
    few = {} if tiny else {f: [s for s in dense if fill(s[0], g, sm) == f] for f in (1, 2)}
    many = [s for s in dense if not any(s in c for c in few.values())]
    return [Target("gqa_decode", {}, [case(*s) for s in many], checker(False), space, name="gqa_decode dense"),
            *(Target("gqa_decode", {"sparse": False, "rows": 16, "fill": f}, [case(*s) for s in c],
                     checker(False, s_q=1), space, name=f"gqa_decode dense fill {f}") for f, c in few.items() if c),
            Target("gqa_decode", {"sparse": False, "rows": 4, "d_r": 0}, [case(*s, hq=plain_hq, dr=0) for s in plain],
                   checker(False, hq=plain_hq, dr=0, s_q=1), space, name="gqa_decode plain"),
            Target("gqa_decode", {"sparse": True}, [case(*s) for s in sparse], checker(True), space,
                   name="gqa_decode sparse")]


def targets(ops: list[str] | None = None, *, tiny: bool | None = None) -> list[Target]:
    """The tuning targets of this machine (``tiny``: interpreter-sized workloads; default under the interpreter)."""
    info = dispatch.device_info()
    tiny = info.interpreter if tiny is None else tiny
    hopper = not info.interpreter and info.capability[0] == 9
    every = {"combine": lambda: [_combine_target(tiny)], "gdn_decode": lambda: [_gdn_decode_target(tiny)],
             "gdn_chunk": lambda: [_gdn_chunk_target(tiny)], "mla_decode": lambda: _mla_targets(tiny, hopper),
             "gqa_decode": lambda: _gqa_targets(tiny)}
    unknown = sorted(set(ops or ()) - set(every) - {"decode_path"})
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; choose from {sorted(every) + ['decode_path']}")
    return [t for op, make in every.items() if ops is None or op in ops for t in make()]


# ----------------------------------------------------------------------------------------------- search
def _check_partial(path: Path, old: dict) -> None:
    """The fields of a partial search file that a resumed run reads, of the types it reads them as."""
    kinds = {"measured": dict, "done": dict, "spent_s": (int, float), "runs": int, "start": str, "complete": bool}
    for name, kind in kinds.items():
        if name in old and (not isinstance(old[name], kind) or isinstance(old[name], bool) is not (kind is bool)):
            raise ValueError(f"{path}: an unreadable partial search ('{name}' is a {type(old[name]).__name__}); "
                             "remove it to start over")
    if not (all(isinstance(v, (dict, list)) for v in old.get("measured", {}).values())
            and all(isinstance(v, dict) for v in old.get("done", {}).values())):
        raise ValueError(f"{path}: an unreadable partial search (its records are not JSON objects); remove it to "
                         "start over")


def _check_done(path: Path, t: Target, row: dict) -> None:
    """A finished target's report row in a partial search file (``path``) as a resumed run reads it: its target's
    label, a config of the op's schema, finite times; a ``ValueError`` naming the file before any search."""
    def bad(why):
        raise ValueError(f"{path}: an unreadable partial search (target {t.label()!r}: {why}); remove it to start "
                         "over")

    if row.get("target") != t.label():
        bad(f"its row names {row.get('target')!r}")
    if "config" in row:
        if not isinstance(row["config"], Mapping):
            bad(f"its config is a {type(row['config']).__name__}")
        try:
            dispatch.schema(t.op).from_fields(row["config"], where=f" ({path})")
        except (TypeError, ValueError) as e:
            bad(str(e))
    for k in ("current_ms", "tuned_ms", "shipped_ms", "seconds", "wave_s"):
        v = row.get(k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            bad(f"{k} is {v!r}")


def _check_space(space) -> None:
    """``space``: None, or {op: {entry: candidate values}}: an entry is a field of the op's schema, or fields joined
    by ``+`` whose values are tuples (a joint move, ``_move``)."""
    if space is None:
        return
    if not isinstance(space, Mapping):
        raise TypeError(f"space: expected a mapping {{op: {{field: values}}}}, got {type(space).__name__}")
    for op, fields in space.items():
        if op not in dispatch.OPS:
            raise ValueError(f"space: unknown op {op!r}; the ops are {sorted(dispatch.OPS)}")
        if not isinstance(fields, Mapping):
            raise TypeError(f"space: {op!r} expected a mapping {{field: values}}, got {type(fields).__name__}")
        names = set(dispatch.schema(op).field_names())
        for name, values in fields.items():
            unknown = [f for f in str(name).split("+") if f not in names]
            if not isinstance(name, str) or unknown:
                raise ValueError(f"space: {op!r} has no field {(unknown[0] if unknown else name)!r}; its fields are "
                                 f"{sorted(names)}")
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"space: {op}.{name} expected a non-empty sequence of candidate values, got "
                                 f"{values!r}")
            joint = name.split("+")
            for v in values if len(joint) > 1 else ():  # a joint move sets its fields from one tuple (``_move``)
                if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) != len(joint):
                    raise ValueError(f"space: {op}.{name} expected candidate values each a ({', '.join(joint)}) "
                                     f"tuple, got {v!r}")


class _State:
    """Measurements by (target, config), the targets finished (their report rows) and the search time spent, kept
    in a JSON file so that an interrupted run resumes where it stopped, within what is left of its time limit. A run
    that finished marks the file ``complete``; the next run over it starts a new time limit (its measurements are
    still reused)."""

    def __init__(self, path: Path, gpu: str):
        self.path, self.gpu = path, gpu
        self.data = {"gpu": gpu, "measured": {}}
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: an unreadable partial search ({type(e).__name__}: {e}); remove it to "
                                 "start over") from None
            if isinstance(old, dict) and old.get("gpu") == gpu:
                _check_partial(path, old)
                self.data = old
        if self.data.pop("complete", False):
            self.data.pop("done", None)
            self.data.pop("spent_s", None)
        self.data.setdefault("done", {})
        self.data["runs"] = self.data.get("runs", 0) + 1 if "spent_s" in self.data else 1
        self.spent0 = float(self.data.get("spent_s", 0.0))
        self.t0 = time.monotonic()

    @staticmethod
    def key(t: Target, cfg) -> str:
        return f"{t.label()}|{json.dumps(cfg.as_dict(), sort_keys=True)}"

    def get(self, t: Target, cfg) -> dict | None:
        return self.data["measured"].get(self.key(t, cfg))

    def put(self, t: Target, cfg, rec: dict) -> None:
        self.data["measured"][self.key(t, cfg)] = rec
        self.save()

    def save(self, **extra) -> None:
        self.data["spent_s"] = round(self.spent0 + time.monotonic() - self.t0, 1)
        self.data.update(extra)
        _write_atomic(self.path, json.dumps(self.data, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a file of its own beside it, then rename it over ``path``: a run killed or
    out of disk mid-write leaves the previous file whole, and two runs writing the same file each put a whole one
    there (the last one's). A link is written through (its target replaced)."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode) if path.exists() else 0o644)  # mkstemp's is 0o600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _measure(t: Target, cfg, *, tol: float | None, state: _State, bound: dict | None = None) -> dict:
    """Check then time ``cfg`` (cached in ``state``): ``{"err", "ms", "parts"}`` (``parts``: ms per workload),
    ``{"err", "slower"}`` when its workloads timed so far show it cannot beat ``bound`` (``_hopeless``), or
    ``{"error"}``."""
    hit = state.get(t, cfg)
    if hit is not None:
        return hit
    fields = {t.op: cfg.as_dict()}
    t_begin = time.monotonic()
    try:
        with dispatch.config_override(fields):
            err = t.check()
            if not math.isfinite(err) or (tol is not None and err > tol):
                rec = {"error": f"inaccurate: rel err {err:.3e} > {tol}"}
            else:
                calls = [build() for build in t.calls]
                parts: list[float] = []
                for c in calls:
                    parts.append(_time_ms(c, t.graph))
                    if _hopeless(parts, bound):
                        break
                if len(parts) < len(calls):
                    rec = {"err": err, "slower": round(sum(parts), 6), "parts": parts}
                else:
                    rec = {"err": err, "ms": sum(parts), "parts": parts}
                    if t.stages:
                        try:
                            rec["kernels"] = _kernel_ms(calls)
                        except Exception as e:  # the move is then judged by the whole time; the reason is kept
                            rec["kernels_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    except Exception as e:  # a candidate that does not compile or run loses; the search goes on
        rec = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    rec["s"] = round(time.monotonic() - t_begin, 2)
    state.put(t, cfg, rec)
    return rec


# a candidate's timing stops once the workloads timed so far, plus the best entry's times of the others made this
# much faster, already exceed the best entry's whole time (with GAIN of slack): it cannot win
HOPELESS_SPEEDUP = 0.25


def _hopeless(parts: list[float], bound: dict | None) -> bool:
    best = (bound or {}).get("parts")
    if not best or len(parts) >= len(best):
        return False
    rest = sum(best[len(parts):])
    return sum(parts) + (1 - HOPELESS_SPEEDUP) * rest > sum(best) * (1 + GAIN)


def _kernel_ms(calls: list[Callable[[], Any]], reps: int = 3) -> dict[str, float]:
    """GPU time per call sequence of each kernel the ``calls`` launch (ms, by kernel name; torch.profiler over
    ``reps`` runs of them all). Empty under the interpreter."""
    if dispatch.is_interpreter():
        return {}
    from torch.profiler import ProfilerActivity, profile

    for c in calls:
        c()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for c in calls:
                c()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        if us:
            out[e.key] = out.get(e.key, 0.0) + us / reps / 1e3
    return out


def _faster(t: Target, key: str, rec: dict, best: dict) -> bool:
    """Whether candidate ``rec`` (a move of space entry ``key``) beats ``best``: by ``GAIN`` of the whole time, or,
    for a move within one stage of a many-kernel op, by ``STAGE_GAIN`` of that stage's kernels' GPU time with
    the whole time no worse than ``GAIN``."""
    names = t.stage_kernels(key)
    if names and "kernels" in rec and "kernels" in best:
        def stage(r):
            return sum(ms for k, ms in r["kernels"].items() if any(n in k for n in names))

        a, b = stage(best), stage(rec)
        if a > 0 and b > 0:
            return b < a * (1 - STAGE_GAIN) and rec["ms"] < best["ms"] * (1 + GAIN)
    return rec["ms"] < best["ms"] * (1 - GAIN)


def _floor(dtype: torch.dtype) -> float:
    return 2e-3 if dtype == torch.float16 else 1e-2


def _entry(table: dict, t: Target):
    """The entry of ``table`` whose match is the target's key, else the first that matches it, else the
    schema's defaults; the key's names that are also config fields are set to the key's values, and so are the
    target's ``fixed`` fields (the Gluon MLA targets start from ``impl="gluon"`` and its one key ring although a
    table without a Gluon entry has a Triton catch-all)."""
    rows = table.get(t.op, ())
    cfg = next((c for m, c in rows if m == t.key), None)
    if cfg is None:
        cfg = next((c for m, c in rows if all(t.key.get(k) == v for k, v in m.items())), dispatch.schema(t.op)())
    want = {**{k: v for k, v in t.key.items() if k in cfg.field_names()}, **t.fixed}
    own = {k: v for k, v in want.items() if getattr(cfg, k) != v}
    return cfg.replace(**own) if own else cfg


START = ("table", "default")
PASSES = 3  # coordinate-descent passes over a target's space at most
GAIN = 0.005  # a candidate replaces the best one when it is this much faster (the timings' noise is below it)
STAGE_GAIN = 0.01  # ... or when its moved stage's kernels are this much faster (``Target.stages``)


def _check_writable(name: str, path: Path) -> None:
    """Before a search of minutes: ``path`` is a file that can be written (its folder made if need be)."""
    if path.is_dir():
        raise ValueError(f"{name}: {path} is a directory; expected the path of the table's JSON file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name}: cannot make the folder {path.parent} ({type(e).__name__}: {e})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{name}: {path} cannot be written (no write permission)")


def tune(ops: list[str] | None = None, *, budget_minutes: float = 15.0, out: str | Path | None = None,
         space: Mapping[str, Mapping[str, tuple]] | None = None, progress: bool = True,
         target_list: list[Target] | None = None, jobs: int = 0, start: str = "table") -> dict:
    """Run the search; returns ``{"table": ..., "report": [...], "path": Path, "compile_wave_s": float}`` and
    writes the table to ``out``.

    ``space`` replaces the candidate values of some fields per op (e.g. a tiny search for tests); ``target_list``
    replaces the targets. ``jobs``: worker processes that compile each step's candidates ahead of the timing (0:
    none). ``start``: ``"table"`` searches from this GPU's table, ``"default"`` from ``configs/default.json`` (the
    report then also times this GPU's shipped entry, ``shipped_ms``)."""
    check_choice("start", start, START)
    check_int_in("jobs", jobs, 0)
    check_positive_real("budget_minutes", budget_minutes)
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out: expected a path (str or os.PathLike), got {type(out).__name__}")
    if ops is not None and (isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence)
                            or not all(isinstance(o, str) for o in ops)):
        raise TypeError(f"ops: expected None or a list of op names, got {ops!r}")
    if ops is not None and not ops:  # nothing to tune: the table written would repeat the start table's rows
        raise ValueError("ops: expected None (every op) or a non-empty list of op names, got an empty list")
    tlist = target_list if target_list is not None else targets(ops)
    _check_space(space)
    info = dispatch.device_info()
    gpu = info.table  # the name dispatch looks this GPU's table up by (its own, also where none is shipped)
    path = Path(out) if out is not None else user_config_dir() / f"{gpu}.json"
    _check_writable("out", path)
    state = _State(path.with_name(path.name + ".partial.json"), gpu)
    if state.data.setdefault("start", start) != start:  # the finished targets were another search's
        state.data.update(start=start, done={}, runs=1)
        state.spent0 = 0.0
    shipped = dispatch._load_table(gpu)
    base = shipped if start == "table" else dispatch._load_table("default")
    if start != "table" and info.key == "default":
        raise ValueError(f"start='default': {info.name} has no table of its own to compare with")
    raw = {op: [{"match": m, "config": c.as_dict()} for m, c in _reached(rows)] for op, rows in base.items()}
    t_start = time.monotonic()
    end = t_start + max(0.0, budget_minutes * 60 - state.spent0)  # a resumed run gets what its time limit has left
    wave_s = 0.0
    report = []
    done = state.data["done"]
    for t in tlist:  # what a resumed run takes from the file, checked before any search
        if t.label() in done:
            _check_done(state.path, t, done[t.label()])
    sizes = [1 + sum(len(v) for v in (space or {}).get(t.op, t.space).values()) for t in tlist]
    bar = _bar(sum(sizes), progress)
    pool = _Warmer(jobs, ops) if jobs and target_list is None else None
    try:
        # one compile wave over every target not finished yet: each start entry and its one-field changes (for the
        # GDN op: each stage's kernel variants); later steps compile only what a changed best entry needs
        if pool is not None:
            bar.set_postfix_str("compiling")
            pool.warm([(t, [_entry(base, t)] + _neighbours(_entry(base, t), (space or {}).get(t.op, t.space)))
                       for t in tlist if t.label() not in done], state,
                      timeout=max(60.0, 0.4 * (end - time.monotonic())))
            wave_s = time.monotonic() - t_start
        for i, t in enumerate(tlist):
            if t.label() in done:  # finished before this run resumed
                row = done[t.label()]
                report.append(row)
                if "config" in row:
                    _set_entry(raw, t, row["config"])
                bar.update(sizes[i])
                continue
            row = _search(t, base, shipped if start != "table" else None, space, state, pool, bar,
                          deadline=time.monotonic() + max(0.0, end - time.monotonic()) * sizes[i] / sum(sizes[i:]))
            report.append(row)
            if "config" in row:
                _set_entry(raw, t, row["config"])
            done[t.label()] = row
            state.save()
    finally:
        if pool is not None:
            pool.close()
    bar.close()
    _pick_impl(raw, report)
    if ops is None or "decode_path" in ops:
        with dispatch.table_swap(gpu, raw):  # the paths' kernels as the written table launches them
            raw["decode_path"] = _decode_path_entries(info)
    dispatch.parse_table(raw, where=str(path))  # the table written is one dispatch accepts
    _write_atomic(path, json.dumps(raw, indent=1) + "\n")
    dispatch.reload_tables()  # this process launches through the written table from here on
    state.save(complete=True)
    return {"table": raw, "report": report, "path": path, "compile_wave_s": wave_s, "spent_s": state.data["spent_s"],
            "runs": state.data["runs"]}


def _search(t: Target, base: dict, shipped: dict | None, space, state: _State, pool, bar, *, deadline: float) -> dict:
    """Coordinate descent over ``t``'s space from its entry of ``base`` until ``deadline``; the report row (with the
    winner's ``config``; ``shipped_ms``: the entry of ``shipped`` timed beside it, when given)."""
    t_begin = time.monotonic()
    stats = {"measured": 0, "slower": 0, "waves": 0, "wave_s": 0.0}

    def measure(cfg, **kw):
        fresh = state.get(t, cfg) is None
        rec = _measure(t, cfg, state=state, **kw)
        stats["measured"] += fresh
        stats["slower"] += fresh and "slower" in rec
        return rec

    incumbent = _entry(base, t)
    fields = dict((space or {}).get(t.op, t.space))
    names = list(fields)
    bar.set_postfix_str(f"{t.label()}: current entry")
    first = measure(incumbent, tol=None)
    bar.update(1)
    if "error" in first:
        return {"target": t.label(), "error": first["error"], "seconds": round(time.monotonic() - t_begin, 1)}
    tol = 2 * first["err"] + _floor(_lowp())
    best, best_rec = incumbent, first
    # the configs one move away from ``warmed`` along these fields are compiled (the first wave covered the start)
    warmed, covered = incumbent, set(names) if pool is not None else set()
    # coordinate descent, repeated while a pass improves (a later pass re-tries the fields an earlier change of
    # another one made worth trying); measurements are cached, so a repeated candidate is free
    for sweep in range(PASSES):
        improved = False
        for j, name in enumerate(names):
            if warmed is not best:
                warmed, covered = best, set()
            if pool is not None and name not in covered and time.monotonic() < deadline:
                # one wave per new best, over the fields this pass has still to try (a next pass starts with one
                # over the others): those configs compiled side by side
                ahead = [n for n in names[j:] if n not in covered]
                todo = [c for c in _neighbours(best, {n: fields[n] for n in ahead}) if state.get(t, c) is None]
                covered.update(ahead)
                if todo:
                    t_wave = time.monotonic()
                    pool.warm([(t, todo)], state)
                    stats["waves"] += 1
                    stats["wave_s"] += time.monotonic() - t_wave
            for value in fields[name]:
                if sweep == 0:
                    bar.update(1)
                change = _move(name, value)
                if time.monotonic() > deadline or _has(best, change):
                    continue
                try:
                    cand = best.replace(**change)
                except ValueError:
                    continue
                bar.set_postfix_str(f"{t.label()}: {name}={value}")
                rec = measure(cand, tol=tol, bound=best_rec)
                if "ms" in rec and _faster(t, name, rec, best_rec):
                    best, best_rec, improved = cand, rec, True
        if not improved or time.monotonic() > deadline:
            break
    ref = _entry(shipped, t) if shipped is not None else None
    row = {"target": t.label()}
    if best != incumbent or (ref is not None and ref != best):  # side by side: no run-to-run noise
        cfgs = list(dict.fromkeys([incumbent, best] + ([ref] if ref is not None else [])))
        times = dict(zip(cfgs, _retimed(t, cfgs, state), strict=True))
        a, b = times[incumbent], times[best]
        if ref is not None:
            row["shipped_ms"] = times[ref]
        # side by side the winner must beat the start by 1 %; one won on its stages' kernel times (far below the
        # whole time's noise) only must not lose
        if (b > a * (1 + GAIN)) if t.stages else not b < a * 0.99:
            best, b = incumbent, a
    else:
        a = b = first["ms"]
        if ref is not None:
            row["shipped_ms"] = b
    stats["wave_s"] = round(stats["wave_s"], 1)
    return {**row, "current_ms": a, "tuned_ms": b, "config": best.as_dict(), **stats,
            "seconds": round(time.monotonic() - t_begin, 1)}


def _pick_impl(raw: dict, report: list[dict]) -> None:
    """``impl="auto"`` runs the Gluon MLA kernel where the table's ``impl: "gluon"`` entries say so: each Gluon
    entry keeps ``impl="gluon"`` only if its tuned time beats the tuned portable kernel's on the same workloads."""
    ms = {r["target"]: r["tuned_ms"] for r in report if "tuned_ms" in r}
    for kind in ("dense", "sparse"):
        glu, tri = ms.get(f"mla_decode gluon {kind}"), ms.get(f"mla_decode triton {kind}")
        if glu is None or tri is None:
            continue
        key = {"impl": "gluon", **({"sparse": True} if kind == "sparse" else {})}
        for row in raw.get("mla_decode", ()):
            if row["match"] == key:
                row["config"]["impl"] = "gluon" if glu < tri else "triton"


def _retimed(t: Target, cfgs: list, state: _State) -> list[float]:
    """The configs (the start entry, the winner, maybe the shipped entry) timed one after the other (kept in
    ``state`` for a resumed run)."""
    key = "retime|" + "|".join(state.key(t, c) for c in cfgs)
    hit = state.data["measured"].get(key)
    if hit is None:
        hit = [_retime(t, c) for c in cfgs]
        state.data["measured"][key] = hit
        state.save()
    return hit


def _move(name: str, value) -> dict:
    """The fields one value of the space entry ``name`` sets (``"a+b"`` entries take ``(a, b)`` tuples)."""
    names = name.split("+")
    return dict(zip(names, value if len(names) > 1 else (value,), strict=True))


def _has(cfg, change: Mapping[str, Any]) -> bool:
    return all(getattr(cfg, k) == v for k, v in change.items())


def _neighbours(cfg, fields: Mapping[str, tuple]) -> list:
    """The valid configs that differ from ``cfg`` by one value of one of the space entries ``fields``."""
    out = []
    for name, values in fields.items():
        for value in values:
            change = _move(name, value)
            if _has(cfg, change):
                continue
            try:
                out.append(cfg.replace(**change))
            except ValueError:
                pass
    return list(dict.fromkeys(out))


def _warm_one(ops: list[str] | None, label: str, op: str, cfg: dict) -> str:
    """In a worker: run ``label``'s check and each of its calls once under ``cfg``, which compiles every kernel
    variant they launch into Triton's cache. Returns "" or the error (the timing process records it again)."""
    global _WORKER_TARGETS
    if _WORKER_TARGETS is None:
        torch.set_num_threads(1)  # the workers' float64 references must not oversubscribe the CPUs compiling
        _WORKER_TARGETS = {t.label(): t for t in targets(ops)}
    t = _WORKER_TARGETS[label]
    try:
        with dispatch.config_override({op: cfg}):
            t.check()
            for build in t.calls:
                build()()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_WORKER_TARGETS: dict | None = None


class _Warmer:
    """Worker processes (spawned, one CUDA context each) that compile candidates before they are timed."""

    step_timeout = 180.0  # seconds one warm step may take

    def __init__(self, jobs: int, ops: list[str] | None):
        import multiprocessing

        self.ops = ops
        self.done: set[str] = set()
        self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))

    def warm(self, work: list[tuple[Target, list]], state: _State, *, timeout: float | None = None) -> None:
        """Run each (target, configs) pair's configs not measured or warmed yet, and wait (at most ``timeout``
        seconds, default ``step_timeout``)."""
        todo = {}
        for t, cfgs in work:
            for c in cfgs:
                key = state.key(t, c)
                if key not in self.done and state.get(t, c) is None:
                    todo[key] = (t, c)
        futures = [self.pool.submit(_warm_one, self.ops, t.label(), t.op, c.as_dict()) for t, c in todo.values()]
        # a worker's error shows again when the candidate is measured; a candidate still compiling after the
        # time limit is compiled by the timing process itself
        concurrent.futures.wait(futures, timeout=self.step_timeout if timeout is None else timeout)
        for f in futures:
            f.cancel()  # those not started yet: the timing must not share the GPU with the workers
        self.done.update(todo)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _retime(t: Target, cfg) -> float:
    with dispatch.config_override({t.op: cfg.as_dict()}):
        calls = [build() for build in t.calls]
        return sorted(sum(_time_ms(c, t.graph) for c in calls) for _ in range(3))[1]


def _reached(rows: list) -> list:
    """The rows of a table as dispatch reads it that a lookup can reach: a tuned table of this GPU goes before the
    shipped one, and a shipped row after a tuned one whose match is a subset of its own is never reached (nor
    written back: ``parse_table`` refuses it)."""
    out: list = []
    for m, c in rows:
        if not any(e.items() <= m.items() for e, _ in out):
            out.append((m, c))
    return out


def _set_entry(raw: dict, t: Target, config: dict) -> None:
    """Set the config of ``t``'s entry of ``raw``; a new entry goes before the first row whose match takes every
    key its own does (a catch-all, a less specific row), so that its lookups reach it."""
    rows = raw.setdefault(t.op, [])
    for row in rows:
        if row["match"] == t.key:
            row["config"] = dict(config)
            return
    at = next((i for i, row in enumerate(rows) if row["match"].items() <= t.key.items()), len(rows))
    rows.insert(at, {"match": dict(t.key), "config": dict(config)})


def _decode_path_entries(info) -> list[dict]:
    """The ``decode_path`` entries: per s_q, both paths' decode steps of the reference layer measured at
    ``decode_path.POINTS`` (CUDA graphs), then a catch-all with the kernels' efficiency at the M1 / Q1 shapes (the
    roofline time over our CUDA-graph time) for other s_q."""
    from . import decode_path

    if info.interpreter:  # no timing that means anything: the roofline alone
        return [{"match": {}, "config": {"absorb_efficiency": 1.0, "grouped_efficiency": 1.0,
                                         "source": "not measured (interpreter)"}}]
    spec = roofline.gpu_spec(info.key) if info.key in roofline.GPUS else None
    if spec is None:
        return [{"match": {}, "config": {"absorb_efficiency": 1.0, "grouped_efficiency": 1.0,
                                         "source": f"no roofline spec for {info.name}"}}]
    hopper = info.capability[0] == 9
    mla = _mla_targets(False, hopper)[2 if hopper else 0]  # the dense kernel impl="auto" runs here; M1 first
    gqa = _gqa_targets(False)[0]
    t_abs = _time_ms(mla.calls[0](), True) * 1e-3
    t_grp = _time_ms(gqa.calls[0](), True) * 1e-3
    w_m, w_q = roofline.MLA_WORKLOADS["M1"], roofline.GQA_WORKLOADS["Q1"]
    e_abs = min(1.0, roofline.mla_decode_model(**w_m).time(spec) / t_abs)
    e_grp = min(1.0, roofline.gqa_decode_model(**w_q).time(spec) / t_grp)
    where = f"gqla_triton.tune on {info.name}"
    rows = [{"match": {"s_q": s_q}, "config": {
                "absorb_efficiency": round(e_abs, 3), "grouped_efficiency": round(e_grp, 3), "points": pts,
                "source": f"{where}: decode steps of decode_path.REF_SHAPE, CUDA graphs"}}
            for s_q, pts in sorted(decode_path.measure_points(lambda fn: _time_ms(fn, True)).items())]
    rows.append({"match": {}, "config": {
        "absorb_efficiency": round(e_abs, 3), "grouped_efficiency": round(e_grp, 3),
        "source": f"{where}: mla_decode M1 {t_abs * 1e3:.3f} ms, gqa_decode Q1 {t_grp * 1e3:.3f} ms (CUDA graphs) "
                  f"against roofline.{spec.name}"}})
    return rows


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _bar(total: int, progress: bool):
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="tune", unit="cand")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="", help="comma list of combine,gdn_decode,gdn_chunk,mla_decode,gqa_decode,"
                                              "decode_path (default: all)")
    ap.add_argument("--budget-minutes", type=float, default=15.0, help="bound on the search time (%(default)s)")
    ap.add_argument("--out", default=None, help="table to write (default: <user config dir>/<gpu>.json)")
    ap.add_argument("--jobs", type=int, default=0, help="worker processes compiling candidates ahead (%(default)s)")
    ap.add_argument("--start", choices=START, default="table",
                    help="search from this GPU's table or from configs/default.json (%(default)s)")
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o] or None
    if not dispatch.is_interpreter() and not torch.cuda.is_available():
        raise SystemExit("gqla_triton.tune needs a CUDA GPU (or TRITON_INTERPRET=1 for a dry run on the CPU)")
    t0 = time.monotonic()
    try:
        res = tune(ops, budget_minutes=args.budget_minutes, out=args.out, jobs=args.jobs, start=args.start)
    except (TypeError, ValueError) as e:  # a bad option: the message, not a traceback
        ap.error(str(e))
    ship = args.start != "table"
    head = ["target", "start ms", "tuned ms", "tuned / start"] + (["shipped ms", "tuned / shipped"] if ship else [])
    head += ["timed", "cut", "waves", "wave s", "s"]
    rows = []
    for r in res["report"]:
        tail = [str(r.get(k, "-")) for k in ("measured", "slower", "waves", "wave_s")]
        tail.append(f"{r['seconds']:.0f}" if "seconds" in r else "-")
        if "current_ms" not in r:
            rows.append([r["target"], "-", "-", r.get("error", "")[:60]] + (["-", "-"] if ship else []) + tail)
            continue
        row = [r["target"], f"{r['current_ms']:.4f}", f"{r['tuned_ms']:.4f}", f"{r['tuned_ms'] / r['current_ms']:.3f}"]
        if ship:
            row += [f"{r['shipped_ms']:.4f}", f"{r['tuned_ms'] / r['shipped_ms']:.3f}"]
        rows.append(row + tail)
    print(roofline.format_table(head, rows, "l" + "r" * (len(head) - 1)))
    if args.jobs:
        print(f"compile wave: {res['compile_wave_s']:.0f} s")
    print(f"wrote {res['path']} in {(time.monotonic() - t0) / 60:.1f} min"
          + (f" ({res['spent_s'] / 60:.1f} min of search over {res['runs']} runs)" if res["runs"] > 1 else ""))
    report = Path(res["path"]).with_name(Path(res["path"]).name + ".report.json")
    _write_atomic(report, json.dumps(res["report"], indent=1) + "\n")


if __name__ == "__main__":
    main()
