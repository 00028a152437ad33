"""The Hopper (sm_90) Gluon kernels of the forward without gradient (``sout``: ``kernels/state_out_sm90.py``, the
single chain, and ``kernels/state_out_sm90_wide.py``, the chain split across two warpgroups): they compile without
a GPU; on an H100 / H200 they give the portable kernel's results (NaN placement included), the float64
recurrence's within tolerance, the same bits on every call, and the table runs them where they apply."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from harness import P, compile_sm90_in_child, gen, rand, randn, record_launches, rel_err, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

import gqla_triton.ops.gdn.launch as launch_mod
import gqla_triton.ops.gdn.plan as plan_mod
from gqla_triton.dispatch import config_override, table_config
from gqla_triton.ops.gdn import chunk_gated_delta_rule
from gqla_triton.ops.gdn.config import ChunkConfig
from gqla_triton.ops.gdn.reference import recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

ALWAYS = {"sout_chunks": 1 << 20, "sout_waves": 1 << 20}  # the portable kernel fuses every forward too
# the Gluon kernel a test runs: the single chain (V blocks of 32 and 64), or the split chain at V blocks of 64 and
# 128 (unnarrowed, so a test's few programs still run the widest block V allows; V 32 runs the single chain)
KERNELS = {"chain": {"sout_gluon_split": 0, "sout_gluon_bv": 64},
           "split": {"sout_gluon_split": 64, "sout_gluon_bv": 128}}
SM90_KERNELS = ("gdn_state_out_sm90_kernel", "gdn_state_out_sm90_wide_kernel")


def _unnarrowed(bv, V, programs, info, floor=16):
    return min(bv, launch_mod.tile(V))


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon GDN kernel is Hopper-only (sm_90)")


def _inputs(seed, B, T, H, HV, V, N, pool_rows=0):
    """bf16 q, k (unit rows), v; fp32 g in [-1, 0); bf16 beta; fp32 h0 ``[N or pool_rows, HV, 128, V]``."""
    g_ = gen(seed)
    q = torch.nn.functional.normalize(randn((B, T, H, 128), g_, dtype=torch.float32), dim=-1)
    k = torch.nn.functional.normalize(randn((B, T, H, 128), g_, dtype=torch.float32), dim=-1)
    v = randn((B, T, HV, V), g_, dtype=torch.float32)
    g = rand((B, T, HV), g_, lo=-1.0, hi=0.0, dtype=torch.float32)
    beta = rand((B, T, HV), g_, lo=0.05, hi=0.95, dtype=torch.float32)
    h0 = randn((pool_rows or N, HV, 128, V), g_, dtype=torch.float32, scale=0.5)
    bf = torch.bfloat16
    return [t.to(P.device) for t in (q.to(bf), k.to(bf), v.to(bf), g, beta.to(bf), h0)]


def _spy(kernels=SM90_KERNELS):
    """Patches of ``launch_mod``'s Gluon kernels (a context manager) that record each launch's kernel name and run
    it; returns (patch, list of names)."""
    launched = []

    class Spy:
        def __init__(self, name):
            self.name, self.real = name, getattr(launch_mod, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.real[grid]

    return mock.patch.multiple(launch_mod, **{n: Spy(n) for n in kernels}), launched


def _forward(impl, ins, cu, kernel="chain", **kw):
    """The no-grad forward (``sout``) with ``impl`` ``"gluon"`` (the ``KERNELS[kernel]`` one) or ``"triton"``;
    (o, final state or pool)."""
    q, k, v, g, beta, h0 = ins
    h0 = h0.clone()
    spy, launched = _spy()
    with torch.no_grad(), config_override({"gdn_chunk": {**ALWAYS, **KERNELS[kernel]}}), spy, \
            mock.patch.object(launch_mod, "_state_bv", _unnarrowed if kernel == "split" else launch_mod._state_bv):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, impl=impl,
                                       output_final_state="state_indices" not in kw, **kw)
    if impl == "gluon" and q.shape[1]:
        split = kernel == "split" and v.shape[-1] >= 64
        assert launched == [SM90_KERNELS[split]], launched
    return o, (h0 if ht is None else ht)


@pytest.mark.gpu_only
@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.integers(0, 400), min_size=1, max_size=3), varlen=st.booleans(), G=st.sampled_from([1, 2]),
       V=st.sampled_from([32, 64, 128]), layout=st.sampled_from(["kv", "vk", "pool"]),
       beta_opts=st.booleans(), bad=st.sampled_from([None, "v", "k", "g"]), kernel=st.sampled_from(sorted(KERNELS)),
       seed=seeds())
def test_gluon_matches_portable_kernel(lens, varlen, G, V, layout, beta_opts, bad, kernel, seed):
    """Against the portable ``sout`` kernel on the same inputs: the same NaN positions (a non-finite v, k or g
    entry mid-sequence), the finite values to rounding (the same roundings; only the tensor-core products'
    summation order differs), the final states / pool rows likewise; dense and varlen (empty sequences too), GVA,
    every V block of both Gluon kernels, both state layouts, the state pool, beta as logits with negative
    eigenvalues."""
    _hopper()
    if varlen:
        B, T, N = 1, sum(lens), len(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=P.device)
    else:
        B, T, N, cu = len(lens), max(1, max(lens)), len(lens), None
    ins = _inputs(seed, B, T, 1, G, V, N, pool_rows=N + 2 if layout == "pool" else 0)
    kw = {}
    if layout == "vk":
        ins[5] = ins[5].transpose(-1, -2).contiguous()
        kw["state_layout"] = "vk"
    if layout == "pool":  # sequence n at row perm[n]; one sequence has no row (-1: zero start, no write)
        perm = torch.randperm(N + 2, generator=gen(seed))[:N].to(torch.int32)
        perm[0] = -1
        kw["state_indices"] = perm.to(P.device)
    if beta_opts:
        ins[4] = torch.randn(ins[4].shape, generator=gen(seed + 1)).to(P.device, torch.bfloat16)
        kw.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    if bad is not None and T > 0:
        t = int(torch.randint(0, T, (1,), generator=gen(seed + 2)))
        x = {"v": 2, "k": 1, "g": 3}[bad]
        ins[x] = ins[x].clone()
        ins[x][(0, t, 0, 3)[:ins[x].dim()]] = float("nan")
    o, ht = _forward("gluon", ins, cu, kernel, **kw)
    o2, ht2 = _forward("triton", ins, cu, **kw)
    assert torch.equal(o.isnan(), o2.isnan()) and torch.equal(ht.isnan(), ht2.isnan())
    ok, okh = ~o.isnan(), ~ht.isnan()
    if ok.any():
        assert rel_err(o[ok].double(), o2[ok].double()) < 1e-3
    if okh.any():
        assert rel_err(ht[okh].double(), ht2[okh].double()) < 1e-3


@pytest.mark.gpu_only
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("varlen", [False, True])
def test_gluon_runs_split_sequences_per_segment(varlen, kernel):
    """Sequences too few to fill the GPU are cut into segments (exact maps, chained): the Gluon kernel then runs each
    segment from its chained start state and gives the portable kernels' result on the same split (NaN positions,
    values to rounding, final states), as close to the float64 recurrence."""
    _hopper()
    spy, launched = _spy()
    lens = [1500, 700] if varlen else [1500]
    T, N = sum(lens) if varlen else lens[0], len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=P.device) if varlen \
        else None
    ins = _inputs(7, 1, T, 1, 2, 64, N)
    ins[2] = ins[2].clone()
    ins[2][0, 900, 1, 5] = float("nan")
    split = {"seg_units": 64, "seg_below": 16, "seg_min": 2, "sout_gluon_units": 0, **KERNELS[kernel]}
    outs = {}
    for impl in ("gluon", "triton"):
        with torch.no_grad(), config_override({"gdn_chunk": {**ALWAYS, **split, "sout_impl": impl}}), spy, \
                mock.patch.object(launch_mod, "_state_bv", _unnarrowed if kernel == "split" else launch_mod._state_bv):
            plan = plan_mod.chunk_plan(ins[0], ins[2], cu, None)
            assert plan.seg is not None and plan.seg.nseg > N
            outs[impl] = chunk_gated_delta_rule(*ins[:5], initial_state=ins[5].clone(), cu_seqlens=cu,
                                                output_final_state=True)
        # once, by the Gluon impl; the portable one launches none
        assert launched == [SM90_KERNELS[kernel == "split"]], launched
    (o, ht), (o2, ht2) = outs["gluon"], outs["triton"]
    assert torch.equal(o.isnan(), o2.isnan()) and o.isnan().any() and torch.equal(ht.isnan(), ht2.isnan())
    ok = ~o.isnan()
    assert rel_err(o[ok].double(), o2[ok].double()) < 1e-3
    okh = ~ht.isnan()
    assert rel_err(ht[okh].double(), ht2[okh].double()) < 1e-3
    ins[2][0, 900, 1, 5] = 0.0
    with torch.no_grad(), config_override({"gdn_chunk": {**ALWAYS, **split, "sout_impl": "gluon"}}):
        o, ht = chunk_gated_delta_rule(*ins[:5], initial_state=ins[5].clone(), cu_seqlens=cu,
                                       output_final_state=True)
    ro, rht = recurrent_gated_delta_rule_ref(*[t.double() for t in ins[:5]], initial_state=ins[5].double(),
                                             output_final_state=True, cu_seqlens=cu)
    assert rel_err(o.double(), ro) < 1e-2 and rel_err(ht.double(), rht) < 1e-2


@pytest.mark.gpu_only
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gluon_vs_float64_and_deterministic(kernel):
    """Long sequences (many chunks through the ring and every buffer) against the float64 recurrence, as close as
    the portable kernel; every call the same bits."""
    _hopper()
    ins = _inputs(5, 2, 1500, 2, 4, 128, 2)
    cu = None
    o, ht = _forward("gluon", ins, cu, kernel)
    o2, ht2 = _forward("triton", ins, cu)
    ro, rht = recurrent_gated_delta_rule_ref(*[t.double() for t in ins[:5]], initial_state=ins[5].double(),
                                             output_final_state=True)
    e, e2 = rel_err(o.double(), ro), rel_err(o2.double(), ro)
    assert e < 1.2 * e2 + 1e-4 and e < 1e-2, (e, e2)
    assert rel_err(ht.double(), rht) < 1.2 * rel_err(ht2.double(), rht) + 1e-4
    for _ in range(3):
        o3, ht3 = _forward("gluon", ins, cu, kernel)
        assert torch.equal(o, o3) and torch.equal(ht, ht3)


@pytest.mark.gpu_only
def test_table_runs_gluon_where_it_applies():
    """On sm_90 the table runs the kernel for bf16, K 128, chunk 64 calls of at least ``sout_gluon_units`` units
    (not for fp16 or K 64: the portable kernel's rule), and names the reason where it cannot."""
    _hopper()

    def use(T, HV, dtype=torch.bfloat16, K=128):
        q = torch.zeros(1, T, 1, K, dtype=dtype, device=P.device)
        v = torch.zeros(1, T, HV, 128, dtype=dtype, device=P.device)
        plan = plan_mod.chunk_plan(q, v, None, None)
        return launch_mod.use_sout_sm90(plan, q, q, v), launch_mod.sout_sm90_unsupported(plan.gpu, 64, q, q, v)

    cfg = plan_mod.chunk_plan(torch.zeros(1, 64, 1, 128, device=P.device), torch.zeros(1, 64, 1, 128, device=P.device),
                              None, None).cfg
    if cfg.sout_impl != "gluon":
        pytest.skip(f"the table of this GPU ({torch.cuda.get_device_name()}) does not select the Gluon kernel")
    chunks = max(1, -(-cfg.sout_gluon_units // 32))  # the fewest chunks of 32 value heads at the threshold
    assert use(64 * chunks, 32) == (True, None)
    if chunks > 1:
        assert use(64 * (chunks - 1), 32)[0] is False
    used, why = use(64 * chunks, 32, dtype=torch.float16)
    assert not used and "bf16" in why
    used, why = use(64 * chunks, 32, K=64)
    assert not used and "K 64" in why


def test_gluon_gate():
    """``use_sout_sm90``: compute capability 9.0 only, at least ``sout_gluon_units`` (chunk x value head) units,
    inputs the kernel takes, split sequences too (checked on a plan that names an H200)."""
    from gqla_triton.dispatch import DeviceInfo

    h200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=60 << 20)
    a100 = DeviceInfo("NVIDIA A100", (8, 0), sm_count=108, smem_per_block=166912, l2_bytes=40 << 20)

    def use(T, HV, gpu=h200, dtype=torch.bfloat16, **fields):
        q = torch.zeros(1, T, 1, 128, dtype=dtype, device=P.device)
        v = torch.zeros(1, T, HV, 128, dtype=dtype, device=P.device)
        over = {"sout_impl": "gluon", "sout_gluon_units": 4096, "seg_units": 0, **fields}
        with config_override({"gdn_chunk": over}):
            plan = plan_mod.chunk_plan(q, v, None, None)._replace(gpu=gpu)
        return launch_mod.use_sout_sm90(plan, q, q, v)

    assert use(64 * 64, 64) and not use(64 * 63, 64)
    assert not use(64 * 64, 64, gpu=a100)
    assert not use(64 * 64, 64, dtype=torch.float16)
    assert not use(64 * 64, 64, sout_impl="triton")
    # offsets within a chunk are int32: 64 rows of H·K (or HV·V) elements stay below 2^31
    for H in (2**18 - 1, 2**18):
        k = torch.empty(1, 1, H, 128, dtype=torch.bfloat16).expand(1, 64, H, 128)
        v = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16).expand(1, 64, 1, 128)
        why = launch_mod.sout_sm90_unsupported(h200, 64, k, k, v)
        assert (why is None) == (H < 2**18) and (why is None or "2^31" in why)
    assert use(64 * 64, 2, sout_gluon_units=0, seg_units=64, seg_below=16, seg_min=4)  # split: per segment


def test_sout_v_block():
    """``_sout_bv`` on an H200's plan: the Gluon V block is ``sout_gluon_bv`` narrowed while the programs would
    leave half the SMs idle (not below 32), then halved until it divides V; the kernel follows the block."""
    from gqla_triton.dispatch import DeviceInfo

    h200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=60 << 20)
    q = torch.zeros(1, 64, 1, 128, device=P.device)
    with config_override({"gdn_chunk": KERNELS["split"]}):
        plan = plan_mod.chunk_plan(q, torch.zeros(1, 64, 1, 128, device=P.device), None, None)._replace(gpu=h200)
    cases = {(128, 512): 128, (256, 512): 128, (192, 512): 64, (96, 512): 32, (32, 512): 32, (64, 512): 64,
             (128, 128): 128, (128, 64): 64, (128, 32): 32, (128, 1): 32}
    for (V, programs), bv in cases.items():
        assert launch_mod._sout_bv(plan, V, programs, True) == bv, (V, programs)
        kernel, _ = launch_mod._sout_sm90_kernel(plan.cfg, bv)
        assert kernel is getattr(launch_mod, SM90_KERNELS[bv >= 64])


def test_config_and_rule():
    """``sout_impl`` and the Gluon fields are checked (the ring has 1 to 3 stages at V blocks of 32 and 64, 1 to 2 at
    128, which only the split-chain kernel takes); where the Gluon kernel runs, ``_fuse_out`` fuses any length,
    never with sout_chunks 0; the H200 table selects it; ``_sout_sm90_kernel`` picks the kernel by V block."""
    assert ChunkConfig(sout_impl="gluon", sout_gluon_stages_v64=3).sout_gluon_stages_v64 == 3
    for field, hi in (("sout_gluon_stages_v32", 3), ("sout_gluon_stages_v64", 3), ("sout_gluon_stages_v128", 2)):
        for bad in (0, hi + 1):
            with pytest.raises(ValueError, match=f"'{field}'"):
                ChunkConfig(**{field: bad})
    for field, bad in (("sout_gluon_bv", 16), ("sout_gluon_bv", 256), ("sout_gluon_split", 32)):
        with pytest.raises(ValueError, match=f"'{field}'"):
            ChunkConfig(**{field: bad})
    with pytest.raises(ValueError, match="sout_gluon_bv 128 needs sout_gluon_split"):
        ChunkConfig(sout_gluon_bv=128)
    pick = launch_mod._sout_sm90_kernel
    for split, bv, wide in ((0, 32, False), (0, 64, False), (64, 32, False), (64, 64, True), (64, 128, True),
                            (128, 64, False), (128, 128, True)):
        kernel, _ = pick(ChunkConfig(sout_gluon_split=split, sout_gluon_bv=128 if split else 64), bv)
        assert kernel is (launch_mod.gdn_state_out_sm90_wide_kernel if wide else launch_mod.gdn_state_out_sm90_kernel)
    with pytest.raises(ValueError, match="'sout_impl'"):
        ChunkConfig(sout_impl="cuda")
    assert table_config("h200", "gdn_chunk", plan_mod.config_key(128, 128)).sout_impl == "gluon"

    def fused(T, sm90, **fields):
        q, v = torch.zeros(1, T, 1, 16, device=P.device), torch.zeros(1, T, 2, 16, device=P.device)
        with config_override({"gdn_chunk": fields}):
            return launch_mod._fuse_out(plan_mod.chunk_plan(q, v, None, None), 2, 16, sm90)

    assert fused(64 * 1000, True, sout_chunks=4) and not fused(64 * 1000, False, sout_chunks=4)
    assert not fused(64, True, sout_chunks=0)


@pytest.mark.parametrize("kw", [dict(bv=32), dict(bv=64, stages=3), dict(bv=32, use_h0=False, store_ht=False),
                                dict(varlen=True, pool=True, v_first=True, beta_sigmoid=True, neg_eigval=True)],
                         ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_gluon_kernel_compiles_for_sm90(kw):
    """The kernel compiles for sm_90 with the installed Triton (no GPU needed): warp-specialised (register
    reallocation), wgmma products, cp.async copies, within the H200's shared memory (in a child process)."""
    shared = compile_sm90_in_child("from gqla_triton.ops.gdn.kernels.state_out_sm90 import compile_sm90; "
                                   f"k = compile_sm90(**{kw!r})")
    assert shared <= 227 * 1024


SPLIT_COMPILES = [dict(bv=128, stages=2), dict(bv=64, stages=3), dict(bv=64, use_h0=False, store_ht=False),
                  dict(bv=128, varlen=True, pool=True, v_first=True, beta_sigmoid=True, neg_eigval=True)]


@pytest.mark.parametrize("kw", SPLIT_COMPILES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_split_chain_kernel_compiles_for_sm90(kw):
    """The split-chain kernel likewise, at both of its V blocks and the deepest rings the table may name."""
    shared = compile_sm90_in_child("from gqla_triton.ops.gdn.kernels.state_out_sm90_wide import compile_sm90_wide; "
                                   f"k = compile_sm90_wide(**{kw!r})")
    assert shared <= 227 * 1024


def test_impl_choices():
    """``impl="gluon"`` is refused by name where a backward may follow or the kernel cannot run (before any launch:
    a state pool stays as it was); ``chunk_plan`` maps ``"triton"`` to the portable kernel and ``"gluon"`` to the
    Gluon one at any length, sequences unsplit."""
    q = torch.randn(1, 70, 1, 128, device=P.device)
    v = torch.randn(1, 70, 2, 32, device=P.device)
    g = -torch.rand(1, 70, 2, device=P.device)
    with pytest.raises(ValueError, match="impl='gluon'.*requires grad"):
        chunk_gated_delta_rule(q, q, v.requires_grad_(), g, g.neg(), impl="gluon")
    v = v.detach()
    pool = torch.randn(3, 2, 128, 32, device=P.device)
    before = pool.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="impl='gluon': the Gluon GDN kernel cannot run here"):
        chunk_gated_delta_rule(q, q, v, g, g.neg(), initial_state=pool, impl="gluon",
                               state_indices=torch.tensor([1], dtype=torch.int32, device=P.device))
    assert torch.equal(pool, before)
    over = {"sout_impl": "gluon", "sout_gluon_units": 1 << 20, "seg_units": 64, "seg_below": 16, "seg_min": 1,
            "sout_chunks": 0}
    with config_override({"gdn_chunk": over}):
        auto = plan_mod.chunk_plan(q, v).cfg
        tri = plan_mod.chunk_plan(q, v, impl="triton").cfg
        glu = plan_mod.chunk_plan(q, v, impl="gluon")
    assert auto.sout_impl == "gluon" and tri.sout_impl == "triton"
    assert glu.cfg.sout_impl == "gluon" and glu.cfg.sout_gluon_units == 0 and glu.cfg.sout_chunks > 0
    assert glu.seg is None


@pytest.mark.gpu_only
def test_impl_triton_never_launches_gluon(monkeypatch):
    """``impl="triton"`` runs only the portable kernels even where the table picks the Gluon one; ``"auto"`` and
    ``"gluon"`` launch it."""
    _hopper()
    launched = record_launches(monkeypatch, launch_mod, "gdn_state_out_sm90_kernel")
    launched_split = record_launches(monkeypatch, launch_mod, "gdn_state_out_sm90_wide_kernel")
    ins = _inputs(3, 1, 64 * 130, 1, 32, 128, 1)
    # (the fused forward on whatever this GPU's table says: default.json keeps the separate kernels)
    fused = {"sout_impl": "gluon", "sout_gluon_units": 0, "sout_chunks": 32}
    with torch.no_grad(), config_override({"gdn_chunk": fused}):
        chunk_gated_delta_rule(*ins[:5], initial_state=ins[5], impl="triton")
        assert not launched and not launched_split
        chunk_gated_delta_rule(*ins[:5], initial_state=ins[5], impl="auto")
        assert len(launched) + len(launched_split) == 1
        chunk_gated_delta_rule(*ins[:5], initial_state=ins[5], impl="gluon")
        assert len(launched) + len(launched_split) == 2
