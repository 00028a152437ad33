"""Hostile inputs for ``mla_decode`` and ``gqa_decode``: lengths at the int32 extremes, negative and past the block
table's capacity; NaN / ±inf in keys a query sees, in q, beyond the length, in keys only later MTP tokens see
(causal), in unselected or unreachable cache rows; junk sparse indices, topk lengths and block tables; arguments
of the wrong type, value, dtype or device, and a backward through the ops.

Every case is checked against the float64 reference with its NaN and ±inf positions exact (the references define
IEEE arithmetic over the keys a query sees, nothing from the keys it does not see), outputs poisoned, and under
the interpreter every load and store must lie inside the tensors passed in (``addresscheck``). The case builders
(``Spec``, ``random_spec``, ``check_case``) are shared with ``tools/sanitize_decode.py``, which runs them on the GPU
under compute-sanitizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random

import pytest
import torch
from harness import P, assert_matches, assert_refused, dtypes, examples, gen, pick, randn, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

from gqla_triton.dispatch import is_interpreter
from gqla_triton.ops._common.alloc import poisoned
from gqla_triton.ops.gqa import gqa_decode, gqa_decode_reference
from gqla_triton.ops.mla import mla_decode, mla_decode_ref, quantize_latent_fp8

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
PAGE = pick(16, 64)
MAX_PAGES = pick(3, 5)
CAP = PAGE * MAX_PAGES  # keys one block-table row holds
SPARE = 2  # pages no block table names: NaN-filled, never reachable
B = 2
MLA_DIMS = pick((32, 16), (512, 64))  # (latent r = head_dim_v, rope d_R); 512 + 64 takes the Gluon kernel on Hopper
MLA_HEADS = pick((16,), (16, 128))  # 16 heads fold several MTP tokens into one row tile
GQA_DIMS = pick((16, 16, 16), (128, 64, 128))  # (d_h, d_R, d_v)
GQA_G, GQA_HEADS_PER_G = 2, pick(4, 16)
TOPK = pick(24, 200)
IMPLS = {"mla": pick(("triton",), ("triton", "auto")), "gqa": ("triton",)}
LENGTHS = ("max", "max-1", "cap", "cap+1", "cap-1", "zero", "neg", "min", "one", "rand", "rand")
PLACES = ("seen", "tail", "beyond", "q", "anywhere")
NONFINITE = (math.nan, math.inf, -math.inf)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One hostile decode call; every tensor value is drawn from ``seed``."""

    op: str  # "mla" | "gqa"
    seed: int
    s_q: int = 1
    causal: bool = True
    sparse: bool = False
    splits: int = 0
    lengths: tuple = ("rand", "rand")  # per batch entry, a name of LENGTHS
    poison: int = 0  # non-finite values placed (PLACES, drawn from the seed)
    junk_pages: bool = False  # block-table entries outside [0, num_pages)
    topk_length: bool = False
    per_group: bool = False  # gqa sparse: one index set per group
    impl: str = "triton"
    heads: int = 16  # mla h_q
    fp8: bool = False  # mla: FlashMLA's FP8 latent cache (latent 512 + rope 64, pow2 scales, q bf16 / fp32)


def spec_strategy(op: str):
    return st.builds(Spec, op=st.just(op), seed=seeds(), s_q=st.integers(1, 3), causal=st.booleans(),
                     sparse=st.booleans(), splits=st.sampled_from([0, 1, 3]),
                     lengths=st.tuples(st.sampled_from(LENGTHS), st.sampled_from(LENGTHS)),
                     poison=st.integers(0, 3), junk_pages=st.booleans(), topk_length=st.booleans(),
                     per_group=st.booleans(), impl=st.sampled_from(IMPLS[op]), heads=st.sampled_from(MLA_HEADS),
                     fp8=st.booleans() if op == "mla" else st.just(False))


def random_spec(op: str, seed: int) -> Spec:
    """The spec of ``spec_strategy`` drawn from ``random.Random(seed)`` (the sanitizer driver's case list)."""
    r = random.Random(seed * 2 + (op == "gqa"))
    return Spec(op, seed, s_q=r.randint(1, 3), causal=r.random() < 0.7, sparse=r.random() < 0.5,
                splits=r.choice([0, 1, 3]), lengths=(r.choice(LENGTHS), r.choice(LENGTHS)), poison=r.randint(0, 3),
                junk_pages=r.random() < 0.5, topk_length=r.random() < 0.5, per_group=r.random() < 0.5,
                impl=r.choice(IMPLS[op]), heads=r.choice(MLA_HEADS), fp8=op == "mla" and r.random() < 0.3)


# ------------------------------------------------------------------------------------------------ case builders
def _lengths(names, g) -> torch.Tensor:
    table = {"max": I32_MAX, "max-1": I32_MAX - 1, "cap": CAP, "cap+1": CAP + 1, "cap-1": CAP - 1, "zero": 0,
             "neg": -1, "min": I32_MIN, "one": 1}
    return torch.tensor([table[n] if n in table else int(torch.randint(1, CAP + 1, (1,), generator=g))
                         for n in names], dtype=torch.int32)


def _block_table(g, num_pages, junk):
    bt = torch.randperm(num_pages, generator=g)[: B * MAX_PAGES].reshape(B, MAX_PAGES).int()
    spare = sorted(set(range(num_pages)) - set(bt.reshape(-1).tolist()))
    if junk:
        bad = torch.tensor([-1, num_pages, I32_MAX, I32_MIN], dtype=torch.int32)
        bt = torch.where(torch.rand(B, MAX_PAGES, generator=g) < 0.3, bad[torch.randint(0, 4, bt.shape, generator=g)],
                         bt)
    return bt, spare


def _indices(g, shape, lens):
    """Valid positions mixed with causal-boundary ones, junk (negative, int32 extremes, the capacity, the length
    and past it) and duplicates."""
    L = lens.clamp(0, CAP).long().reshape(B, *([1] * (len(shape) - 1)))
    idx = (torch.rand(shape, generator=g) * L).long()
    near = lens.long().reshape(L.shape) - torch.randint(1, 4, shape, generator=g)
    junk = torch.tensor([-1, -2, I32_MIN, I32_MAX, CAP, CAP + 3, 10**9], dtype=torch.int64)
    kind = torch.randint(0, 10, shape, generator=g)
    idx = torch.where(kind == 0, junk[torch.randint(0, len(junk), shape, generator=g)], idx)
    idx = torch.where(kind == 1, near, idx)
    idx = torch.where(kind == 2, lens.long().reshape(L.shape) + torch.randint(0, 3, shape, generator=g), idx)
    idx = torch.where(kind == 3, idx[..., :1].expand(shape), idx)  # repeats
    return idx.clamp(I32_MIN, I32_MAX).int()


def _topk_length(g, topk):
    pool = torch.tensor([-5, 0, 1, topk // 2, topk, topk + 7, I32_MAX, I32_MIN], dtype=torch.int64)
    return pool[torch.randint(0, len(pool), (B,), generator=g)].int()


def _seen(spec: Spec, lens, bt, num_pages, idx, tkl, groups: int) -> torch.Tensor:
    """bool ``[B, s_q, groups, CAP]``: which positions each query (and index set) sees, by the documented rules."""
    n = lens.long().clamp(min=0)
    pos = torch.arange(CAP)
    qpos = n[:, None] - spec.s_q + torch.arange(spec.s_q)[None, :]
    last = qpos if spec.causal else (n[:, None] - 1).expand(B, spec.s_q)
    blk = bt.long()[:, pos // PAGE]
    has_row = (blk >= 0) & (blk < num_pages)  # [B, CAP]
    if idx is None:
        seen = (pos < n[:, None, None]) & (pos <= last[..., None]) & has_row[:, None, :]
        return seen[:, :, None, :].expand(B, spec.s_q, groups, CAP)
    ix = idx.long() if idx.dim() == 4 else idx.long()[:, :, None, :].expand(B, spec.s_q, groups, idx.shape[-1])
    topk = ix.shape[-1]
    cnt = torch.full((B,), topk) if tkl is None else tkl.long().clamp(0, topk)
    ok = ((torch.arange(topk) < cnt[:, None, None, None]) & (ix >= 0) & (ix < n[:, None, None, None])
          & (ix <= last[:, :, None, None]) & (ix < CAP))
    hits = torch.zeros(B, spec.s_q, groups, CAP, dtype=torch.int64)
    hits.scatter_add_(3, torch.where(ok, ix, 0), ok.long())
    return (hits > 0) & has_row[:, None, None, :]


def _row(bt, num_pages, b, p):
    blk = int(bt[b, p // PAGE])
    return (blk, p % PAGE) if 0 <= blk < num_pages else None


def _pick(g, mask: torch.Tensor):
    """A random index tuple where ``mask`` holds, or None."""
    where = mask.nonzero()
    return None if where.shape[0] == 0 else tuple(where[int(torch.randint(0, where.shape[0], (1,), generator=g))])


def _poison_places(spec, g, seen, bt, num_pages):
    """``(place, b, j, group, position)`` of each non-finite value: a key a query sees, a key only later tokens (or
    other index rows) see, a stored key no query sees, q, or anywhere."""
    out = []
    stored = torch.tensor([[_row(bt, num_pages, b, p) is not None for p in range(CAP)] for b in range(B)])
    for _ in range(spec.poison):
        place = PLACES[int(torch.randint(0, len(PLACES), (1,), generator=g))]
        if place == "seen":
            hit = _pick(g, seen)
        elif place == "tail":  # seen by one query of the sequence, not by another
            hit = _pick(g, seen & ~seen.all(dim=1, keepdim=True))
        elif place == "beyond":
            hit = _pick(g, (~seen.any(dim=1, keepdim=True) & stored[:, None, None, :]).expand_as(seen))
        else:
            hit = None
        out.append((place if hit is not None or place in ("q", "anywhere") else "anywhere", hit))
    return out


def fp8_q_dtype(dtype):
    """q's dtype over an FP8 cache (bf16 or fp32) for a case drawn in ``dtype``: fp16 becomes bf16 on the GPU and
    fp32 under the interpreter (which computes bf16 wrongly)."""
    return dtype if dtype != torch.float16 else (torch.bfloat16 if P.big else torch.float32)


def mla_case(spec: Spec, dtype, device) -> dict:
    """Inputs of ``mla_decode`` for ``spec`` (float64 drawn on the CPU, then cast and moved)."""
    g = gen(spec.seed)
    r, dr = (512, 64) if spec.fp8 else MLA_DIMS
    D = r + dr
    num_pages = B * MAX_PAGES + SPARE
    bt, spare = _block_table(g, num_pages, spec.junk_pages)
    lens = _lengths(spec.lengths, g)
    q = torch.randn(B, spec.s_q, spec.heads, D, generator=g, dtype=torch.float64)
    kv = torch.randn(num_pages, PAGE, 1, D, generator=g, dtype=torch.float64)
    kv[spare] = math.nan  # unreachable pages
    idx = _indices(g, (B, spec.s_q, TOPK), lens) if spec.sparse else None
    tkl = _topk_length(g, TOPK) if spec.sparse and spec.topk_length else None
    seen = _seen(spec, lens, bt, num_pages, idx, tkl, 1)
    for place, hit in _poison_places(spec, g, seen, bt, num_pages):
        val = NONFINITE[int(torch.randint(0, 3, (1,), generator=g))]
        c = int(torch.randint(0, D, (1,), generator=g))
        if place == "q":
            q[int(torch.randint(0, B, (1,), generator=g)), int(torch.randint(0, spec.s_q, (1,), generator=g)),
              int(torch.randint(0, spec.heads, (1,), generator=g)), c] = val
        elif place == "anywhere":
            kv.view(-1, D)[int(torch.randint(0, num_pages * PAGE, (1,), generator=g)), c] = val
        else:
            blk, slot = _row(bt, num_pages, int(hit[0]), int(hit[3]))
            kv[blk, slot, 0, c] = val
    to = dict(device=device)
    if spec.fp8:  # power-of-two scales: every dequantised value is exact in bf16, as a bf16 cache's are
        return dict(q=q.to(dtype=fp8_q_dtype(dtype), **to),
                    kv_cache=quantize_latent_fp8(kv.float(), pow2_scales=True).to(**to), block_table=bt.to(**to),
                    cache_seqlens=lens.to(**to), head_dim_v=r, causal=spec.causal,
                    indices=None if idx is None else idx.to(**to),
                    topk_length=None if tkl is None else tkl.to(**to), num_splits=spec.splits)
    return dict(q=q.to(dtype=dtype, **to), kv_cache=kv.to(dtype=dtype, **to), block_table=bt.to(**to),
                cache_seqlens=lens.to(**to), head_dim_v=r, causal=spec.causal,
                indices=None if idx is None else idx.to(**to), topk_length=None if tkl is None else tkl.to(**to),
                num_splits=spec.splits)


def gqa_case(spec: Spec, dtype, device) -> dict:
    """Inputs of ``gqa_decode`` for ``spec`` (float64 drawn on the CPU, then cast and moved)."""
    g = gen(spec.seed)
    d_h, d_r, d_v = GQA_DIMS
    groups, G = GQA_G, GQA_HEADS_PER_G
    num_pages = B * MAX_PAGES + SPARE
    bt, spare = _block_table(g, num_pages, spec.junk_pages)
    lens = _lengths(spec.lengths, g)
    q = torch.randn(B, spec.s_q, groups * G, d_h + d_r, generator=g, dtype=torch.float64)
    k = torch.randn(num_pages, PAGE, groups, d_h, generator=g, dtype=torch.float64)
    v = torch.randn(num_pages, PAGE, groups, d_v, generator=g, dtype=torch.float64)
    kr = torch.randn(num_pages, PAGE, d_r, generator=g, dtype=torch.float64)
    for t in (k, v, kr):
        t[spare] = math.nan
    shape = (B, spec.s_q, groups, TOPK) if spec.per_group else (B, spec.s_q, TOPK)
    idx = _indices(g, shape, lens) if spec.sparse else None
    tkl = _topk_length(g, TOPK) if spec.sparse and spec.topk_length else None
    seen = _seen(spec, lens, bt, num_pages, idx, tkl, groups)
    for place, hit in _poison_places(spec, g, seen, bt, num_pages):
        val = NONFINITE[int(torch.randint(0, 3, (1,), generator=g))]
        which = int(torch.randint(0, 3, (1,), generator=g))  # k, v or the shared rope key
        if place == "q":
            q[int(torch.randint(0, B, (1,), generator=g)), int(torch.randint(0, spec.s_q, (1,), generator=g)),
              int(torch.randint(0, groups * G, (1,), generator=g)), int(torch.randint(0, d_h + d_r, (1,),
                                                                                      generator=g))] = val
            continue
        if place == "anywhere":
            blk, slot = int(torch.randint(0, num_pages, (1,), generator=g)), int(torch.randint(0, PAGE, (1,),
                                                                                            generator=g))
            grp = int(torch.randint(0, groups, (1,), generator=g))
        else:
            blk, slot = _row(bt, num_pages, int(hit[0]), int(hit[3]))
            grp = int(hit[2])
        t, grp_dim = ((k, True), (v, True), (kr, False))[which]
        c = int(torch.randint(0, t.shape[-1], (1,), generator=g))
        if grp_dim:
            t[blk, slot, grp, c] = val
        else:
            t[blk, slot, c] = val
    to = dict(device=device)
    return dict(q=q.to(dtype=dtype, **to), k_cache=k.to(dtype=dtype, **to), v_cache=v.to(dtype=dtype, **to),
                block_table=bt.to(**to), cache_seqlens=lens.to(**to), k_rope_cache=kr.to(dtype=dtype, **to),
                causal=spec.causal, indices=None if idx is None else idx.to(**to),
                topk_length=None if tkl is None else tkl.to(**to), num_splits=spec.splits)


# ------------------------------------------------------------------------------------------------ running a case
def run_op(op: str, inputs: dict, impl: str = "triton"):
    """The op on ``inputs`` with every launcher buffer NaN-poisoned; under the interpreter inside the address check
    (every load and store within the tensors passed in)."""
    fn = mla_decode if op == "mla" else gqa_decode
    with poisoned():
        if not is_interpreter():
            return fn(**inputs, impl=impl)
        from addresscheck import AddressCheck

        with AddressCheck(*(v for v in inputs.values() if isinstance(v, torch.Tensor))) as ac:
            got = fn(**inputs, impl=impl)
        ac.assert_clean()
        return got


def reference(op: str, inputs: dict, lowp=None):
    """Float64 reference; ``lowp``: the same at the kernel's precision (for the tolerance)."""
    if op == "mla":
        kw = {k: v for k, v in inputs.items() if k != "num_splits"}
        return mla_decode_ref(**kw, p_dtype=lowp)
    kw = {k: v for k, v in inputs.items() if k != "num_splits"}
    return gqa_decode_reference(**kw, **({} if lowp is None else {"compute_dtype": lowp}))


def check_case(spec: Spec, dtype, device) -> None:
    """Run ``spec`` and compare with the float64 reference; AssertionError on any difference (or bad access)."""
    inputs = (mla_case if spec.op == "mla" else gqa_case)(spec, dtype, device)
    dtype = inputs["q"].dtype
    out, lse = run_op(spec.op, inputs, spec.impl)
    if device != "cpu" or not is_interpreter():
        torch.cuda.synchronize()
    ref_o, ref_l = reference(spec.op, inputs)
    low_o, low_l = reference(spec.op, inputs, dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(f"{spec} out", out, ref_o, low_o, dtype=dtype)
    if spec.op == "mla":
        assert_matches(f"{spec} lse", lse, ref_l, ref_l.float(), dtype=torch.float32,
                       eps=1e-5 if dtype == torch.float32 else 1e-4)
    else:
        assert_matches(f"{spec} lse", lse, ref_l, low_l, dtype=dtype)
    empty = (ref_l == -math.inf).permute(0, 2, 1)  # [B, s_q, h_q]: rows whose weights sum to 0
    assert (out.cpu()[empty] == 0).all(), f"{spec}: a row whose weights sum to 0 is not 0"


# ------------------------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("op", ["mla", "gqa"])
@settings(max_examples=examples(10, 40))
@given(data=st.data(), dtype=dtypes())
def test_hostile_cases_match_reference(op, data, dtype):
    """Extreme / negative / past-capacity lengths, NaN and inf anywhere, junk indices, topk lengths and block
    tables, dense and sparse, MTP, split-KV: the float64 reference exactly (non-finite positions) and within the
    data-derived bound elsewhere, with no access outside the inputs."""
    check_case(data.draw(spec_strategy(op)), dtype, P.device)


_SPARSE_SPECS = {
    "mla causal MTP": Spec("mla", 21, s_q=3, causal=True, sparse=True, splits=3, lengths=("cap-1", "rand"), poison=3,
                           topk_length=True),
    "gqa per group": Spec("gqa", 22, s_q=2, causal=True, sparse=True, splits=1, lengths=("cap", "rand"), poison=3,
                          topk_length=True, per_group=True),
    "gqa shared, junk pages": Spec("gqa", 23, s_q=3, causal=False, sparse=True, lengths=("rand", "cap+1"), poison=2,
                                   junk_pages=True, topk_length=True),
}


@pytest.mark.parametrize("dtype", P.dtypes)
@pytest.mark.parametrize("name", sorted(_SPARSE_SPECS))
def test_hostile_sparse_cases_with_topk_lengths(name, dtype):
    """Sparse calls with topk lengths and non-finite keys: mla_decode over a bf16 / fp16 / fp32 cache under causal
    MTP, gqa_decode with one index set per group and one shared; the float64 reference as in
    ``test_hostile_cases_match_reference``."""
    check_case(_SPARSE_SPECS[name], dtype, P.device)


def _clean(op, s_q, lens, splits, dtype, impl="triton"):
    spec = Spec(op, 11, s_q=s_q, causal=True, splits=splits, heads=MLA_HEADS[0], impl=impl)
    inputs = (mla_case if op == "mla" else gqa_case)(spec, dtype, P.device)
    inputs["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32, device=P.device)
    return inputs


def _set(inputs, name, b, pos, value, channel=0, group=0):
    t = inputs[name]
    blk = int(inputs["block_table"][b, pos // PAGE])
    if t.dim() == 4:
        t[blk, pos % PAGE, group, channel] = value
    else:
        t[blk, pos % PAGE, channel] = value


@pytest.mark.parametrize("op", ["mla", "gqa"])
@pytest.mark.parametrize("splits", [1, 3])
def test_causal_mtp_nonfinite_key_reaches_only_the_tokens_that_see_it(op, splits):
    """s_q = 3, causal: a NaN key at the last position (seen by token 2 only) and a +inf value at the one before
    (tokens 1 and 2) change nothing in the rows that do not see them (bitwise), and make the rows that do NaN
    exactly as the reference says."""
    dtype = P.dtypes[0]
    n0, n1 = CAP - 5, 20
    for impl in IMPLS[op]:
        clean = _clean(op, 3, [n0, n1], splits, dtype, impl)
        bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in clean.items()}
        if op == "mla":
            _set(bad, "kv_cache", 0, n0 - 1, math.nan, channel=3)  # latent: score and value
            _set(bad, "kv_cache", 1, n1 - 2, math.inf, channel=MLA_DIMS[0] + 1)  # rope: the score only
        else:
            _set(bad, "v_cache", 0, n0 - 1, math.nan, channel=2, group=1)
            _set(bad, "k_cache", 1, n1 - 2, math.nan, channel=1, group=0)
        o0, l0 = run_op(op, clean, impl)
        o1, l1 = run_op(op, bad, impl)
        G = o0.shape[2] // GQA_G if op == "gqa" else o0.shape[2]
        heads = slice(G, 2 * G) if op == "gqa" else slice(None)  # the poisoned group's heads
        heads1 = slice(0, G) if op == "gqa" else slice(None)
        # rows that do not see a poisoned key: bit-identical to the clean call
        assert torch.equal(o1[0, :2], o0[0, :2]) and torch.equal(l1[0, :, :2], l0[0, :, :2])
        assert torch.equal(o1[1, :1], o0[1, :1]) and torch.equal(l1[1, :, :1], l0[1, :, :1])
        if op == "mla":
            assert o1[0, 2].isnan().all() and l1[0, :, 2].isnan().all()  # NaN score: the whole row
            # rope +inf: score +inf (lse +inf, out NaN) where q's channel is positive, -inf (weight 0) elsewhere
            up = (bad["q"][1, 1:, :, MLA_DIMS[0] + 1] > 0).cpu()  # [2, h_q]
            lse_t = l1[1, :, 1:].transpose(0, 1).cpu()
            assert up.any() and (~up).any()
            assert (lse_t[up] == math.inf).all() and o1[1, 1:].cpu()[up].isnan().all()
            assert torch.isfinite(lse_t[~up]).all() and torch.isfinite(o1[1, 1:].cpu()[~up]).all()
        else:
            assert o1[0, 2, heads, 2].isnan().all() and torch.isfinite(l1[0, :, 2]).all()  # v NaN: its column
            assert torch.isfinite(o1[0, 2, heads, :2]).all()
            assert torch.equal(o1[0, 2, heads1], o0[0, 2, heads1])  # the other group's heads do not see it
            assert o1[1, 1:, heads1].isnan().all() and l1[1, heads1, 1:].isnan().all()  # k NaN: the score
            assert torch.equal(o1[1, 1:, heads], o0[1, 1:, heads])
        ref_o, ref_l = reference(op, bad)
        assert_matches(f"{op} tail out", o1, ref_o, reference(op, bad, dtype)[0], dtype=dtype)
        assert torch.equal(torch.isnan(l1.cpu()), torch.isnan(ref_l)) and torch.equal(l1.cpu() == math.inf,
                                                                                    ref_l == math.inf)


@pytest.mark.parametrize("op", ["mla", "gqa"])
def test_long_mtp_boundary_keys_match_reference(op):
    """s_q = 19, causal: 18 keys that only later tokens see (two 16-key boundary tiles in gqa_decode, one key per
    pass in mla_decode), non-finite values in both tiles: the reference exactly; a length past the capacity has
    none of them."""
    dtype = P.dtypes[0]
    n = CAP - 3
    inputs = _clean(op, 19, [n, CAP + 40], 1, dtype)
    if op == "mla":
        _set(inputs, "kv_cache", 0, n - 1, math.nan, channel=4)
        _set(inputs, "kv_cache", 0, n - 17, -math.inf, channel=2)  # -inf score or +inf, and -inf in a value column
    else:
        _set(inputs, "v_cache", 0, n - 1, math.nan, channel=3, group=1)
        _set(inputs, "k_cache", 0, n - 17, math.inf, channel=0, group=0)
    out, lse = run_op(op, inputs)
    ref_o, ref_l = reference(op, inputs)
    low_o, low_l = reference(op, inputs, dtype)
    assert out[0].isnan().any() and torch.isfinite(out[1]).all()
    assert_matches(f"{op} long MTP out", out, ref_o, low_o, dtype=dtype)
    assert_matches(f"{op} long MTP lse", lse, ref_l, ref_l.float() if op == "mla" else low_l,
                   dtype=torch.float32 if op == "mla" else dtype, eps=1e-4 if op == "mla" else None)


def _top_key_inputs(op, splits, impl, sign, top_score):
    """Inputs at softmax_scale ``sign · 2e37`` (its product with log2(e) finite) where every head's score is a key's
    channel 0 (latent for mla, the group's key for gqa): random in (-1, 1), one key per sequence ``sign ·
    top_score``, so that key takes all the weight. Returns ``(inputs, [(block, slot)] of the top keys)``."""
    dtype = P.dtypes[0]
    inputs = _clean(op, 1, [CAP - 5, CAP // 2 + 3], splits, dtype, impl)
    q = inputs["q"]
    q.zero_()
    q[..., 0] = 1.0
    g = gen(5)
    key = inputs["kv_cache"] if op == "mla" else inputs["k_cache"]
    ch0 = key[..., 0]
    ch0.copy_(torch.rand(ch0.shape, generator=g, dtype=torch.float64).to(dtype) * 2 - 1)
    top = []
    for b, n in enumerate(inputs["cache_seqlens"].tolist()):
        pos = int(torch.randint(0, n, (1,), generator=g))
        blk = int(inputs["block_table"][b, pos // PAGE])
        key[blk, pos % PAGE, ..., 0] = sign * top_score
        top.append((blk, pos % PAGE))
    inputs["softmax_scale"] = sign * 2e37
    return inputs, top


@pytest.mark.parametrize("op", ["mla", "gqa"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("impl", IMPLS["mla"])
@pytest.mark.parametrize("sign", [1, -1])
def test_huge_softmax_scale_matches_reference(op, splits, impl, sign):
    """A valid softmax_scale near the float32 limit (±2e37: its product with log2(e) is finite) over scores whose
    scaled values pass the float32 range in log2 units (15 · 2e37 · log2(e)) but not in natural log: each query's
    one top key (score 15, or -15 under the negative scale) takes all the weight, so out is exactly that key's
    value row and lse = 15 · 2e37 = 3e38, finite, as in the float64 reference."""
    if op == "gqa" and impl != "triton":
        pytest.skip("gqa_decode has one kernel")
    dtype = P.dtypes[0]
    inputs, top = _top_key_inputs(op, splits, impl, sign, 15.0)
    scale = inputs["softmax_scale"]
    out, lse = run_op(op, inputs, impl)
    ref_o, ref_l = reference(op, inputs)
    assert torch.isfinite(ref_l).all() and torch.isfinite(ref_o).all()
    assert torch.isfinite(lse).all() and torch.isfinite(out).all(), f"{op} {impl}: non-finite out / lse"
    assert torch.equal(out.cpu(), ref_o.to(dtype)), f"{op} {impl}: out is not the top key's value row"
    torch.testing.assert_close(lse.double().cpu(), ref_l, rtol=1e-5, atol=0)
    assert abs(float(ref_l.flatten()[0]) - 15.0 * abs(scale)) < 1e-5 * 15.0 * abs(scale)
    if op == "mla":  # and it is that row: the key's latent channels
        for b, (blk, slot) in enumerate(top):
            assert torch.equal(out[b, 0, 0].cpu(), inputs["kv_cache"][blk, slot, 0, :MLA_DIMS[0]].cpu())


@pytest.mark.parametrize("op", ["mla", "gqa"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("impl", IMPLS["mla"])
@pytest.mark.parametrize("sign", [1, -1])
def test_lse_past_float32_range_keeps_out_exact(op, splits, impl, sign):
    """As ``test_huge_softmax_scale_matches_reference`` with a top score of 20: its scaled value, 20 · 2e37 = 4e38,
    passes the float32 range in natural log too, so lse is ``+inf`` (the float64 reference's 4e38 in float32), and
    out is still exactly the top key's value row, with one split or several (their partials merged in raw-score
    units, ``combine_splits``' ``unit``)."""
    if op == "gqa" and impl != "triton":
        pytest.skip("gqa_decode has one kernel")
    dtype = P.dtypes[0]
    inputs, top = _top_key_inputs(op, splits, impl, sign, 20.0)
    out, lse = run_op(op, inputs, impl)
    ref_o, ref_l = reference(op, inputs)
    assert torch.isfinite(ref_o).all() and (ref_l.float() == math.inf).all()
    assert torch.equal(out.cpu(), ref_o.to(dtype)), f"{op} {impl}: out is not the top key's value row"
    assert torch.equal(lse.cpu(), ref_l.float()), f"{op} {impl}: lse is not +inf"
    if op == "mla":
        for b, (blk, slot) in enumerate(top):
            assert torch.equal(out[b, 0, 0].cpu(), inputs["kv_cache"][blk, slot, 0, :MLA_DIMS[0]].cpu())


@pytest.mark.parametrize("op", ["mla", "gqa"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("impl", IMPLS["mla"])
@pytest.mark.parametrize("scale", [1.5, -1.5])
def test_raw_score_softmax_matches_reference(op, splits, impl, scale):
    """softmax_scale ±1.5 (|scale · log2(e)| > 1: the kernels' raw-score softmax, ``score_mode``) on causal MTP
    (s_q 3, boundary keys) with a NaN and a -inf among the keys: the float64 reference, as at the default scale."""
    if op == "gqa" and impl != "triton":
        pytest.skip("gqa_decode has one kernel")
    dtype = P.dtypes[0]
    n = CAP - 3
    inputs = _clean(op, 3, [n, CAP // 2 + 1], splits, dtype, impl)
    inputs["softmax_scale"] = scale
    if op == "mla":
        _set(inputs, "kv_cache", 0, n - 2, math.nan, channel=3)
        _set(inputs, "kv_cache", 1, 7, -math.inf, channel=1)
    else:
        _set(inputs, "v_cache", 0, n - 2, math.nan, channel=2, group=1)
        _set(inputs, "k_cache", 1, 7, -math.inf, channel=0, group=0)
    out, lse = run_op(op, inputs, impl)
    ref_o, ref_l = reference(op, inputs)
    low_o, low_l = reference(op, inputs, dtype)
    assert_matches(f"{op} raw-score out", out, ref_o, low_o, dtype=dtype)
    assert_matches(f"{op} raw-score lse", lse, ref_l, ref_l.float() if op == "mla" else low_l,
                   dtype=torch.float32 if op == "mla" else dtype, eps=1e-4 if op == "mla" else None)


@pytest.mark.parametrize("op", ["mla", "gqa"])
def test_lengths_past_capacity_and_negative(op):
    """A length above the block table's capacity (up to INT32_MAX) attends to the capacity's keys, exactly as a
    length at which every query already sees all of them; a negative length is an empty sequence."""
    dtype = P.dtypes[0]
    s_q = 2
    for causal in (True, False):
        full = _clean(op, s_q, [CAP + s_q - 1, CAP + s_q], 2, dtype)
        full["causal"] = causal
        huge = dict(full, cache_seqlens=torch.tensor([I32_MAX, I32_MAX - 1], dtype=torch.int32, device=P.device))
        o0, l0 = run_op(op, full)
        o1, l1 = run_op(op, huge)
        assert torch.equal(o0, o1) and torch.equal(l0, l1)
        assert torch.isfinite(o1).all() and torch.isfinite(l1).all()
    neg = dict(full, cache_seqlens=torch.tensor([-1, I32_MIN], dtype=torch.int32, device=P.device))
    o, lse = run_op(op, neg)
    assert (o == 0).all() and (lse == -math.inf).all()


# ------------------------------------------------------------------------------------------------ bad arguments
def _bad_calls(op):
    """(label, argument overrides, exception, message pattern) of calls that must be refused before any launch."""
    dev = P.device
    i64 = dict(dtype=torch.int64, device=dev)
    cap = 2**30 // 16 + 1  # block-table columns (of the 16-token pages of _small) past 2**30 keys per sequence
    expand_bt = torch.zeros(1, 1, dtype=torch.int32, device=dev).expand(B, cap)
    big_topk = torch.zeros(1, 1, 1, dtype=torch.int32, device=dev).expand(B, 1, 2**30 + 1)
    other = "meta" if dev == "cpu" else "cpu"
    scale_type = "^softmax_scale: expected a finite real number or None"
    scale_value = r"^softmax_scale: expected a finite real number of magnitude <= .* \(float32 range\) or None"
    splits, a_bool = r"^num_splits: expected an int in \[0, 1024\]", "^causal: expected a bool"
    impls = r"^impl: expected one of \('auto', 'triton', 'gluon', 'reference'\)"
    calls = [
        ("scale str", dict(softmax_scale="0.1"), TypeError, scale_type),
        ("scale tensor", dict(softmax_scale=torch.tensor(0.1)), TypeError, scale_type),
        ("scale complex", dict(softmax_scale=1j), TypeError, scale_type),
        ("scale bool", dict(softmax_scale=True), TypeError, scale_type),
        ("scale nan", dict(softmax_scale=math.nan), ValueError, scale_value),
        ("scale inf", dict(softmax_scale=-math.inf), ValueError, scale_value),
        ("scale past fp32", dict(softmax_scale=1e39), ValueError, scale_value),
        ("scale huge int", dict(softmax_scale=10**400), ValueError, scale_value),
        ("splits bool", dict(num_splits=True), TypeError, splits),
        ("splits negative", dict(num_splits=-1), ValueError, splits),
        ("splits huge", dict(num_splits=2**40), ValueError, splits),
        ("splits past max", dict(num_splits=1025), ValueError, splits),
        ("splits float", dict(num_splits=2.0), TypeError, splits),
        ("splits str", dict(num_splits="2"), TypeError, splits),
        ("causal str", dict(causal="yes"), TypeError, a_bool),
        ("causal None", dict(causal=None), TypeError, a_bool),
        ("causal 2", dict(causal=2), TypeError, a_bool),
        ("block_table int64", dict(block_table=torch.zeros(B, 2, **i64)),
         TypeError, r"^block_table: expected dtype in \(int32\)"),
        ("block_table float", dict(block_table=torch.zeros(B, 2, device=dev)),
         TypeError, r"^block_table: expected dtype in \(int32\)"),
        ("block_table list", dict(block_table=[[0, 1], [2, 3]]), TypeError, "^block_table: expected a torch.Tensor"),
        ("block_table capacity", dict(block_table=expand_bt),
         ValueError, "^block_table: .* address more than 1073741824 tokens per sequence"),
        ("cache_seqlens int64", dict(cache_seqlens=torch.ones(B, **i64)),
         TypeError, r"^cache_seqlens: expected dtype in \(int32\)"),
        ("cache_seqlens shape", dict(cache_seqlens=torch.ones(B + 1, dtype=torch.int32, device=dev)), ValueError,
         r"^cache_seqlens: expected shape \[2\]"),
        ("indices int64", dict(indices=torch.zeros(B, 1, 4, **i64)),
         TypeError, r"^indices: expected dtype in \(int32\)"),
        ("indices topk", dict(indices=big_topk),
         ValueError, r"^indices: topk \(last dimension\) must be in \[1, 1073741824\]"),
        ("topk_length int64", dict(indices=torch.zeros(B, 1, 4, dtype=torch.int32, device=dev),
                                   topk_length=torch.ones(B, **i64)),
                                    TypeError, r"^topk_length: expected dtype in \(int32\)"),
        ("topk_length alone", dict(topk_length=torch.ones(B, dtype=torch.int32, device=dev)), ValueError,
         "^topk_length: given without indices"),
        ("block_table device", dict(block_table=torch.zeros(B, 2, dtype=torch.int32, device=other)), ValueError,
         r"^block_table: expected a tensor on .* \(same as q\)"),
        ("cache_seqlens device", dict(cache_seqlens=torch.ones(B, dtype=torch.int32, device=other)), ValueError,
         r"^cache_seqlens: expected a tensor on .* \(same as q\)"),
        ("impl", dict(impl="cuda"), ValueError, impls),
        ("impl int", dict(impl=3), TypeError, impls),
    ]
    if op == "mla":
        calls += [
            ("q float64", dict(q=torch.zeros(B, 1, 16, 48, dtype=torch.float64, device=dev)),
             TypeError, r"^q: expected dtype in \(bfloat16, float16, float32\)"),
            ("q int", dict(q=torch.zeros(B, 1, 16, 48, dtype=torch.int32, device=dev)),
             TypeError, r"^q: expected dtype in \(bfloat16, float16, float32\)"),
            ("q numpy", dict(q=torch.zeros(B, 1, 16, 48).numpy()), TypeError, "^q: expected a torch.Tensor"),
            ("kv_cache dtype", dict(kv_cache=torch.zeros(8, 16, 1, 48, dtype=torch.float16, device=dev)), TypeError,
             r"^kv_cache: expected dtype torch.float32 \(same as q\)"),
            ("kv_cache device", dict(kv_cache=torch.zeros(8, 16, 1, 48, device=other)),
             ValueError, r"^kv_cache: expected a tensor on .* \(same as q\)"),
            ("dense page of 8", dict(kv_cache=torch.zeros(8, 8, 1, 48, device=dev)),
             ValueError, r"^kv_cache: page_size \(dim 1\) must be a positive multiple of 16 for dense calls.* got 8"),
            ("sparse page of 0", dict(kv_cache=torch.zeros(8, 0, 1, 48, device=dev),
                                      indices=torch.zeros(B, 1, 4, dtype=torch.int32, device=dev)), ValueError,
             r"^kv_cache: page_size \(dim 1\) must be .* positive for sparse ones, got 0"),
            ("head_dim_v bool", dict(head_dim_v=True), TypeError, r"^head_dim_v: expected an int in \[1, 48\]"),
            ("head_dim_v float", dict(head_dim_v=32.0), TypeError, r"^head_dim_v: expected an int in \[1, 48\]"),
            ("s_q x heads past the grid", dict(q=torch.zeros(1, 1, 16, 48, device=dev).expand(B, 2**19, 16, 48)),
             ValueError, "^q: .* row tiles .* more than one launch takes"),
            ("sparse rows past int32", dict(kv_cache=torch.zeros(1, 1, 1, 48, device=dev).expand(2**16, 2**15, 1, 48),
                                            indices=torch.zeros(B, 1, 4, dtype=torch.int32, device=dev)),
             ValueError, r"^kv_cache: 65536 pages x 32768 tokens .* int32 row indices"),
        ]
    else:
        calls += [
            ("q float64", dict(q=torch.zeros(B, 1, 8, 32, dtype=torch.float64, device=dev)),
             TypeError, r"^q: expected dtype in \(bfloat16, float16, float32\)"),
            ("v_cache dtype", dict(v_cache=torch.zeros(8, 16, 2, 16, dtype=torch.float16, device=dev)), TypeError,
             r"^v_cache: expected dtype torch.float32 \(same as q\)"),
            ("k_rope_cache device", dict(k_rope_cache=torch.zeros(8, 16, 16, device=other)), ValueError,
             r"^k_rope_cache: expected a tensor on .* \(same as q\)"),
            ("k_rope_cache list", dict(k_rope_cache=[0.0]), TypeError, "^k_rope_cache: expected a torch.Tensor"),
            ("sparse rows past int32", dict(k_cache=torch.zeros(1, 1, 2, 16, device=dev).expand(2**16, 2**15, 2, 16),
                                            v_cache=torch.zeros(1, 1, 2, 16, device=dev).expand(2**16, 2**15, 2, 16),
                                            k_rope_cache=torch.zeros(1, 1, 16, device=dev).expand(2**16, 2**15, 16),
                                            indices=torch.zeros(B, 1, 4, dtype=torch.int32, device=dev)),
             ValueError, r"^k_cache: 65536 pages x 32768 tokens .* int32 row indices"),
            ("batch past the grid", dict(q=torch.zeros(1, 1, 8, 32, device=dev).expand(2**16, 1, 8, 32),
                                         block_table=torch.zeros(1, 2, dtype=torch.int32, device=dev).expand(2**16, 2),
                                         cache_seqlens=torch.ones(1, dtype=torch.int32, device=dev).expand(2**16)),
             ValueError, "^q: batch 65536 .* exceeds the 65535 sequences one launch takes"),
        ]
    return calls


def _small(op):
    g = gen(5)
    bt = torch.arange(2 * B, dtype=torch.int32, device=P.device).reshape(B, 2)
    lens = torch.tensor([5, 20], dtype=torch.int32, device=P.device)
    if op == "mla":
        return dict(q=randn((B, 1, 16, 48), g), kv_cache=randn((8, 16, 1, 48), g), block_table=bt,
                    cache_seqlens=lens, head_dim_v=32)
    return dict(q=randn((B, 1, 8, 32), g), k_cache=randn((8, 16, 2, 16), g), v_cache=randn((8, 16, 2, 16), g),
                block_table=bt, cache_seqlens=lens, k_rope_cache=randn((8, 16, 16), g))


@pytest.mark.parametrize("op", ["mla", "gqa"])
def test_bad_arguments_raise_naming_them(op):
    fn = mla_decode if op == "mla" else gqa_decode
    base = _small(op)
    before = {k: v.clone() for k, v in base.items() if isinstance(v, torch.Tensor)}
    assert_refused(fn, base, _bad_calls(op))
    for k, v in before.items():  # a refused call changes nothing
        assert torch.equal(base[k], v), k


@pytest.mark.parametrize("op", ["mla", "gqa"])
def test_backward_raises_naming_the_op(op):
    """Inputs that require grad: the forward computes the usual result, and its outputs keep a grad_fn whose
    backward raises (the graph is never cut silently)."""
    fn = mla_decode if op == "mla" else gqa_decode
    base = _small(op)
    want_o, want_l = fn(**base)
    q = base["q"].clone().requires_grad_()
    out, lse = fn(**{**base, "q": q})
    assert out.requires_grad and lse.requires_grad
    assert torch.equal(out.detach(), want_o) and torch.equal(lse.detach(), want_l)
    with pytest.raises(RuntimeError, match=f"{op}_decode is forward-only"):
        out.float().sum().backward()
    with torch.no_grad():  # no autograd recording: no grad_fn
        out, _ = fn(**{**base, "q": q})
    assert not out.requires_grad


def _unaligned(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t``'s values in a view whose rows lie 8 bytes off 16-byte boundaries: sliced from rows 8 bytes wider
    (``"rows"``), or contiguous from 8 bytes past a boundary (``"offset"``)."""
    pad = 8 // t.element_size()
    if how == "rows":
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]
    view = torch.empty(t.numel() + pad, dtype=t.dtype, device=t.device)[pad:].view(t.shape)
    view.copy_(t)
    return view


def _refused_on_gpu(name: str):
    if P.device == "cuda":
        return pytest.raises(ValueError, match=f"^{name}: the kernels read its rows in place with 16-byte loads")
    return contextlib.nullcontext()


@pytest.mark.parametrize("how", ["rows", "offset"])
@pytest.mark.parametrize("op", ["mla", "mla_sparse", "mla_fp8", "gqa", "gqa_sparse", "sparse_prefill"])
def test_caches_without_16_byte_rows_are_refused_by_name_or_copied(op, how):
    """A cache whose rows do not start on 16-byte boundaries, which the kernels' vector loads take (on an H100 such a
    cache faulted with a misaligned address), is refused on a GPU by the public functions, naming it (the
    interpreter reads it in place); the custom op's body (a compiled graph, a direct ``torch.ops`` call) reads an
    aligned copy there: the same bits as over the aligned cache."""
    dt = P.dtypes[-1]  # fp16 on both profiles
    B, page, pages = 2, 16, 6
    bt = torch.arange(pages, dtype=torch.int32, device=P.device).reshape(B, -1)
    lens = torch.tensor([40, 21], dtype=torch.int32, device=P.device)
    idx = torch.tensor([[[0, 5, 39, 7, -1, 12, 30, 2]], [[20, 1, 3, -1, 8, 9, 10, 11]]], dtype=torch.int32,
                       device=P.device)
    sparse = op.endswith("sparse")
    if op.startswith("mla"):
        fp8 = op == "mla_fp8"
        q = randn((B, 1, 16, 576), 0, dtype=(torch.bfloat16 if P.device == "cuda" else torch.float32) if fp8 else dt)
        kv = randn((pages, page, 1, 576), 1, dtype=q.dtype)
        kv = quantize_latent_fp8(kv) if fp8 else kv
        args = (bt, lens, 512, 0.1, True, idx if sparse else None, None, 0, "triton", None, None, None, False)
        bad = _unaligned(kv, how)
        with _refused_on_gpu("kv_cache"):
            mla_decode(q, bad, bt, lens, 512, indices=idx if sparse else None)
        want, got = (torch.ops.gqla_triton.mla_decode(q, c, *args) for c in (kv, bad))
    elif op.startswith("gqa"):
        q = randn((B, 1, 8, 32 + 16), 0, dtype=dt)
        k, v = (randn((pages, page, 2, 32), s, dtype=dt) for s in (1, 2))
        r = randn((pages, page, 16), 3, dtype=dt)
        args = (bt, lens)
        for name in ("k_cache", "v_cache", "k_rope_cache"):
            caches = dict(k_cache=k, v_cache=v, k_rope_cache=r)
            caches[name] = _unaligned(caches[name], how)
            with _refused_on_gpu(name):
                gqa_decode(q, caches["k_cache"], caches["v_cache"], bt, lens, caches["k_rope_cache"],
                           indices=idx if sparse else None)
        tail = (0.1, True, idx if sparse else None, None, 0, "auto")
        want = torch.ops.gqla_triton.gqa_decode(q, k, v, bt, lens, r, *tail)
        got = torch.ops.gqla_triton.gqa_decode(q, *(_unaligned(t, how) for t in (k, v)), bt, lens,
                                               _unaligned(r, how), *tail)
    else:
        from gqla_triton.ops.mla import mla_sparse_prefill
        q = randn((2, 16, 576), 0, dtype=dt)
        kv = randn((48, 1, 576), 1, dtype=dt)
        ind = idx[:, 0].reshape(2, 1, 8).clamp(max=47)
        with _refused_on_gpu("kv"):
            mla_sparse_prefill(q, _unaligned(kv, how), ind)
        want, got = (torch.ops.gqla_triton.mla_sparse_prefill(q, c, ind, 512, 0.1, None, 0, "auto")
                     for c in (kv, _unaligned(kv, how)))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
