"""Hostile arguments of the public API that reach torch / Python internals unless checked: each is refused by a
TypeError / ValueError naming the argument, or runs as its documented definition."""

import pytest
import torch
from harness import P, rand, randn

import gqla_triton as gq
from gqla_triton.layers import GatedDeltaNet
from gqla_triton.layers.cache import GroupedCache, LatentCache


def test_fused_recurrent_flag_tensor_is_refused_by_name():
    q = torch.randn(1, 3, 1, 16, device=P.device)
    v = torch.randn(1, 3, 1, 16, device=P.device)
    for g in (None, torch.zeros(1, 3, 1, device=P.device)):  # without g the flag would be read as a truth value
        with pytest.raises(TypeError, match="^use_gate_in_kernel: expected a bool"):
            gq.fused_recurrent_gated_delta_rule(q, q, v, g, use_gate_in_kernel=torch.tensor([1, 0]))


def test_latent_cache_appends_mixed_float8_inputs():
    """``c_kv`` float8_e5m2 with an fp32 ``k_rope``: torch.cat promotes no float8 dtype; the values are widened as
    it widens the others (exactly), so the rows equal those of the widened inputs."""
    c_kv = torch.randn(1, 3, 32, device=P.device).to(torch.float8_e5m2)
    k_rope = torch.randn(1, 3, 16, device=P.device)
    got, want = (LatentCache(1, 32, 32, 16, page_size=16, dtype=torch.float32, device=P.device) for _ in range(2))
    got.append([0], c_kv, k_rope)
    want.append([0], c_kv.float(), k_rope)
    assert all(torch.equal(a, b) for a, b in zip(got.gather(0), want.gather(0), strict=True))


def test_grouped_cache_from_latent_refuses_a_non_layer():
    lat = LatentCache(1, 32, 32, 16, page_size=16, dtype=torch.float32, device=P.device)
    for layer in (None, object()):
        with pytest.raises(TypeError, match="^layer: expected the GQLAttention"):
            GroupedCache.from_latent(lat, layer)


def _gdn_inputs(T=20, H=1, HV=2, K=16, V=16, seed=0):
    q, k, v = (randn(s, seed + i) for i, s in enumerate(((1, T, H, K), (1, T, H, K), (1, T, HV, V))))
    g = -rand((1, T, HV), seed + 3, hi=0.5)
    beta = rand((1, T, HV), seed + 4)
    return q, torch.nn.functional.normalize(k, dim=-1), v, g, beta


def test_chunk_double_backward_is_refused():
    """The backward kernels have no backward: differentiating the gradients again (a gradient penalty) raises
    instead of dropping the second-order terms."""
    q, k, v, g, beta = _gdn_inputs()
    q.requires_grad_()
    o, _ = gq.chunk_gated_delta_rule(q, k, v, g, beta)
    (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.square().sum().backward()


def test_chunk_double_backward_toward_the_inputs_is_refused():
    """A gradient penalty differentiated with ``torch.autograd.grad(..., inputs)`` reaches only the nodes that lead
    to those inputs: the refusal is one of them, so it raises too instead of leaving the op's second-order terms out
    (q through the in-kernel L2 norm, as the layer calls it, and q taken as is; the GatedDeltaNet layer too)."""
    for l2 in (True, False):
        q, k, v, g, beta = _gdn_inputs()
        q.requires_grad_()
        o, _ = gq.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2)
        (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.grad(dq.square().sum(), q)
    layer = GatedDeltaNet(16, 1, 2, 16, 16, impl="triton", device=P.device)
    x = randn((1, 9, 16), 5).requires_grad_()
    (dx,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(dx.square().sum(), x)


def test_flash_qla_bwd_takes_do_in_the_outputs_dtype():
    """FlashQLA's backward entry point with ``do`` in another float dtype than the inputs: the gradients of the same
    values passed in the inputs' dtype (as autograd hands an output its gradient)."""
    from gqla_triton.ops.gdn.flash_qla import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

    q, k, v, g, beta = _gdn_inputs(T=40)
    gc, A, o, *_ = chunk_gated_delta_rule_fwd(q, k, v, g, beta)
    do = randn(o.shape, 7).to(torch.float16)
    want = chunk_gated_delta_rule_bwd(q, k, v, gc, beta, A, do.to(v.dtype))
    got = chunk_gated_delta_rule_bwd(q, k, v, gc, beta, A, do)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_state_written_in_place_must_not_alias_what_is_read():
    """A state pool (chunked op, decode step) or the decode step's intermediate states that share memory with an
    input are refused by name, the pool unchanged; a pool beside the inputs in one buffer (disjoint) runs."""
    q, k, v, g, beta = _gdn_inputs(T=4, HV=1)
    K, V = q.shape[-1], v.shape[-1]
    buf = randn((2 * K * V + q.numel(),), 9)
    pool = buf[:2 * K * V].view(2, 1, K, V)
    idx = torch.tensor([1], dtype=torch.int32, device=P.device)
    before = pool.clone()
    with torch.no_grad():
        for name, aliased in (("q", buf[K * V:K * V + q.numel()].view(q.shape)),):
            with pytest.raises(ValueError, match=f"initial_state: shares memory with {name}"):
                gq.chunk_gated_delta_rule(aliased, k, v, g, beta, initial_state=pool, state_indices=idx)
            with pytest.raises(ValueError, match=f"state: shares memory with {name}"):
                gq.gated_delta_rule_decode(aliased, k, v, g, beta, pool, idx)
        assert torch.equal(pool, before)
        inter = torch.zeros(1, 4, 1, K, V, device=P.device)
        with pytest.raises(ValueError, match="intermediate_states: shares memory with state"):
            gq.gated_delta_rule_decode(q, k, v, g, beta, inter.view(4, 1, K, V), idx, intermediate_states=inter)
        beside = buf[2 * K * V:].view(q.shape).copy_(q)
        o, _ = gq.chunk_gated_delta_rule(beside, k, v, g, beta, initial_state=pool, state_indices=idx)
        assert torch.isfinite(o).all()


def test_custom_ops_refuse_a_state_that_aliases_what_they_read():
    """The in-place GDN ops called as custom ops (a compiled graph's kernels, torch.ops directly) refuse a state
    sharing memory with an input by name, the state unchanged, as the public functions do."""
    import gqla_triton.ops.gdn.api  # noqa: F401 (registers the ops)
    import gqla_triton.ops.gdn.decode  # noqa: F401

    ops = torch.ops.gqla_triton
    q, k, v, g, beta = _gdn_inputs(T=4, HV=1)
    K, V = q.shape[-1], v.shape[-1]
    buf = randn((2 * K * V,), 9)
    pool = buf.view(2, 1, K, V)
    aliased = buf[K * V:K * V + q.numel()].view(q.shape)
    idx = torch.tensor([0], dtype=torch.int32, device=P.device)
    before = pool.clone()
    with torch.no_grad():
        with pytest.raises(ValueError, match="state: shares memory with q"):
            ops.gated_delta_rule_decode(aliased, k, v, g, beta, pool, idx, K ** -0.5, False, None, None, None, None,
                                        None, False, False, False, False)
        with pytest.raises(ValueError, match="state_pool: shares memory with q"):
            ops.chunk_gated_delta_rule_pool(aliased, k, v, g, beta, K ** -0.5, pool, idx, None, False, False, False,
                                            None, None, 64, "triton")
        inter = torch.zeros(1, 4, 1, K, V, device=P.device)
        with pytest.raises(ValueError, match="intermediate_states: shares memory with state"):
            ops.gated_delta_rule_decode(q, k, v, g, beta, inter.view(4, 1, K, V), idx, K ** -0.5, False, None, None,
                                        inter, None, None, False, False, False, False)
    assert torch.equal(pool, before)
    # compiled (inductor may hand the op the aliased memory itself): refused by name, or the read-first result
    want_pool = pool.clone()
    want = gq.gated_delta_rule_decode(aliased.clone(), k, v, g, beta, want_pool, idx)
    step = torch.compile(gq.gated_delta_rule_decode, fullgraph=True,
                         backend="aot_eager" if P.device == "cpu" else "inductor")
    try:
        got = step(aliased, k, v, g, beta, pool, idx)
    except ValueError as e:
        assert "state: shares memory with q" in str(e) and torch.equal(pool, before)
    else:
        assert torch.equal(got, want) and torch.equal(pool, want_pool)


def test_chunk_indices_on_another_device_is_refused():
    q, k, v, g, beta = _gdn_inputs()
    cu = torch.tensor([0, 10, 20], device=P.device)
    with pytest.raises(ValueError, match="chunk_indices: expected a tensor on"):
        gq.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                  chunk_indices=torch.tensor([[0, 0], [1, 0]], device="meta"))


def test_rms_norm_checks_its_input():
    from gqla_triton.layers import RMSNorm

    norm = RMSNorm(4)
    for bad, exc in ((torch.randn(4, 1), ValueError), (torch.randn(2, 5), ValueError), (torch.tensor(1.0), ValueError),
                     (torch.ones(1, 4, dtype=torch.int64), TypeError), ([1.0] * 4, TypeError)):
        with pytest.raises(exc, match="^x: "):
            norm(bad)


@pytest.mark.parametrize("tiny", [1e-300, 5e-324, -1e-39])
def test_scales_that_float32_flushes_are_refused(tiny):
    """A nonzero scale that float32 (the kernels' scalar) would make 0 or subnormal is refused by name: at 0 an
    infinite score would give 0 · inf = NaN where the float64 math gives ±inf. Exactly 0 runs."""
    q, k, v, g, beta = _gdn_inputs(T=8)
    with pytest.raises(ValueError, match="^scale: expected 0 or a magnitude"):
        gq.chunk_gated_delta_rule(q, k, v, g, beta, scale=tiny)
    gq.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.0)
    kv = randn((2, 16, 1, 48), 3)
    qm = randn((1, 1, 16, 48), 4)
    bt = torch.arange(2, dtype=torch.int32, device=P.device).view(1, 2)
    lens = torch.tensor([20], dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="^softmax_scale: expected 0 or a magnitude"):
        gq.mla_decode(qm, kv, bt, lens, 32, softmax_scale=tiny)
    gq.mla_decode(qm, kv, bt, lens, 32, softmax_scale=0.0)


def test_forward_only_decode_outputs_keep_their_guard():
    """Where an input requires grad (a descale, or q through FlashMLA's extra cache, whose result is merged outside
    the op) the outputs' backward raises instead of the graph being cut silently."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 16, 80, generator=g).to(P.device)
    kv8 = torch.randn(2, 16, 1, 80, generator=g).to(P.device, torch.float8_e4m3fn)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([30], dtype=torch.int32, device=P.device)
    kd = torch.tensor([0.5], device=P.device, requires_grad=True)
    out, _ = gq.mla_decode(q, kv8, bt, lens, 64, k_descale=kd, impl="triton")
    with pytest.raises(RuntimeError, match="forward-only"):
        out.float().sum().backward()
    qg = q.clone().requires_grad_()
    kv = torch.randn(2, 16, 1, 80, generator=g).to(P.device)
    idx = torch.tensor([[[0, 3, 17]]], dtype=torch.int32, device=P.device)
    out, lse = gq.flash_mla_with_kvcache(qg, kv, None, None, 64, gq.get_mla_metadata()[0], indices=idx,
                                         extra_k_cache=kv[:1], extra_indices_in_kvcache=idx % 16)
    for t in (out, lse):
        with pytest.raises(RuntimeError, match="forward-only"):
            t.float().sum().backward(retain_graph=True)


def test_flash_mla_sparse_cache_past_the_addressable_rows_is_refused():
    q = torch.randn(1, 1, 16, 80, device=P.device)
    idx = torch.tensor([[[0, 5, -1]]], dtype=torch.int32, device=P.device)
    for blocks, page in ((2**16, 2**16), (3, 2**29)):
        kv = torch.randn(1, 1, 1, 80, device=P.device).expand(blocks, page, 1, 80)  # a view: no memory
        with pytest.raises(ValueError, match="^k_cache: .* token rows"):
            gq.flash_mla_with_kvcache(q, kv, None, None, 64, gq.get_mla_metadata()[0], indices=idx)
    with pytest.raises(ValueError, match="^q: expected a head dim"):
        gq.flash_mla_sparse_fwd(q[0, :, :, :0], kv[:1, :4, :, :0].reshape(4, 1, 0), idx[0], None)


def _gqla(path, impl, dtype=torch.float32):
    torch.manual_seed(0)
    return gq.GQLAttention(32, 4, 2, head_dim=16, rope_dim=16, kv_rank=32, path=path, impl=impl, dtype=dtype,
                           device=P.device)


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_gqla_decode_under_autograd_never_gives_a_silently_wrong_gradient(path, impl):
    """A decode step reads the new tokens' rows back from the cache (stored detached): its backward raises, on the
    reference path as through the kernels' ops; the forward equals the one under no_grad."""
    a = _gqla(path, impl)
    x0, x1 = randn((1, 5, 32), 1), randn((1, 2, 32), 2)
    outs = []
    for grad in (False, True):
        c = a.make_cache(1, 64, page_size=16, path=path)
        with torch.no_grad():
            a(x0, cache=c)
        with torch.set_grad_enabled(grad):
            outs.append(a(x1.clone().requires_grad_(grad), cache=c))
    assert torch.equal(outs[0], outs[1].detach())
    with pytest.raises(RuntimeError, match="forward-only"):
        outs[1].square().sum().backward()


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_gqla_reference_decode_keeps_keys_it_does_not_see_out(path):
    """A NaN token that a query does not attend (causal MTP, sparse indices) reaches no output, on the reference
    path as in the kernels."""
    for impl in ("reference", "triton"):
        a = _gqla(path, impl)
        c = a.make_cache(1, 64, page_size=16, path=path)
        with torch.no_grad():
            a(randn((1, 4, 32), 3), cache=c)
            x = randn((1, 2, 32), 4)
            x[0, 1] = float("nan")
            y = a(x, cache=c)  # query 0 cannot see token 1
            y2 = a(randn((1, 1, 32), 5), cache=c, indices=torch.zeros(1, 1, 1, dtype=torch.int32, device=P.device))
        assert torch.isfinite(y[0, 0]).all() and torch.isnan(y[0, 1]).all(), impl
        assert torch.isfinite(y2).all(), impl


def test_gqla_sparse_indices_sharing_the_caches_memory_are_refused():
    a = _gqla("absorb", "triton")
    c = a.make_cache(2, 64, page_size=16)
    with torch.no_grad():
        a(randn((2, 5, 32), 6), cache=c)
        before = [t.clone() for t in (c.cache_seqlens, c.kv, c.block_table)]
        for kw in (dict(indices=c.cache_seqlens.view(2, 1, 1)),
                   dict(indices=torch.zeros(2, 1, 1, dtype=torch.int32, device=P.device),
                        topk_length=c.cache_seqlens[:2])):
            with pytest.raises(ValueError, match="cache.cache_seqlens: shares memory with (indices|topk_length)"):
                a(randn((2, 1, 32), 7), cache=c, **kw)
    assert all(torch.equal(t, u) for t, u in zip(before, (c.cache_seqlens, c.kv, c.block_table), strict=True))


def test_gdn_cache_made_in_inference_mode_is_refused_outside_it_before_any_change():
    m = gq.GatedDeltaNet(32, 2, 4, 16, 16, impl="reference", dtype=torch.float32, device=P.device)
    with torch.inference_mode():
        cache = m.init_cache(1)
        m(randn((1, 4, 32), 8), cache)
    keep = [t.clone() for t in (cache.conv_state, cache.recurrent_state, cache.seqlens)]
    for T in (1, 20):  # a decode step, a chunked continuation
        with torch.no_grad(), pytest.raises(RuntimeError, match="made under torch.inference_mode"):
            m(randn((1, T, 32), 9), cache)
    with pytest.raises(RuntimeError, match="reset: this cache was made under torch.inference_mode"):
        cache.reset()
    after = (cache.conv_state, cache.recurrent_state, cache.seqlens)
    assert all(torch.equal(t, u) for t, u in zip(keep, after, strict=True))


def test_gdn_reference_decodes_any_head_dims():
    for K, V in ((300, 16), (16, 1100)):
        m = gq.GatedDeltaNet(8, 1, 2, K, V, impl="reference", dtype=torch.float32, device=P.device)
        c, full = m.init_cache(1), m.init_cache(1)
        x = randn((1, 6, 8), 10)
        with torch.no_grad():
            m(x[:, :5], c)
            step = m(x[:, 5:], c)  # a decode step: the torch recurrence, no kernel limit
            want = m(x, full)[:, 5:]
        assert (step - want).abs().max() <= 1e-4 * want.abs().max() + 1e-6


@pytest.mark.parametrize("device", ["xyz", -1, 1.5, f"cuda:{2**20}"])
def test_layer_constructors_check_device(device):
    for make in (lambda: gq.GQLAttention(32, 4, 2, 16, 16, 32, device=device),
                 lambda: gq.RMSNorm(8, device=device)):
        with pytest.raises(TypeError if isinstance(device, float) else ValueError, match="^device: "):
            make()


@pytest.mark.parametrize("layout", ["sparse", "nested"])
def test_non_dense_tensors_are_refused_by_name(layout):
    """A sparse or nested tensor in any tensor argument is a TypeError naming the argument (the kernels address
    dense, strided memory), not a failure inside a launcher."""
    from gqla_triton import chunk_gated_delta_rule, gated_delta_rule_decode, gqa_decode, mla_decode

    def odd(t):
        if layout == "sparse":
            return t.to_sparse()
        return torch.nested.nested_tensor(list(t.unbind(0)))

    d = P.device
    x, v = torch.randn(1, 8, 1, 16, device=d), torch.randn(1, 8, 2, 16, device=d)
    g, b = -torch.rand(1, 8, 2, device=d), torch.rand(1, 8, 2, device=d)
    q, kv = torch.randn(2, 1, 16, 48, device=d), torch.randn(8, 16, 1, 48, device=d)
    bt = torch.arange(8, dtype=torch.int32, device=d).view(2, 4)
    sl = torch.tensor([60, 5], dtype=torch.int32, device=d)
    k, kr = torch.randn(8, 16, 2, 16, device=d), torch.randn(8, 16, 16, device=d)
    qg = torch.randn(2, 1, 8, 32, device=d)
    calls = [(chunk_gated_delta_rule, [x, x, v, g, b], ["q", "k", "v", "g", "beta"]),
             (gated_delta_rule_decode, [x[:, :1], x[:, :1], v[:, :1], g[:, :1], b[:, :1],
                                        torch.zeros(1, 2, 16, 16, device=d)], ["q", "k", "v", "g", "beta", "state"]),
             (mla_decode, [q, kv, bt, sl, 32], ["q", "kv_cache", "block_table", "cache_seqlens"]),
             (gqa_decode, [qg, k, k, bt, sl, kr], ["q", "k_cache", "v_cache", "block_table", "cache_seqlens",
                                                   "k_rope_cache"])]
    for fn, args, names in calls:
        fn(*args)  # the dense call runs
        for i, name in enumerate(names):
            bad = list(args)
            bad[i] = odd(args[i])
            with pytest.raises(TypeError, match=f"^{name}: expected a dense"):
                fn(*bad)


def _deepseek_sd(hidden=32, h=4, n=2, dn=8, dR=4, dv=8, r=16):
    gen = torch.Generator().manual_seed(0)
    shapes = {"kv_a_proj_with_mqa.weight": (r + dR, hidden), "kv_b_proj.weight": (n * (dn + dv), r),
              "o_proj.weight": (hidden, h * dv), "q_proj.weight": (h * (dn + dR), hidden)}
    sd = {k: torch.randn(*s, generator=gen) * s[1] ** -0.5 for k, s in shapes.items()}
    sd["kv_a_layernorm.weight"] = torch.rand(r, generator=gen) + 0.5
    return sd


def test_loaders_take_rope_dim_zero_and_refuse_huge_rope_widths_by_name():
    """``rope_dim=0`` (a checkpoint without rope) loads; a rope width past the checkpoint's rows (2**31: a 2**31-row
    permutation built before the shape check, 2**63 / 10**400: raw torch / Python errors) is refused by name, and
    ``interleaved_to_half`` checks its width."""
    from gqla_triton.convert import interleaved_to_half, load_gqla, mla_to_gqla

    assert interleaved_to_half(0).numel() == 0
    assert interleaved_to_half(6).tolist() == [0, 2, 4, 1, 3, 5]
    for d in (-2, 3, True, 2**63, 10**400, 2.0):  # a bool or a float: TypeError
        err = TypeError if isinstance(d, (bool, float)) else ValueError
        with pytest.raises(err, match="^d: expected an even int"):
            interleaved_to_half(d)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, kv_rank=16, v_head_dim=8, dtype=torch.float32, impl="reference")
    assert load_gqla(_deepseek_sd(dR=0), rope_dim=0, **kw).rope_dim == 0
    for d in (2**31, 2**63, 10**400):
        with pytest.raises(ValueError, match="kv_a_proj_with_mqa.weight' expected shape"):
            load_gqla(_deepseek_sd(), rope_dim=d, **kw)
    mkw = dict(num_heads=4, num_groups=2, qk_nope_head_dim=8, v_head_dim=8, kv_rank=16, dtype=torch.float32,
               impl="reference")
    assert mla_to_gqla(_deepseek_sd(n=4, dR=0), qk_rope_head_dim=0, **mkw).rope_dim == 0
    for d in (-1, 3, "4"):
        with pytest.raises(TypeError if d == "4" else ValueError, match="^qk_rope_head_dim: expected an even int"):
            mla_to_gqla(_deepseek_sd(n=4), qk_rope_head_dim=d, **mkw)
    with pytest.raises(ValueError, match="^qk_nope_head_dim: expected a positive int"):
        mla_to_gqla(_deepseek_sd(n=4), qk_rope_head_dim=4, **{**mkw, "qk_nope_head_dim": 0})


def test_split_in_proj_refuses_bad_tensors_and_dims_by_name():
    from gqla_triton.layers import GatedDeltaNet

    m = GatedDeltaNet(32, 1, 2, 16, 16, impl="reference")
    width = sum(m.in_proj_sizes)
    assert [t.shape[-1] for t in m.split_in_proj(torch.randn(2, width))] == list(m.in_proj_sizes)
    assert [t.shape[0] for t in m.split_in_proj(m.in_proj.weight, dim=0)] == list(m.in_proj_sizes)
    for bad, err in ((None, TypeError), ([1.0], TypeError), (torch.tensor(1.0), ValueError),
                     (torch.randn(2, width - 1), ValueError), (torch.randn(width, 3), ValueError)):
        with pytest.raises(err, match="^t: expected"):
            m.split_in_proj(bad)
    for dim in (2, -3, 2**31, 2**63, 10**400, 1.0, None, True):
        err = TypeError if dim is None or isinstance(dim, (float, bool)) else ValueError
        with pytest.raises(err, match="^dim: expected an int"):
            m.split_in_proj(torch.randn(2, width), dim=dim)


def test_norm_and_attention_refuse_inputs_on_another_device_and_float8_by_name():
    """A ``meta`` (or other-device) input of a layer on the CPU, and a float8 input of ``RMSNorm``, are refused by
    name, not left to torch's device / promotion errors."""
    norm = gq.RMSNorm(8, device=P.device)
    with pytest.raises(ValueError, match="^x: expected a tensor on"):
        norm(torch.randn(2, 8, device="meta"))
    with pytest.raises(TypeError, match="^x: expected a floating dtype of 16 bits"):
        norm(torch.randn(2, 8, device=P.device).to(torch.float8_e4m3fn))
    attn = gq.GQLAttention(64, 16, 2, head_dim=16, rope_dim=16, kv_rank=32, impl="reference", dtype=torch.float32,
                           device=P.device)
    with pytest.raises(ValueError, match="^hidden_states: expected a tensor on the layer's device"):
        attn(torch.randn(2, 3, 64, device="meta"))


def test_gpu_name_arguments_of_the_roofline_and_dispatch_are_checked_by_name():
    from gqla_triton import dispatch, roofline
    from gqla_triton.layers import GQLAttention

    for bad in ([1], {}, None, 3):
        with pytest.raises(TypeError, match="^key: expected a GPU name"):
            roofline.gpu_spec(bad)
        with pytest.raises(TypeError, match="^name: expected a GPU name"):
            dispatch.gpu_key(bad)
    layer = GQLAttention(64, 16, 2, head_dim=16, rope_dim=16, kv_rank=32, dtype=torch.float32)
    for bad in ([1], {}, 3, 1.0):
        with pytest.raises(TypeError, match="^gpu: expected None or a GPU name"):
            layer.choose_path(gpu=bad)
    for bad in ("h100", 0, {}):
        with pytest.raises(TypeError, match="^info: expected a DeviceInfo"):
            dispatch.select_config("combine", info=bad)
    with pytest.raises(ValueError, match="^op: unknown config op"):
        dispatch.schema("no_such_op")
    for bad in ([1], None, 3):
        with pytest.raises(TypeError, match="^op: expected a config op name"):
            dispatch.schema(bad)
        with pytest.raises(TypeError, match="^key: expected a GPU table key"):
            with dispatch.table_swap(bad, {}):
                pass
    with pytest.raises(ValueError, match="^config_override fields: expected a JSON object"):
        with dispatch.config_override(None):
            pass
    with pytest.raises(ValueError, match="^table_swap raw: expected a JSON object"):
        with dispatch.table_swap("h100", None):
            pass


def test_shard_functions_name_missing_constructor_arguments():
    """A shard config without a layer's required constructor arguments is refused under ``config`` (not the
    constructor's missing-argument TypeError)."""
    from gqla_triton.parallel import shard_gated_deltanet_state_dict, shard_gqla_state_dict

    with pytest.raises(ValueError, match=r"^config: missing GQLAttention arguments \['hidden_size'"):
        shard_gqla_state_dict({}, {}, 0, 2)
    with pytest.raises(ValueError, match=r"^config: missing GatedDeltaNet arguments \['head_k_dim'"):
        shard_gated_deltanet_state_dict({}, {"hidden_size": 64, "num_heads": 2, "num_v_heads": 2}, 0, 2)


def test_step_inputs_checks_its_device_and_seed_by_name():
    from gqla_triton import decode_path

    for bad in ("x", -1, 2**63, "meta"):
        with pytest.raises(ValueError, match="^device: expected"):
            decode_path.step_inputs(1, 64, 1, device=bad)
    for bad in (2**64, -2**63 - 1, 10**400):
        with pytest.raises(ValueError, match="^seed: expected an int in"):
            decode_path.step_inputs(1, 64, 1, seed=bad, device="cpu")


def test_roofline_models_check_their_fields_and_sizes_by_name():
    """The roofline's spec and model records refuse non-finite or non-positive numbers by field, its models sizes
    past 2**40 (their float64 products), and its methods a spec that is not a GPUSpec."""
    from gqla_triton import roofline

    for kw, name in ((dict(bf16_flops=float("nan")), "bf16_flops"), (dict(hbm_bytes_s=0.0), "hbm_bytes_s"),
                     (dict(sm_count=0), "sm_count"), (dict(name=None), "name")):
        with pytest.raises((ValueError, TypeError), match=f"^{name}: "):
            roofline.GPUSpec(**{"name": "x", "bf16_flops": 1e15, "hbm_bytes_s": 1e12, "sm_count": 8, **kw})
    for kw, name in ((dict(flops=float("inf")), "flops"), (dict(bytes=0.0), "bytes"), (dict(tokens=-1.0), "tokens")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            roofline.OpModel(**{"name": "x", "flops": 1.0, "bytes": 1.0, **kw})
    model = roofline.gdn_chunk_fwd_model(1, 64, 1, 1)
    for bad in (None, "h100"):
        with pytest.raises(TypeError, match="^spec: expected a GPUSpec"):
            model.time(bad)
    for kw in (dict(B=10**400), dict(HV=2**41), dict(C=2**63)):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}: expected an int in"):
            roofline.gdn_chunk_fwd_model(**{"B": 1, "T": 64, "H": 1, "HV": 1, **kw})
    with pytest.raises(TypeError, match="^gpu: expected a GPU name"):
        roofline.paper_tokens_per_s([1], "absorb")
    with pytest.raises(ValueError, match="^s_q: expected an int in"):
        roofline.paper_tokens_per_s("h200", "absorb", s_q=10**400)


@pytest.mark.parametrize("layer", ["gqla", "gdn"])
def test_failed_assign_load_puts_the_layers_own_tensors_back(layer):
    """A ``load_state_dict(assign=True)`` that fails torch's strict key check (an unexpected or a missing key) after
    torch assigned the other entries leaves the layer's parameter and buffer objects in place with their values, and
    the caller's tensors as they were; a load that succeeds takes the caller's tensors."""
    def make(seed):
        torch.manual_seed(seed)
        if layer == "gqla":
            return gq.GQLAttention(32, 4, 2, 16, 16, 32, impl="reference")
        return gq.GatedDeltaNet(32, 2, 4, 16, 16, impl="reference")

    m = make(0)
    good = {k: v.detach().clone() + 1.0 for k, v in make(1).state_dict().items()}
    missing = dict(good)
    missing.pop(next(iter(missing)))
    for bad in ({**good, "bogus": torch.zeros(1)}, missing):
        objs = {**dict(m.named_parameters()), **dict(m.named_buffers())}
        values = {k: v.detach().clone() for k, v in objs.items()}
        caller = {k: v.clone() for k, v in bad.items()}
        with pytest.raises(RuntimeError, match="(Unexpected|Missing) key"):
            m.load_state_dict(bad, assign=True)
        after = {**dict(m.named_parameters()), **dict(m.named_buffers())}
        assert all(after[k] is objs[k] and torch.equal(after[k], values[k]) for k in objs)
        assert all(torch.equal(v, caller[k]) for k, v in bad.items())
        assert not any(after[k].data_ptr() == v.data_ptr() for k, v in bad.items() if k in after)
    m.load_state_dict(good, assign=True)
    assert all(p.data_ptr() == good[k].data_ptr() for k, p in m.named_parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())


@pytest.mark.parametrize("layer", ["gqla", "gdn"])
def test_load_state_dict_with_a_key_that_is_no_str_is_refused_by_name(layer):
    """A state dict key that is not a string (strict or not) is a TypeError naming it, before anything is loaded,
    not an AttributeError from inside torch's loader."""
    torch.manual_seed(0)
    m = (gq.GQLAttention(32, 4, 2, 16, 16, 32, impl="reference") if layer == "gqla"
         else gq.GatedDeltaNet(32, 2, 4, 16, 16, impl="reference"))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    good = {k: v + 1.0 for k, v in before.items()}
    for strict in (True, False):
        with pytest.raises(TypeError, match=r"^state_dict: expected str keys .*got \(1, 2\), 7"):
            m.load_state_dict({**good, 7: torch.zeros(1), (1, 2): torch.zeros(1)}, strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
