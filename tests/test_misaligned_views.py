"""Activation tensors passed as misaligned or oddly strided views (a start address off 16 bytes, every other element,
a column of wider rows, transposed, stride 0): every public op and layer step gives the result of the contiguous
copies or refuses by name without changing any state, never touches the view's buffer outside its elements, and
(interpreter address check) never reads outside them."""

import pytest
import torch
from harness import P, address_checked, assert_close, gen, pick, rand, randn

import gqla_triton as gq
from gqla_triton.layers import gdn_step as gds
from gqla_triton.layers import gqla_step as gs
from gqla_triton.layers.rope import rope_inv_freq
from gqla_triton.ops._common.validation import rows_aligned

SENT = -7.0
KINDS = ["offset", "strided", "column", "transposed", "expanded"]


def _view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values behind another layout, in a fresh buffer holding ``SENT`` outside the view: ``offset``
    (contiguous, storage offset 1: the start address off 16 bytes), ``strided`` (every other element along the last
    dim, offset 1), ``column`` (inside rows 3 elements wider, offset 1: odd row strides), ``transposed`` (first and
    last dims swapped in memory, offset 1), ``expanded`` (stride 0 along dim 0; ``t``'s rows must be equal)."""
    n = t.shape[-1]
    if kind == "offset":
        buf = torch.full((t.numel() + 2,), SENT, dtype=t.dtype, device=t.device)
        v = buf[1:1 + t.numel()].view(t.shape)
    elif kind == "strided":
        buf = torch.full((*t.shape[:-1], 2 * n + 1), SENT, dtype=t.dtype, device=t.device)
        v = buf[..., 1::2]
    elif kind == "column":
        buf = torch.full((*t.shape[:-1], n + 3), SENT, dtype=t.dtype, device=t.device)
        v = buf[..., 1:1 + n]
    elif kind == "transposed":
        buf = torch.full((t.numel() + 2,), SENT, dtype=t.dtype, device=t.device)
        v = buf[1:1 + t.numel()].view(t.transpose(0, -1).shape).transpose(0, -1)
    elif kind == "expanded":
        assert torch.equal(t, t[:1].expand(t.shape))
        buf = torch.full((t[0].numel() + 2,), SENT, dtype=t.dtype, device=t.device)
        v = buf[1:1 + t[0].numel()].view(t.shape[1:]).expand(t.shape)
    else:
        raise ValueError(kind)
    if kind != "expanded":
        v.copy_(t)
    else:
        v[0].copy_(t[0])
    assert torch.equal(v, t) and v.data_ptr() % 16 and v._base is buf
    return v


def _gaps_untouched(v: torch.Tensor) -> None:
    """The buffer behind view ``v`` still holds ``SENT`` outside ``v``'s elements."""
    base = v._base
    keep = torch.ones(base.numel(), dtype=torch.bool, device=base.device)
    keep.as_strided(v.shape, v.stride(), v.storage_offset()).fill_(False)
    assert torch.all(base.reshape(-1)[keep] == SENT), "the buffer outside the view was written"


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in _flat(e)]
    return []


def _clone_args(args: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# Each case: (args, run(args) -> outputs, activation names, names written in place, reference(args) -> float64
# outputs or None). ``run`` returns what the call returns; the tensors written in place are compared after it.


def _gdn_chunk(dt, g_):
    T, H, HV, K, V = pick(20, 300), 1, 2, pick(16, 128), pick(16, 64)
    q, k = (randn((2, T, H, K), g_, dtype=dt) for _ in range(2))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dt)
    args = dict(q=q, k=k, v=randn((2, T, HV, V), g_, dtype=dt), g=-rand((2, T, HV), g_, hi=0.5, dtype=dt),
                beta=rand((2, T, HV), g_, dtype=dt), initial_state=randn((2, HV, K, V), g_, scale=0.5))

    def run(a, impl="auto"):
        return gq.chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                                         output_final_state=True, impl=impl)

    def ref(a):
        return run({n: t.double() for n, t in a.items()}, impl="reference")
    return args, run, list(args), [], ref


def _gdn_chunk_pool(dt, g_):
    """The pool form: ``initial_state`` updated in place at rows ``state_indices``."""
    args, _, _, _, _ = _gdn_chunk(dt, g_)
    args["initial_state"] = randn((3, *args["initial_state"].shape[1:]), g_, scale=0.5)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=P.device)

    def run(a, impl="auto"):
        return gq.chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                                         state_indices=idx, impl=impl)[0]

    def ref(a):
        a64 = {n: t.double() for n, t in a.items()}
        return run(a64, impl="reference"), a64["initial_state"]
    return args, run, list(args), ["initial_state"], ref


def _gdn_decode(dt, g_):
    B, s, H, HV, K, V = 3, 2, 1, 2, pick(16, 128), pick(16, 128)
    k = torch.nn.functional.normalize(randn((B, s, H, K), g_), dim=-1).to(dt)
    args = dict(q=randn((B, s, H, K), g_, dtype=dt), k=k, v=randn((B, s, HV, V), g_, dtype=dt),
                g=-rand((B, s, HV), g_, hi=0.5, dtype=dt), beta=rand((B, s, HV), g_, dtype=dt),
                state=randn((4, HV, K, V), g_, scale=0.5))
    idx = torch.tensor([3, -1, 0], dtype=torch.int32, device=P.device)

    def run(a):
        return gq.gated_delta_rule_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], idx)
    return args, run, list(args), ["state"], None


def _gdn_decode_spec(dt, g_):
    """Speculative verification: gates computed in the kernel (raw ``g``, ``A_log``, ``dt_bias``), every token's
    state written to ``intermediate_states`` in place, ``[V, K]`` state rows."""
    args, _, _, _, _ = _gdn_decode(dt, g_)
    B, s, HV = args["g"].shape
    K, V = args["state"].shape[2:]
    args["g"] = randn((B, s, HV), g_, dtype=dt)
    args["state"] = args["state"].transpose(-1, -2).contiguous()
    args.update(A_log=rand((HV,), g_, lo=-1.0, hi=0.5), dt_bias=randn((HV,), g_, dtype=dt),
                intermediate_states=randn((B, s, HV, V, K), g_))
    idx = torch.tensor([3, -1, 0], dtype=torch.int32, device=P.device)
    accepted = torch.tensor([1, 2, 2], dtype=torch.int32, device=P.device)

    def run(a):
        return gq.gated_delta_rule_decode(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], idx,
                                          accepted=accepted, intermediate_states=a["intermediate_states"],
                                          use_gate_in_kernel=True, A_log=a["A_log"], dt_bias=a["dt_bias"],
                                          state_layout="vk")
    return args, run, list(args), ["state", "intermediate_states"], None


def _fused_recurrent(dt, g_):
    B, T, H, HV, K, V = 2, 5, 1, 2, pick(16, 128), pick(16, 128)
    k = torch.nn.functional.normalize(randn((B, T, H, K), g_), dim=-1).to(dt)
    args = dict(q=randn((B, T, H, K), g_, dtype=dt), k=k, v=randn((B, T, HV, V), g_, dtype=dt),
                g=-rand((B, T, HV), g_, hi=0.5, dtype=dt), beta=rand((B, T, HV), g_, dtype=dt),
                initial_state=randn((B, HV, K, V), g_, scale=0.5))

    def run(a):
        return gq.fused_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], beta=a["beta"],
                                                   initial_state=a["initial_state"], output_final_state=True)
    return args, run, list(args), [], None


def _paged(B, L, page, g_):
    pages = -(-L // page)
    bt = torch.randperm(B * pages, generator=g_).to(torch.int32).view(B, pages).to(P.device)
    lens = torch.tensor([L, L // 2, 1][:B], dtype=torch.int32, device=P.device)
    return bt, lens


def _mla(dt, g_):
    B, h, D, dv, page, L = 3, pick(4, 64), pick(48, 576), pick(32, 512), pick(16, 64), pick(40, 300)
    bt, lens = _paged(B, L, page, g_)
    args = dict(q=randn((B, 2, h, D), g_, dtype=dt), kv_cache=randn((bt.numel(), page, 1, D), g_, dtype=dt))

    def run(a):
        return gq.mla_decode(a["q"], a["kv_cache"], bt, lens, dv)
    return args, run, ["q", "kv_cache"], [], None


def _mla_sparse_prefill(dt, g_):
    s_q, h, D, dv, s_kv, topk = pick(5, 64), pick(4, 64), pick(48, 576), pick(32, 512), pick(40, 512), pick(16, 128)
    idx = torch.randint(-2, s_kv + 2, (s_q, 1, topk), generator=g_, dtype=torch.int32).to(P.device)
    args = dict(q=randn((s_q, h, D), g_, dtype=dt), kv=randn((s_kv, 1, D), g_, dtype=dt))

    def run(a):
        return tuple(gq.mla_sparse_prefill(a["q"], a["kv"], idx, dv))
    return args, run, ["q", "kv"], [], None


def _gqa(dt, g_):
    B, page, L, hk, d, dr = 3, 16, pick(40, 300), 2, pick(16, 128), pick(16, 64)
    bt, lens = _paged(B, L, page, g_)
    n = bt.numel()
    args = dict(q=randn((B, 2, 4 * hk, d + dr), g_, dtype=dt), k_cache=randn((n, page, hk, d), g_, dtype=dt),
                v_cache=randn((n, page, hk, d), g_, dtype=dt), k_rope_cache=randn((n, page, dr), g_, dtype=dt))

    def run(a):
        return gq.gqa_decode(a["q"], a["k_cache"], a["v_cache"], bt, lens, a["k_rope_cache"])
    return args, run, list(args), [], None


def _flash_mla(dt, g_):
    B, h, D, dv, page, L = 3, pick(4, 64), pick(48, 576), pick(32, 512), pick(16, 64), pick(40, 300)
    bt, lens = _paged(B, L, page, g_)
    args = dict(q=randn((B, 1, h, D), g_, dtype=dt), k_cache=randn((bt.numel(), page, 1, D), g_, dtype=dt))

    def run(a):
        meta = gq.get_mla_metadata()[0]
        return gq.flash_mla_with_kvcache(a["q"], a["k_cache"], bt, lens, dv, meta, causal=True)
    return args, run, ["q", "k_cache"], [], None


def _prep_dims():
    return 1, pick(16, 128), 2, pick(16, 128), 4  # H, K, HV, V, W


def _decode_prep(dt, g_):
    H, K, HV, V, W = _prep_dims()
    C, B, T, P_ = 2 * H * K + HV * V, 2, 2, 3
    args = dict(mixed=randn((B, T, C + HV * V + 2 * HV), g_, dtype=dt), conv_weight=randn((C, 1, W), g_, dtype=dt),
                conv_state=randn((P_, C, W - 1), g_, dtype=dt), A_log=randn((HV,), g_, dtype=dt),
                dt_bias=randn((HV,), g_, dtype=dt))
    seqlens = torch.tensor([5, 0, 9], dtype=torch.int32, device=P.device)
    slots = torch.tensor([2, -1], dtype=torch.int32, device=P.device)
    lens = []

    def run(a):
        lens.append(seqlens.clone())
        return gds.gdn_decode_prep(a["mixed"], a["conv_weight"], a["conv_state"], lens[-1], slots, a["A_log"],
                                   a["dt_bias"], num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    return args, run, list(args), ["conv_state"], None


def _gated_norm(dt, g_):
    B, T, HV, V = 2, 3, 2, pick(16, 128)
    rows = torch.tensor([0, -1], dtype=torch.int32, device=P.device)
    args = dict(o=randn((B, T, HV, V), g_, dtype=dt), z=randn((B, T, HV, V), g_, dtype=dt),
                weight=1 + randn((V,), g_, dtype=dt, scale=0.1))

    def run(a):
        return gds.gdn_gated_norm(a["o"], a["z"], a["weight"], 1e-6, rows)
    return args, run, list(args), [], None


def _rope_dims():
    return pick(16, 128), pick(16, 64), pick(32, 512), 8, 2  # head_dim, d_R, r, h, g


def _cos_sin(B, T, dr, g_):
    pos = torch.randint(0, 5000, (B, T), generator=g_).to(P.device)
    inv = rope_inv_freq(dr, 10000.0, device=P.device)
    ang = pos.double()[..., None] * inv
    return torch.stack([ang.cos(), ang.sin()], 2).float()


def _absorb_q(dt, g_):
    hd, dr, r, h, g = _rope_dims()
    B, T = 2, 2
    args = dict(q=randn((B, T, h, hd + dr), g_, dtype=dt), w_uk=randn((g, hd, r), g_, dtype=dt, scale=hd ** -0.5),
                cos_sin=_cos_sin(B, T, dr, g_))

    def run(a):
        return gs.absorb_q(a["q"], a["w_uk"], a["cos_sin"], head_dim=hd, out_dtype=dt)
    return args, run, list(args), [], None


def _absorb_o(dt, g_):
    hd, dr, r, h, g = _rope_dims()
    args = dict(o=randn((2, 2, h, r), g_, dtype=dt), w_uv=randn((g, hd, r), g_, dtype=dt, scale=r ** -0.5))

    def run(a):
        return gs.absorb_o(a["o"], a["w_uv"])
    return args, run, list(args), [], None


def _grouped_q(dt, g_):
    hd, dr, r, h, g = _rope_dims()
    args = dict(q=randn((2, 2, h, hd + dr), g_, dtype=dt), cos_sin=_cos_sin(2, 2, dr, g_))

    def run(a):
        return gs.grouped_q(a["q"], a["cos_sin"], head_dim=hd, out_dtype=dt)
    return args, run, list(args), [], None


def _norm_rope(dt, g_):
    hd, dr, r, h, g = _rope_dims()
    B, T, qr = 2, 2, pick(24, 384)
    args = dict(qa=randn((B, T, qr), g_, dtype=dt), qa_weight=1 + randn((qr,), g_, dtype=dt, scale=0.1),
                kv=randn((B, T, r + dr), g_, dtype=dt), kv_weight=1 + randn((r,), g_, dtype=dt, scale=0.1),
                inv_freq=rope_inv_freq(dr, 10000.0, device=P.device))
    pos = torch.randint(0, 5000, (B, T), generator=g_).to(P.device)

    def run(a):
        return gs.norm_rope(a["qa"], a["qa_weight"], a["kv"], a["kv_weight"], pos, a["inv_freq"], add_t=False,
                            kv_rank=r, out_dtype=dt)
    return args, run, list(args), [], None


OPS = {"chunk": _gdn_chunk, "chunk_pool": _gdn_chunk_pool, "gdn_decode": _gdn_decode,
       "gdn_decode_spec": _gdn_decode_spec,
       "fused_recurrent": _fused_recurrent, "mla_decode": _mla, "mla_sparse_prefill": _mla_sparse_prefill,
       "gqa_decode": _gqa, "flash_mla": _flash_mla, "decode_prep": _decode_prep, "gated_norm": _gated_norm,
       "absorb_q": _absorb_q, "absorb_o": _absorb_o, "grouped_q": _grouped_q, "norm_rope": _norm_rope}
# ops whose GPU launch may pick another kernel for a misaligned view (sm_90 Gluon chunked GDN needs 16-byte q, k, v):
# compared with the float64 reference there instead of bit for bit
ROUTED = {"chunk", "chunk_pool"}
# caches read in place with 16-byte loads (``check_rows_aligned``): refused on a GPU unless their rows are aligned
CACHES = {("mla_decode", "kv_cache"), ("flash_mla", "k_cache"), ("gqa_decode", "k_cache"), ("gqa_decode", "v_cache"),
          ("gqa_decode", "k_rope_cache"), ("mla_sparse_prefill", "kv")}


def _refusal(op: str, name: str, view: torch.Tensor) -> str | None:
    """The message a refusal of ``view`` as ``name`` must match, or None where the call must take it."""
    if name in ("state", "conv_state", "intermediate_states") or (op == "chunk_pool" and name == "initial_state"):
        if not view.is_contiguous():  # pools written in place without strides
            return f"^{name}: .*contiguous"
        if view.is_cuda and view.data_ptr() % 16:  # and, on a GPU, from a 16-byte boundary
            return f"^{name}: expected a start address on a 16-byte boundary on the GPU"
    if ((op, name) in CACHES or op == "gqa_decode") and view.stride(-1) != 1:
        return f"^{name}: the last dimension must be contiguous"
    if name == "cos_sin" and not view.is_contiguous():  # norm_rope's output, read without strides
        return f"^{name}: expected a contiguous tensor"
    if (op, name) in CACHES and view.is_cuda and not rows_aligned(view):
        return f"^{name}: the kernels read its rows in place"
    return None


def _compare(op, name, got, want, dt, ref, args):
    """``got`` bit for bit ``want``; on a GPU, for an op of ``ROUTED``, within the data-derived bound of
    ``ref(args)`` (float64, ``args`` as before the calls) instead."""
    r = _flat(ref(args)) if P.big and op in ROUTED else None
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        if r is not None:
            assert_close(f"{op} {name} output {i}", x, r[i], y, dtype=dt)
        else:
            assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                         and torch.equal(x.nan_to_num(), y.nan_to_num())), \
                f"{op} {name} output {i} differs from the contiguous call's"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", list(OPS))
def test_activation_views_equal_contiguous_or_are_refused(op, kind):
    """Each activation argument, alone, as a ``kind`` view: the contiguous call's outputs and in-place states (bit
    for bit where the same kernel runs), or a refusal naming it that leaves every state as it was; the view's
    buffer outside it unchanged; no access outside the given tensors' own elements."""
    dt = P.dtypes[0]
    args, run, names, written, ref = OPS[op](dt, gen(1234))
    want = None
    for name in names:
        if kind == "expanded":  # its rows made equal, for both calls
            args = {**args, name: args[name][:1].expand(args[name].shape).contiguous()}
        if want is None or kind == "expanded":
            want_args = _clone_args(args)
            want = _flat(run(want_args)) + [want_args[n] for n in written]
        a = _clone_args(args)
        a[name] = _view(args[name], kind)
        before = {n: a[n].clone() for n in written}
        expect = _refusal(op, name, a[name])
        if expect is not None:
            with pytest.raises((ValueError, TypeError), match=expect):
                run(a)
            for n in written:
                assert torch.equal(a[n], before[n]), f"{op}: a refused {name} changed {n}"
        else:
            got = _flat(address_checked(lambda a=a: run(a), *a.values())) + [a[n] for n in written]
            _compare(op, name, got, want, dt, ref, args)
        _gaps_untouched(a[name])


POOL_OPS = {op: f(torch.float32, gen(0))[3] for op, f in OPS.items() if op in ("chunk_pool", "gdn_decode",
                                                                                 "gdn_decode_spec", "decode_prep")}


@pytest.mark.parametrize("op, pool", [(op, n) for op, names in POOL_OPS.items() for n in names])
def test_pools_off_a_boundary_are_refused_under_the_gpu_rule(op, pool, monkeypatch):
    """Every pool an op writes in place, one element past a 16-byte boundary, is refused by name with every state
    unchanged, checked on any device by applying the GPU's start-address rule (``validation.aligned_start``) to
    the profile's tensors: the public checks, not a custom op's body that an eager route skips, must hold the
    rule. The ops' memos of checked calls start empty, as they hold answers of the profile's own rule."""
    import importlib

    from gqla_triton.ops._common import memo, validation

    monkeypatch.setattr(validation, "aligned_start", lambda t: t.data_ptr() % 16 == 0)
    for mod in ("gqa.api", "mla.api", "gdn.api", "gdn.decode"):
        monkeypatch.setattr(importlib.import_module(f"gqla_triton.ops.{mod}"), "_CHECKED", memo.CheckedCalls())
    args, run, _, written, _ = OPS[op](P.dtypes[0], gen(1234))
    a = _clone_args(args)
    a[pool] = _view(args[pool], "offset")
    before = {n: a[n].clone() for n in written}
    with pytest.raises(ValueError, match=f"^{pool}: expected a start address on a 16-byte boundary"):
        run(a)
    for n in written:
        assert torch.equal(a[n], before[n]), f"{op}: a refused {pool} changed {n}"
    _gaps_untouched(a[pool])


def test_decode_prep_lengths_off_a_boundary_under_the_gpu_rule(monkeypatch):
    """The prep's int32 lengths, one per slot, read and written one element at a time, may start off a 16-byte
    boundary under the GPU's start-address rule: the lengths and the conv rows equal the aligned call's."""
    from gqla_triton.ops._common import validation

    monkeypatch.setattr(validation, "aligned_start", lambda t: t.data_ptr() % 16 == 0)
    H, K, HV, V, W = _prep_dims()
    dt, g_ = P.dtypes[0], gen(77)
    C = 2 * H * K + HV * V
    mixed = randn((2, 2, C + HV * V + 2 * HV), g_, dtype=dt)
    conv_w, pool = randn((C, 1, W), g_, dtype=dt), randn((3, C, W - 1), g_, dtype=dt)
    A_log, dt_bias = randn((HV,), g_, dtype=dt), randn((HV,), g_, dtype=dt)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=P.device)
    buf = torch.tensor([-7, 5, 0, 9], dtype=torch.int32, device=P.device)
    dims = dict(num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    want_pool, want_lens = pool.clone(), buf[1:].clone()
    want = gds.gdn_decode_prep(mixed, conv_w, want_pool, want_lens, slots, A_log, dt_bias, **dims)
    got_pool, lens = pool.clone(), buf[1:]
    assert lens.data_ptr() % 16 == 4
    got = gds.gdn_decode_prep(mixed, conv_w, got_pool, lens, slots, A_log, dt_bias, **dims)
    for i, (x, y) in enumerate(zip(_flat(got), _flat(want), strict=True)):
        assert torch.equal(x, y), f"output {i} differs from the aligned call's"
    assert torch.equal(got_pool, want_pool) and torch.equal(lens, want_lens) and int(buf[0]) == -7


@pytest.mark.parametrize("op", ["absorb_q", "absorb_o", "norm_rope", "gated_norm", "decode_prep"])
def test_weights_expanded_along_their_first_dim(op):
    """Weights whose rows are one row expanded (stride 0, start address off 16 bytes) give the contiguous call's
    result."""
    dt = P.dtypes[0]
    args, run, names, written, _ = OPS[op](dt, gen(99))
    name = {"absorb_q": "w_uk", "absorb_o": "w_uv", "norm_rope": "inv_freq", "gated_norm": "weight",
            "decode_prep": "conv_weight"}[op]
    w = args[name]
    args[name] = w[:1].expand(w.shape).contiguous()
    want_args = _clone_args(args)
    want = _flat(run(want_args)) + [want_args[n] for n in written]
    a = _clone_args(args)
    a[name] = _view(args[name], "expanded")
    got = _flat(address_checked(lambda: run(a), *a.values())) + [a[n] for n in written]
    _compare(op, name, got, want, dt, None, args)
    _gaps_untouched(a[name])


def _seeded(m, seed):
    g_ = gen(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(randn(p.shape, g_, dtype=torch.float64, device="cpu", scale=p.shape[-1] ** -0.5))
    return m


def _layer(layer: str, dt, impl: str):
    """The layer with seeded weights, in ``dt`` on the profile's device; its hidden size."""
    if layer == "gdn":
        hidden, H, K = pick(32, 512), 2, pick(16, 128)
        m = gq.GatedDeltaNet(hidden, H, 2 * H, K, K, conv_size=4, impl=impl, device="cpu", dtype=dt)
    else:
        dims = pick((64, 8, 2, 16, 16, 32), (1024, 32, 8, 128, 64, 512))
        hidden = dims[0]
        m = gq.GQLAttention(*dims, impl=impl, device="cpu", dtype=dt)
    return _seeded(m, 5).to(P.device), hidden


def _cache_tensors(cache) -> list:
    return [t for t in vars(cache).values() if isinstance(t, torch.Tensor)]


def _same_or_close(what, got, want, ref, dt):
    """Bit for bit, or where torch's own matmuls took other kernels for the other layout (they may, on the CPU
    too), within the data-derived bound of the float64 layer's result."""
    if torch.equal(got, want):
        return
    assert got.is_floating_point(), f"{what} differs from the contiguous calls'"
    assert_close(what, got, ref, want, dtype=dt)


@pytest.mark.parametrize("kind", ["offset", "column", "transposed"])
@pytest.mark.parametrize("layer", ["gdn", "gqla_absorb", "gqla_grouped"])
def test_layer_steps_take_misaligned_hidden_states(layer, kind):
    """A prefill then a decode step of each layer with ``hidden_states`` as a ``kind`` view: the outputs and the
    cache of the contiguous calls."""
    dt = P.dtypes[0]
    m, hidden = _layer(layer.split("_")[0], dt, "auto" if layer == "gdn" else "triton")
    m64 = _layer(layer.split("_")[0], torch.float64, "reference")[0]
    T0 = pick(9, 40)
    xs = [randn((2, T0, hidden), gen(7), dtype=dt), randn((2, 1, hidden), gen(8), dtype=dt)]

    def steps(model, inputs):
        if layer == "gdn":
            cache = model.init_cache(2)
            outs = [model(x, cache) for x in inputs]
        else:
            cache = model.make_cache(2, T0 + 1, path=layer.split("_")[1], page_size=16)
            outs = [model(inputs[0], torch.arange(T0, device=P.device), cache, seq_ids=[0, 1]),
                    model(inputs[1], None, cache, seq_ids=[0, 1])]
        return outs + _cache_tensors(cache)

    with torch.no_grad():
        want = steps(m, xs)
        views = [_view(x, kind) for x in xs]
        got = steps(m, views)
        ref = steps(m64, [x.double() for x in xs])
    for v in views:
        _gaps_untouched(v)
    for i, (x, y, r) in enumerate(zip(got, want, ref, strict=True)):
        _same_or_close(f"{layer} {'step' if i < 2 else 'cache tensor'} {i}", x, y, r, dt)
