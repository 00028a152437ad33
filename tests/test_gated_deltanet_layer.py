"""GatedDeltaNet layer (layers/gated_deltanet.py): prefill + decode == prefill, varlen == loop, grads vs reference.

Every low-precision result is judged against the float64 reference layer (same weights) with the data-derived
tolerance of the harness: the low-precision reference layer (same dtype, pure torch) sets the error bound.
"""

import copy

import pytest
import torch
from harness import P, assert_close, assert_close_token_sum, dtypes, examples, gen, pick, randn, rel_err, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gqla_triton.layers import GatedDeltaNet
from gqla_triton.layers.gated_deltanet import GatedDeltaNetCache

IMPLS = ["triton", "reference"]
FEW = settings(max_examples=examples(3, 25))  # every example runs the chunked op: slow under the interpreter


def _layer(H, G, D, dtype, seed, impl="triton"):
    torch.manual_seed(seed)
    hidden = pick(32, 256)
    m = GatedDeltaNet(hidden, H, H * G, D, D, conv_size=4, impl="reference", device=P.device, dtype=torch.float64)
    m = m.to(dtype)
    m.impl = impl  # a float64 layer of a kernel impl only serves as a base for ``_as``
    return m


def _as(m, impl, dtype):
    c = copy.deepcopy(m).to(dtype)
    c.impl = impl
    return c


def _check(name, out, out64, lowp, dtype, factor=2.0):
    assert_close(name, out, out64, lowp, dtype=dtype, factor=factor)


@pytest.mark.parametrize("impl", IMPLS)
@FEW
@given(N=st.integers(1, pick(2, 4)), T=st.integers(1, pick(12, 150)), steps=st.lists(st.integers(1, 2), min_size=1,
       max_size=3), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]), extra=st.integers(0, 2), dtype=dtypes(),
       seed=seeds())
def test_prefill_then_decode_equals_prefill(impl, N, T, steps, H, G, extra, dtype, seed):
    """Prefill T tokens, then decode steps of 1-2 tokens == one prefill of all tokens (outputs and caches).

    The cache has extra rows and the batch lives at random slots: the other rows must stay untouched.
    """
    D = pick(16, 128)
    base = _layer(H, G, D, torch.float64, seed)
    g = gen(seed)
    total = T + sum(steps)
    x64 = randn((N, total, base.hidden_size), g, dtype=torch.float64)
    slots = torch.randperm(N + extra, generator=g)[:N].to(torch.int32).to(P.device)

    # float64 reference layer over all tokens at once; and the same computation at the low precision
    r64 = _as(base, "reference", torch.float64)
    c64 = r64.init_cache(N)
    out64 = r64(x64, c64)
    rlp = _as(base, "reference", dtype)
    clp = rlp.init_cache(N)
    outlp = rlp(x64.to(dtype), clp)

    m = _as(base, impl, dtype)
    cache = m.init_cache(N + extra)
    cache.slots = slots.tolist()  # host slot ids: the first call is a prefill into fresh slots
    with torch.no_grad():
        cache.recurrent_state.normal_()  # rows outside `slots` hold garbage that must survive
        cache.conv_state.normal_()
    others = torch.ones(N + extra, dtype=torch.bool, device=P.device)
    others[slots.long()] = False
    keep_s, keep_c = cache.recurrent_state[others].clone(), cache.conv_state[others].clone()
    cache.recurrent_state[slots.long()] = 0  # a fresh sequence starts from zero state
    cache.conv_state[slots.long()] = 0
    x = x64.to(dtype)
    with torch.no_grad():
        outs = [m(x[:, :T], cache)]
        t = T
        for s in steps:
            outs.append(m(x[:, t:t + s], cache))
            t += s
    out = torch.cat(outs, 1)
    _check("out (prefill + decode)", out, out64, outlp, dtype)
    _check("recurrent state", cache.recurrent_state[slots.long()], c64.recurrent_state, clp.recurrent_state,
           torch.float32)
    _check("conv state", cache.conv_state[slots.long()], c64.conv_state, clp.conv_state, dtype)
    assert torch.equal(cache.recurrent_state[others], keep_s)
    assert torch.equal(cache.conv_state[others], keep_c)

    # the same layer prefilling everything in one call agrees with it
    c_full = m.init_cache(N)
    with torch.no_grad():
        out_full = m(x, c_full)
    e_low = rel_err(outlp, out64)
    assert rel_err(out, out_full) <= 4 * e_low + 4e-5 * (1 if dtype == torch.float32 else 50), \
        (rel_err(out, out_full), e_low)


@pytest.mark.parametrize("impl", IMPLS)
@FEW
@given(lens=st.lists(st.integers(1, pick(8, 300)), min_size=2, max_size=pick(3, 5)), H=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
def test_varlen_prefill_equals_per_sequence_loop(impl, lens, H, G, dtype, seed):
    """Packed sequences (cu_seqlens) == each sequence alone: outputs and cached states; no conv leakage."""
    D = pick(16, 128)
    base = _layer(H, G, D, torch.float64, seed)
    g = gen(seed)
    Ttot = sum(lens)
    cu = torch.tensor([0] + lens, device=P.device).cumsum(0)
    x64 = randn((1, Ttot, base.hidden_size), g, dtype=torch.float64)

    def loop(layer, x):
        cache = layer.init_cache(len(lens))
        outs = []
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            c = layer.init_cache(1)
            outs.append(layer(x[:, a:b], c))
            cache.recurrent_state[n] = c.recurrent_state[0]
            cache.conv_state[n] = c.conv_state[0]
        return torch.cat(outs, 1), cache

    with torch.no_grad():
        out64, c64 = loop(_as(base, "reference", torch.float64), x64)
        outlp, clp = loop(_as(base, "reference", dtype), x64.to(dtype))
        m = _as(base, impl, dtype)
        cache = m.init_cache(len(lens))
        out = m(x64.to(dtype), cache, cu_seqlens=cu)
    _check("out (varlen)", out, out64, outlp, dtype)
    _check("recurrent state (varlen)", cache.recurrent_state, c64.recurrent_state, clp.recurrent_state,
           torch.float32)
    _check("conv state (varlen)", cache.conv_state, c64.conv_state, clp.conv_state, dtype)


def module_grads(layer, x64, w, cu, dtype):
    """Output, gradients {"x", parameter names...} of sum(out·w), and the decay g [B, T, HV] the layer passed to its
    op, with its gradient (``.grad``) kept."""
    x = x64.to(dtype).clone().requires_grad_(True)
    seen = {}
    rule = layer._rule

    def spy(q, k, v, g, beta, *rest):
        g.retain_grad()
        seen["g"] = g
        return rule(q, k, v, g, beta, *rest)

    layer._rule = spy
    out = layer(x, cu_seqlens=cu)
    (out.to(torch.float64) * w).sum().backward()
    return out, {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}, seen["g"]


def check_module_gradients(B, T, H, G, varlen, dtype, seed):
    """Triton layer gradients (input and every parameter) vs the float64 reference layer. A_log and dt_bias, token
    sums of the op's dg, are judged through dg per token (``assert_close_token_sum``)."""
    D = pick(16, 128)
    base = _layer(H, G, D, torch.float64, seed)
    g = gen(seed)
    cu = None
    if varlen:
        cut = int(torch.randint(0, T + 1, (1,), generator=g))
        cu = torch.tensor([0, cut, T], device=P.device)
        B = 1
    x64 = randn((B, T, base.hidden_size), g, dtype=torch.float64)
    w = randn((B, T, base.hidden_size), g, dtype=torch.float64)
    r64 = _as(base, "reference", torch.float64)
    o64, g64, d64 = module_grads(r64, x64, w, cu, torch.float64)
    olp, glp, dlp = module_grads(_as(base, "reference", dtype), x64, w, cu, dtype)
    o, gt, dg = module_grads(_as(base, "triton", dtype), x64, w, cu, dtype)
    _check("out", o, o64, olp, dtype)
    # A_log and dt_bias get token sums of the op's dg: dg·∂g/∂A_log = dg·g and dg·∂g/∂dt_bias = dg·(-e^A_log·σ(z))
    with torch.no_grad():
        z = r64.split_in_proj(r64.in_proj(x64))[5] + r64.dt_bias
        dgdp = {"A_log": d64.detach(), "dt_bias": -torch.exp(r64.A_log) * torch.sigmoid(z)}
    for name in g64:
        if name in dgdp:
            assert_close_token_sum(f"grad {name}", gt[name], g64[name], glp[name], dg.grad, d64.grad, dlp.grad,
                                   dgdp[name], dtype=dtype)
        else:
            _check(f"grad {name}", gt[name], g64[name], glp[name], dtype)


@FEW
@given(B=st.integers(1, 2), T=st.integers(1, pick(10, 130)), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
       varlen=st.booleans(), dtype=dtypes(), seed=seeds())
@example(B=2, T=7, H=2, G=2, varlen=False, dtype=P.dtypes[0], seed=3)  # the dense path, whatever the draws
def test_module_gradients_match_reference(B, T, H, G, varlen, dtype, seed):
    check_module_gradients(B, T, H, G, varlen, dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
def test_continued_prefill_varlen_then_dense(impl):
    """Packed prefill in two pieces, then a long dense piece (chunked op from cached states), then a decode
    step == each sequence prefilled alone in one call (float64 reference)."""
    base = _layer(2, 2, pick(16, 128), torch.float64, 11)
    g = gen(11)
    a, b, long_ = [3, 7], [5, 2], 17
    xs = [randn((1, a[i] + b[i] + long_ + 1, base.hidden_size), g, dtype=torch.float64) for i in range(2)]
    dt = P.dtypes[0]  # float32 under the interpreter, bf16 on the GPU
    m = _as(base, impl, dt)
    cache = m.init_cache(2)
    cu1, cu2 = (torch.tensor([0, n[0], n[0] + n[1]], device=P.device) for n in (a, b))
    with torch.no_grad():
        o1 = m(torch.cat([xs[0][:, :3], xs[1][:, :7]], 1).to(dt), cache, cu_seqlens=cu1)
        o2 = m(torch.cat([xs[0][:, 3:8], xs[1][:, 7:9]], 1).to(dt), cache, cu_seqlens=cu2)
        tail = torch.cat([x[:, a[i] + b[i]:] for i, x in enumerate(xs)], 0).to(dt)
        o3 = m(tail[:, :long_], cache)
        o4 = m(tail[:, long_:], cache)
        r64, rlp = _as(base, "reference", torch.float64), _as(base, "reference", dt)
        for i in range(2):
            ref, low = r64(xs[i], r64.init_cache(1)), rlp(xs[i].to(dt), rlp.init_cache(1))
            first = o1[:, :3] if i == 0 else o1[:, 3:]
            second = o2[:, :5] if i == 0 else o2[:, 5:]
            out = torch.cat([first, second, o3[i:i + 1], o4[i:i + 1]], 1)
            _check(f"seq {i}", out, ref, low, dt)


def test_layer_bad_inputs():
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(32, 3, 4, 16, 16)
    with pytest.raises(ValueError, match="impl"):
        GatedDeltaNet(32, 2, 4, 16, 16, impl="cuda")
    with pytest.raises(ValueError, match="conv_size"):
        GatedDeltaNet(32, 2, 4, 16, 16, conv_size=1)
    m = GatedDeltaNet(32, 2, 4, 16, 16, device=P.device, impl="reference")
    with pytest.raises(ValueError, match="hidden_states"):
        m(torch.zeros(1, 3, 16, device=P.device))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.zeros(2, 3, 32, device=P.device), cu_seqlens=torch.tensor([0, 1, 3], device=P.device))
    cache = m.init_cache(1)
    with pytest.raises(ValueError, match="cache"):
        m(torch.zeros(2, 3, 32, device=P.device), cache)
    cache = GatedDeltaNetCache(3, m.conv_dim, 4, 4, 16, 16, device=P.device)
    cache.slots = torch.tensor([0, 1], dtype=torch.int64, device=P.device)
    with pytest.raises(TypeError, match="slots"):
        m(torch.zeros(2, 3, 32, device=P.device), cache)


@pytest.mark.gpu_only
def test_layer_decode_torch_compile():
    base = _layer(2, 2, 128, torch.float64, 0)
    m = _as(base, "triton", torch.bfloat16)
    x = randn((4, 9, m.hidden_size), 1, dtype=torch.bfloat16)
    c1, c2 = m.init_cache(4), m.init_cache(4)
    with torch.no_grad():
        m(x[:, :8], c1)
        m(x[:, :8], c2)
        step = torch.compile(m)
        o1 = step(x[:, 8:], c1)
        o2 = m(x[:, 8:], c2)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(c1.recurrent_state, c2.recurrent_state)


@settings(max_examples=examples(4, 12))
@given(B=st.integers(1, 3), L=st.integers(1, 40), C=st.integers(1, 48), W=st.integers(2, 5), dtype=dtypes(),
       seed=seeds())
def test_depthwise_conv_matches_conv1d(B, L, C, W, dtype, seed):
    """The layer's short conv on either device == torch's depthwise conv1d in float64 (the data-derived bound:
    conv1d at the low precision)."""
    import torch.nn.functional as F

    from gqla_triton.layers.gated_deltanet import _depthwise_conv

    L = L + W - 1
    x64 = randn((B, L, C), seed, dtype=torch.float64)
    w64 = randn((C, 1, W), seed + 1, dtype=torch.float64)
    ref = F.conv1d(x64.cpu().transpose(1, 2), w64.cpu(), groups=C).transpose(1, 2)
    x, w = x64.to(dtype), w64.to(dtype)
    lowp = F.conv1d(x.float().cpu().transpose(1, 2), w.float().cpu(), groups=C).transpose(1, 2).to(dtype)
    out = _depthwise_conv(x, w)
    assert out.dtype == dtype and out.shape == (B, L - W + 1, C)
    assert_close("depthwise conv", out, ref, lowp, dtype=dtype)


def test_state_dict_with_separate_input_projections():
    """A state dict with the six input projections as separate q/k/v/z/b/a_proj weights loads into in_proj (joined
    in that order), also nested in a model; a wrong shape is a ValueError naming the key."""
    src = GatedDeltaNet(32, 2, 4, 16, 8, device=P.device, dtype=torch.float32)
    torch.nn.init.normal_(src.in_proj.weight)
    sd = src.state_dict()
    parts = src.split_in_proj(sd.pop("in_proj.weight"), 0)
    split = {**sd, **{f"{n}.weight": t.clone() for n, t in zip(GatedDeltaNet._SPLIT_PROJ, parts, strict=True)}}
    dst = GatedDeltaNet(32, 2, 4, 16, 8, device=P.device, dtype=torch.float32)
    dst.load_state_dict(split)
    assert torch.equal(dst.in_proj.weight, src.in_proj.weight)
    model = torch.nn.ModuleDict({"mixer": GatedDeltaNet(32, 2, 4, 16, 8, device=P.device, dtype=torch.float32)})
    model.load_state_dict({f"mixer.{k}": v for k, v in split.items()})
    assert torch.equal(model["mixer"].in_proj.weight, src.in_proj.weight)
    bad = dict(split, **{"b_proj.weight": split["b_proj.weight"][:1]})
    with pytest.raises(ValueError, match="b_proj.weight: expected shape"):
        dst.load_state_dict(bad)


def test_hf_loads_change_nothing_when_refused_and_take_their_own_rows():
    """``load_hf_state_dict`` refuses a meta or sparse weight before any parameter changes; ``load_hf_states``
    copies its sources first, so the cache's own rows load into permuted slots as a copy of them would."""
    m = GatedDeltaNet(32, 1, 2, 16, 16, impl="triton", dtype=torch.float32, device=P.device)
    sd = m.hf_state_dict()
    t = GatedDeltaNet(32, 1, 2, 16, 16, impl="triton", dtype=torch.float32, device=P.device)
    before = {k: v.clone() for k, v in t.state_dict().items()}
    for key, bad in (("out_proj.weight", sd["out_proj.weight"].to("meta")),
                     ("norm.weight", sd["norm.weight"].to_sparse())):
        with pytest.raises(ValueError, match=f"state_dict: {key} must be a dense tensor"):
            t.load_hf_state_dict({**sd, key: bad})
        assert all(torch.equal(v, before[k]) for k, v in t.state_dict().items()), key
    got, want = m.init_cache(3), m.init_cache(3)
    with torch.no_grad():
        for c in (got, want):
            c.recurrent_state.copy_(torch.arange(c.recurrent_state.numel(), dtype=torch.float32).view_as(
                c.recurrent_state))
        conv = randn((3, m.conv_dim, 4), gen(1))
        snap = got.recurrent_state.clone(), got.conv_state.clone()
        with pytest.raises(ValueError, match="recurrent_state: expected a dense"):
            got.load_hf_states(conv, got.recurrent_state.to_sparse(), slots=[2, 0, 1])
        assert torch.equal(got.recurrent_state, snap[0]) and torch.equal(got.conv_state, snap[1])
        got.load_hf_states(conv, got.recurrent_state, slots=[2, 0, 1])
        want.load_hf_states(conv, want.recurrent_state.clone(), slots=[2, 0, 1])
    assert torch.equal(got.recurrent_state, want.recurrent_state) and torch.equal(got.conv_state, want.conv_state)


def test_meta_construction_then_reset_parameters():
    """A layer built on meta and materialised as FSDP does (``to_empty`` + ``reset_parameters()`` of every module that
    holds parameters of its own): A_log, dt_bias and the norm weight are initialised as the constructor does (decays
    in ``exp(A_log) ∈ [1, 16]``, ``softplus(dt_bias) ∈ [1e-4, 0.1]``, ones)."""
    with torch.device("meta"):
        m = GatedDeltaNet(32, 1, 2, 16, 16, impl="reference", dtype=torch.float32)
    m.to_empty(device="cpu")
    with torch.no_grad():
        for mod in m.modules():
            if any(True for _ in mod.parameters(recurse=False)):
                mod.reset_parameters()
    a = m.A_log.detach().exp()
    dt = torch.nn.functional.softplus(m.dt_bias.detach())
    assert bool(((a >= 1 - 1e-5) & (a <= 16 + 1e-4)).all()), a
    assert bool(((dt >= 1e-4 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5))).all()), dt
    assert torch.equal(m.norm_weight, torch.ones_like(m.norm_weight))
    assert torch.isfinite(m(torch.randn(1, 5, 32))).all()


def test_kernel_impls_refuse_float64_at_construction():
    """The Triton kernels take bfloat16 / float16 / float32: a kernel impl in float64 is a TypeError naming dtype, from
    the constructor and from ``from_hf`` (an explicit dtype, or the weights' when dtype is None)."""
    import types

    dims = dict(hidden_size=32, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    for impl in ("auto", "triton"):
        with pytest.raises(TypeError, match=f"dtype: impl='{impl}' runs the Triton kernels.*got float64"):
            GatedDeltaNet(**dims, impl=impl, device=P.device, dtype=torch.float64)
    ref = GatedDeltaNet(**dims, impl="reference", device=P.device, dtype=torch.float64)
    sd = ref.hf_state_dict()
    cfg = types.SimpleNamespace(hidden_size=32, linear_num_key_heads=1, linear_num_value_heads=2,
                                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                rms_norm_eps=1e-6, hidden_act="silu")
    with pytest.raises(TypeError, match=r"dtype \(None: that of in_proj_qkvz.weight\): impl='auto'"):
        GatedDeltaNet.from_hf(cfg, sd)
    with pytest.raises(TypeError, match="dtype: impl='triton'"):
        GatedDeltaNet.from_hf(cfg, sd, impl="triton", dtype=torch.float64)
    assert GatedDeltaNet.from_hf(cfg, sd, impl="reference").in_proj.weight.dtype == torch.float64
    assert GatedDeltaNet.from_hf(cfg, sd, dtype=torch.float32).in_proj.weight.dtype == torch.float32


def test_bad_device_is_refused_by_name():
    """A device torch cannot name, or a CUDA device that does not exist here: a ValueError naming device, from the
    layer, the cache and init_cache."""
    dims = dict(hidden_size=32, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    m = GatedDeltaNet(**dims, device=P.device, dtype=torch.float32)
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    for bad in ("foo", "cuda:x", True, 1.5, object(), missing):
        err = ValueError if isinstance(bad, str) else TypeError  # another type than a device, str or int
        with pytest.raises(err, match="device"):
            GatedDeltaNet(**dims, device=bad, dtype=torch.float32)
        with pytest.raises(err, match="device"):
            GatedDeltaNetCache(2, m.conv_dim, 4, 2, 16, 16, device=bad)
        with pytest.raises(err, match="device"):
            m.init_cache(2, device=bad)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_token_counts_saturate_at_int32_max(impl):
    """A slot whose count is loaded near 2^31 − 1 stays there through a decode step, a prefill and a verify /
    commit: the int32 counts saturate instead of wrapping negative."""
    m = GatedDeltaNet(32, 2, 2, 16, 16, conv_size=4, impl=impl, device=P.device, dtype=torch.float32)
    cache = m.init_cache(3)
    conv = torch.randn(1, m.conv_dim, 4, device=P.device)
    cache.load_hf_states(conv, torch.randn(1, 2, 16, 16, device=P.device), slots=[0], seqlen=2**31 - 2)
    with torch.no_grad():
        m(torch.randn(1, 1, 32, device=P.device), cache, slots=[0])  # decode step
        assert cache.seqlens.tolist()[0] == 2**31 - 1
        m(torch.randn(1, 40, 32, device=P.device), cache, slots=[0])  # prefill
        assert cache.seqlens.tolist()[0] == 2**31 - 1
        m(torch.randn(1, 3, 32, device=P.device), cache, slots=[0], verify=True)
        cache.commit(torch.tensor([2], dtype=torch.int32, device=P.device))
    assert cache.seqlens.tolist() == [2**31 - 1, 0, 0]
    for cu in (None, torch.tensor([0, 3], dtype=torch.int32, device=P.device)):  # 3-token steps, dense and packed
        cache.load_hf_states(conv, torch.randn(1, 2, 16, 16, device=P.device), slots=[0], seqlen=2**31 - 2)
        with torch.no_grad():
            m(torch.randn(1, 3, 32, device=P.device), cache, cu, slots=[0])
        assert cache.seqlens.tolist() == [2**31 - 1, 0, 0]


def test_refused_prefill_keeps_freed_slots():
    """A prefill the chunked op refuses (more (batch x value head) programs than a launch takes) leaves a freed
    slot's states in place, as ``free()`` promises until a call succeeds."""
    HV = 64
    m = GatedDeltaNet(4, 1, HV, 16, 16, conv_size=2, device=P.device, dtype=torch.float32)
    B = 65535 // HV + 1
    cache = m.init_cache(B)
    cache.load_hf_states(torch.randn(B, m.conv_dim, 2, device=P.device), torch.randn(B, HV, 16, 16, device=P.device),
                         seqlen=7)
    cache.free()
    before = [t.clone() for t in (cache.recurrent_state, cache.conv_state, cache.seqlens)]
    with torch.no_grad(), pytest.raises(ValueError, match="programs"):
        m(torch.randn(B, 1, 4, device=P.device), cache)
    for t, old in zip((cache.recurrent_state, cache.conv_state, cache.seqlens), before, strict=True):
        assert torch.equal(t, old)


def test_layer_torch_compile_dynamic():
    """``torch.compile(fullgraph=True, dynamic=True)`` (the layer's float attributes symbolic) traces a cached
    prefill, host-slot decode steps and a verify step + commit, each equal to eager."""
    backend = "aot_eager"
    m = _as(_layer(1, 2, 16, torch.float64, 0), "triton", torch.float32)
    x = randn((2, 9, m.hidden_size), 1, dtype=torch.float32)
    f = torch.compile(m, fullgraph=True, backend=backend, dynamic=True)
    commit = torch.compile(lambda c, a: c.commit(a), fullgraph=True, backend=backend, dynamic=True)
    with torch.no_grad():
        c1, c2 = m.init_cache(2), m.init_cache(2)
        torch.testing.assert_close(f(x[:, :5], c1), m(x[:, :5], c2), rtol=0, atol=0)
        torch.testing.assert_close(f(x[:, 5:6], c1), m(x[:, 5:6], c2), rtol=0, atol=0)
        torch.testing.assert_close(f(x[:, 7:], c1, verify=True), m(x[:, 7:], c2, verify=True), rtol=0, atol=0)
        acc = torch.tensor([1, 2], dtype=torch.int32, device=P.device)
        commit(c1, acc)
        c2.commit(acc)
    for a, b in ((c1.conv_state, c2.conv_state), (c1.recurrent_state, c2.recurrent_state), (c1.seqlens, c2.seqlens)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_steps_under_autocast(impl):
    """Under float16 autocast (in_proj's output float16, the cache float32) a cached prefill, a dense decode step, a
    device-slot step and a verify step + commit run, close to the float64 layer."""
    base = _layer(1, 2, 16, torch.float64, 0)
    m = _as(base, impl, torch.float32)
    x64 = randn((2, 8, m.hidden_size), 1, dtype=torch.float64)
    ref = _as(base, "reference", torch.float64)(x64)
    x = x64.float()
    with torch.autocast(torch.device(P.device).type, dtype=torch.float16), torch.no_grad():
        c = m.init_cache(2)
        outs = [m(x[:, :4], c), m(x[:, 4:5], c),
                m(x[:, 5:6], c, slots=torch.tensor([0, 1], dtype=torch.int32, device=P.device)),
                m(x[:, 6:], c, verify=True)]
        c.commit(torch.tensor([2, 1], dtype=torch.int32, device=P.device))
    assert c.seqlens.tolist() == [8, 7]
    err = rel_err(torch.cat(outs, 1), ref)
    assert err <= 1e-2, err


def test_norm_eps_that_float32_flushes_is_refused_by_name():
    """The gated norm adds ``norm_eps`` in float32: a positive eps below float32's smallest normal number would be 0
    or subnormal there, and a zero input token (a padding token, documented to output 0) would give
    ``0 · rsqrt(0) = NaN`` where the float64 layer gives 0. Refused by name, as GQLAttention refuses it; the smallest
    normal number is taken, and a zero token outputs 0."""
    tiny = torch.finfo(torch.float32).tiny
    for eps in (1e-50, 1e-40, tiny / 2):
        with pytest.raises(ValueError, match="norm_eps"):
            GatedDeltaNet(32, 1, 2, 16, 16, norm_eps=eps, device=P.device, dtype=torch.float32)
    m = GatedDeltaNet(32, 1, 2, 16, 16, norm_eps=tiny, impl="triton", device=P.device, dtype=torch.float32)
    with torch.no_grad():
        out = m(torch.zeros(1, 2, 32, device=P.device))
    assert torch.equal(out, torch.zeros_like(out))
