"""GQLAttention: absorb decode == grouped decode == float64 layer reference; prefill/decode consistency;
latent -> grouped cache conversion; prefill gradients; paged cache bookkeeping; bad inputs."""

import copy
import math
import pickle
import types
import weakref

import numpy as np
import pytest
import torch
from harness import P, assert_close, dtypes, gen, pick, randn, rel_err, seeds
from hypothesis import given
from hypothesis import strategies as st

from gqla_triton.layers.cache import GroupedCache, LatentCache
from gqla_triton.layers.gqla import GQLAttention
from gqla_triton.testing import gqla_reference

PAGE = pick(16, 64)
# hidden, h_q, d_h, d_R, r
DIMS = pick(dict(hidden=64, num_heads=16, head_dim=16, rope_dim=16, kv_rank=32),
            dict(hidden=1024, num_heads=32, head_dim=128, rope_dim=64, kv_rank=512))
MAX_PAST = pick(40, 700)


def make_layer(seed, *, g, q_rank=None, dtype=torch.float32, device=None, impl="triton", path="auto", dims=DIMS,
               kv_norm=True):
    """Layer with seeded weights (same values on every device): projections ~ N(0, 1/fan_in), norms ~ 1."""
    layer = GQLAttention(dims["hidden"], dims["num_heads"], g, dims["head_dim"], dims["rope_dim"], dims["kv_rank"],
                         q_rank=q_rank, path=path, impl=impl, dtype=torch.float64, device="cpu", kv_norm=kv_norm)
    gg = gen(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + randn(p.shape, gg, dtype=torch.float64, device="cpu", scale=0.1))
            else:
                p.copy_(randn(p.shape, gg, dtype=torch.float64, device="cpu", scale=p.shape[1] ** -0.5))
    return layer.to(device=device or P.device, dtype=dtype)


def random_latent_cache(layer, gg, lens, *, dtype, B_slots=None):
    """LatentCache holding ``lens[b]`` random tokens per slot, appended in interleaved random chunks (so block
    tables are scattered). Returns the cache and the slot ids used (a random subset of the slots)."""
    B = len(lens)
    slots = B_slots or B + 2
    ids = torch.randperm(slots, generator=gg)[:B].tolist()
    cache = LatentCache(slots, max(max(lens), 1) + 8, layer.kv_rank, layer.rope_dim, page_size=PAGE, dtype=dtype,
                        device=P.device)
    left = list(lens)
    while any(left):
        b = int(torch.randint(0, B, (1,), generator=gg))
        if not left[b]:
            continue
        n = min(left[b], int(torch.randint(1, PAGE + 5, (1,), generator=gg)))
        c = randn((1, n, layer.kv_rank), gg, dtype=dtype)
        kr = randn((1, n, layer.rope_dim), gg, dtype=dtype)
        cache.append([ids[b]], c, kr)
        left[b] -= n
    return cache, ids


def past_of(cache, ids):
    return [tuple(t.double().cpu() for t in cache.gather(s)) for s in ids]


def check_both_paths(layer, x, pos, lat, grp, ids, dtype, name="", *, indices=None, topk_length=None):
    """One decode step of ``x`` on the absorb path (``lat``) and the grouped path (``grp``, the same past) == the
    float64 layer reference, within the error of torch at the same precision and path structure
    (``impl="reference"``, on copies of the caches); both caches advance by the step's tokens."""
    lens = lat.seqlens(ids)
    ref = gqla_reference(layer, x, pos, past_of(lat, ids), indices=indices, topk_length=topk_length)
    low = copy.deepcopy(layer)
    low.impl = "reference"
    lat_low, grp_low = copy.deepcopy(lat), copy.deepcopy(grp)
    kw = {}
    if indices is not None:
        kw = dict(indices=indices.to(P.device), topk_length=None if topk_length is None else topk_length.to(P.device))
    with torch.no_grad():
        y_abs = layer(x, pos, lat, seq_ids=ids, **kw)
        y_grp = layer(x, pos, grp, seq_ids=ids, **kw)
        low_abs = low(x, pos, lat_low, seq_ids=ids, **kw)
        low_grp = low(x, pos, grp_low, seq_ids=ids, **kw)
    assert_close(f"absorb{name}", y_abs, ref, low_abs, dtype=dtype)
    assert_close(f"grouped{name}", y_grp, ref, low_grp, dtype=dtype)
    assert lat.seqlens(ids) == [n + x.shape[1] for n in lens] == grp.seqlens(ids)


@given(B=st.integers(1, 3), g=st.sampled_from(pick([2, 4], [4, 8])), s_q=st.sampled_from([1, 2]),
       q_rank=st.sampled_from([None, pick(32, 384)]), dtype=dtypes(), seed=seeds())
def test_absorb_equals_grouped_equals_reference(B, g, s_q, q_rank, dtype, seed):
    gg = gen(seed)
    layer = make_layer(seed, g=g, q_rank=q_rank, dtype=dtype)
    lens = torch.randint(1, MAX_PAST + 1, (B,), generator=gg).tolist()
    lat, ids = random_latent_cache(layer, gg, lens, dtype=dtype)
    grp = GroupedCache.from_latent(lat, layer)  # the one-time switch, before either decode appends
    assert grp.seqlens(ids) == lat.seqlens(ids)
    x = randn((B, s_q, layer.hidden_size), gg, dtype=dtype)
    pos = torch.tensor(lens)[:, None] + torch.arange(s_q)
    check_both_paths(layer, x, pos, lat, grp, ids, dtype)


# (num_heads, num_groups): heads per group 3 and 1 (row tiles padded to 16), 16 (one tile), 12 / 32 on the GPU
HEADS_GROUPS = pick([(12, 4), (16, 16), (16, 1)], [(128, 8), (96, 8), (32, 32), (64, 2)])


@given(B=st.integers(1, 3), hg=st.sampled_from(HEADS_GROUPS), rope=st.booleans(), kv_norm=st.booleans(),
       q_rank=st.sampled_from([None, pick(24, 384)]), s_q=st.sampled_from([1, 2]), high=st.booleans(),
       dtype=dtypes(), seed=seeds())
def test_decode_kernels_on_layer_variants(B, hg, rope, kv_norm, q_rank, s_q, high, dtype, seed):
    """The kernel decode step (``norm_rope``, ``absorb_q`` / ``grouped_q``, ``absorb_o``) on both paths for heads
    per group below, at and above 16, d_R = 0, no latent norm, a full-rank query and positions just below the
    int32 limit == the float64 layer reference, within the torch path's error."""
    gg = gen(seed)
    h, g = hg
    dims = dict(DIMS, num_heads=h, rope_dim=DIMS["rope_dim"] if rope else 0)
    layer = make_layer(seed, g=g, q_rank=q_rank, dtype=dtype, dims=dims, kv_norm=kv_norm)
    lens = torch.randint(1, MAX_PAST + 1, (B,), generator=gg).tolist()
    lat, ids = random_latent_cache(layer, gg, lens, dtype=dtype)
    grp = GroupedCache.from_latent(lat, layer)
    x = randn((B, s_q, layer.hidden_size), gg, dtype=dtype)
    start = torch.tensor(lens)[:, None] if not high else 2**31 - 1 - torch.randint(s_q, 50, (B, 1), generator=gg)
    pos = start + torch.arange(s_q)
    check_both_paths(layer, x, pos, lat, grp, ids, dtype, " kernels")


@given(B=st.integers(1, 3), s_q=st.sampled_from([1, 2]), topk=st.sampled_from(pick([8, 40], [64, 512])),
       use_len=st.booleans(), dtype=dtypes(), seed=seeds())
def test_sparse_decode_absorb_equals_grouped_equals_reference(B, s_q, topk, use_len, dtype, seed):
    """Random logical indices (with -1, out-of-range and duplicate entries) shared by all heads/groups."""
    gg = gen(seed)
    layer = make_layer(seed, g=pick(2, 8), dtype=dtype)
    lens = torch.randint(1, MAX_PAST + 1, (B,), generator=gg).tolist()
    lat, ids = random_latent_cache(layer, gg, lens, dtype=dtype)
    grp = GroupedCache.from_latent(lat, layer)
    x = randn((B, s_q, layer.hidden_size), gg, dtype=dtype)
    pos = torch.tensor(lens)[:, None] + torch.arange(s_q)
    idx = torch.randint(-3, max(lens) + s_q + 3, (B, s_q, topk), generator=gg, dtype=torch.int32)
    tl = torch.randint(0, topk + 1, (B,), generator=gg, dtype=torch.int32) if use_len else None
    check_both_paths(layer, x, pos, lat, grp, ids, dtype, " (sparse)", indices=idx, topk_length=tl)


@given(B=st.integers(1, 2), g=st.sampled_from(pick([2, 4], [4, 8])), path=st.sampled_from(["absorb", "grouped"]),
       steps=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=3), dtype=dtypes(), seed=seeds())
def test_prefill_then_decode_equals_longer_prefill(B, g, path, steps, dtype, seed):
    """A prefill, then decode steps of 1-2 tokens through the cache, and one prefill over all the tokens: each
    against the float64 reference, within the error of the same calls in torch at ``dtype`` (``impl="reference"``,
    its own cache)."""
    gg = gen(seed)
    layer = make_layer(seed, g=g, dtype=dtype)
    T0 = int(torch.randint(1, MAX_PAST, (1,), generator=gg))
    T = T0 + sum(steps)
    x = randn((B, T, layer.hidden_size), gg, dtype=dtype)
    pos = torch.arange(T)
    ref = gqla_reference(layer, x, pos[None].expand(B, T))
    low = copy.deepcopy(layer)  # the same calls in torch at ``dtype``: the tolerance
    low.impl = "reference"
    runs = []
    with torch.no_grad():
        for m in (layer, low):
            full = m(x, pos)  # one prefill over all T tokens
            cache = m.make_cache(B + 1, T, path=path, page_size=PAGE)
            ids = list(range(1, B + 1))
            outs = [m(x[:, :T0], pos[:T0], cache, seq_ids=ids)]
            t = T0
            for s in steps:
                outs.append(m(x[:, t:t + s], None, cache, seq_ids=ids))  # default positions = cached length
                t += s
            assert isinstance(cache, LatentCache if path == "absorb" else GroupedCache)
            assert cache.seqlens(ids) == [T] * B
            runs.append((full, torch.cat(outs, 1)))
    (full, y), (full_low, y_low) = runs
    assert_close("one prefill", full, ref, full_low, dtype=dtype)
    assert_close("prefill", y[:, :T0], ref[:, :T0], y_low[:, :T0], dtype=dtype)
    assert_close("decode after prefill", y[:, T0:], ref[:, T0:], y_low[:, T0:], dtype=dtype)


@given(g=st.sampled_from([2, 4]), q_rank=st.sampled_from([None, 24]), seed=seeds())
def test_prefill_gradients_match_reference(g, q_rank, seed):
    """Float64 autograd through the layer (SDPA prefill) == autograd through the einsum reference."""
    gg = gen(seed)
    dims = dict(hidden=32, num_heads=8, head_dim=8, rope_dim=8, kv_rank=16)
    layer = make_layer(seed, g=g, q_rank=q_rank, dtype=torch.float64, dims=dims)
    B, T = 2, int(torch.randint(1, 12, (1,), generator=gg))
    x = randn((B, T, 32), gg, dtype=torch.float64).requires_grad_(True)
    dy = randn((B, T, 32), gg, dtype=torch.float64)
    pos = torch.arange(T)[None].expand(B, T)
    (layer(x, pos) * dy).sum().backward()
    leaves = {n: p.detach().cpu().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    x_ref = x.detach().cpu().requires_grad_(True)
    (gqla_reference(layer, x_ref, pos.cpu(), params=leaves) * dy.cpu()).sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 1e-10
    for name, p in layer.named_parameters():
        assert p.grad is not None and rel_err(p.grad, leaves[name].grad) < 1e-10, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cache_bytes_per_token_exact(dtype):
    r, dR, g, dh = 512, 64, 8, 128
    lat = LatentCache(1, 64, r, dR, page_size=64, dtype=dtype, device="cpu")
    grp = GroupedCache(1, 64, g, dh, dR, page_size=64, dtype=dtype, device="cpu")
    elt = torch.finfo(dtype).bits // 8
    assert lat.bytes_per_token == elt * (r + dR)
    assert grp.bytes_per_token == elt * (2 * g * dh + dR)
    if dtype == torch.bfloat16:
        assert lat.bytes_per_token == 2 * (512 + 64) == 1152
        assert grp.bytes_per_token == 2 * (2 * 8 * 128 + 64) == 4224
    # storage agrees with the reported figure
    assert lat.kv[0, 0].numel() * lat.kv.element_size() == lat.bytes_per_token
    per_tok = (grp.k[0, 0].numel() + grp.v[0, 0].numel() + grp.k_rope[0, 0].numel()) * grp.k.element_size()
    assert per_tok == grp.bytes_per_token


@given(seed=seeds())
def test_allocation_and_freeing(seed):
    gg = gen(seed)
    cache = LatentCache(4, 64, 16, 16, page_size=16, num_pages=10, dtype=torch.float32, device=P.device)
    assert cache.num_free_pages == 10
    written = {}
    for _ in range(10):  # about 200 tokens asked of 160 rows (64 a slot): past the pages and past max_seqlen
        s = int(torch.randint(0, 4, (1,), generator=gg))
        n = int(torch.randint(1, 40, (1,), generator=gg))
        if cache.seqlens([s])[0] + n > 64 or -(-(cache.seqlens([s])[0] + n) // 16) - len(cache._pages[s]) > \
                cache.num_free_pages:
            with pytest.raises(ValueError, match=r"^(reserve: out of pages|num_tokens: slot \d+ would hold)"):
                cache.append([s], torch.zeros(1, n, 16, device=P.device), torch.zeros(1, n, 16, device=P.device))
            continue
        c = randn((1, n, 16), gg)
        kr = randn((1, n, 16), gg)
        cache.append([s], c, kr)
        written[s] = torch.cat([written.get(s, torch.zeros(0, 32, device=P.device)), torch.cat([c, kr], -1)[0]])
    used = [p for s in range(4) for p in cache._pages[s]]
    assert len(used) == len(set(used)) and cache.num_free_pages == 10 - len(used)
    bt, sl = cache.tables()
    for s in range(4):
        n = cache.seqlens([s])[0]
        assert int(sl[s]) == n and n == (written[s].shape[0] if s in written else 0)
        assert bt[s, : len(cache._pages[s])].tolist() == cache._pages[s]
        if n:
            c, kr = cache.gather(s)
            assert torch.equal(torch.cat([c, kr], -1), written[s])
    cache.free([0, 1, 2, 3])
    assert cache.num_free_pages == 10 and cache.seqlens() == [0, 0, 0, 0]
    assert bool((cache.block_table == cache.scratch_page).all())  # unused entries name the scratch page
    cache.allocate([1], 64)  # a full-length slot fits after freeing
    assert cache.num_free_pages == 6
    with pytest.raises(ValueError, match="out of pages"):
        cache.allocate([0, 2], 64)
    assert cache.num_free_pages == 6  # nothing taken on failure
    cache.append([1], torch.zeros(1, 64, 16, device=P.device), torch.zeros(1, 64, 16, device=P.device))
    assert cache.num_free_pages == 6 and cache.seqlens([1]) == [64]  # reserved pages are used, none added
    with pytest.raises(ValueError, match="max_seqlen"):
        cache.allocate([1], 1)


def test_absorbed_weights_cached_and_invalidated():
    layer = make_layer(0, g=2, dtype=torch.float32)
    with torch.no_grad():
        a1, _ = layer.absorbed_weights()
        a2, _ = layer.absorbed_weights()
        assert a1 is a2
        layer.kv_b_proj.weight.mul_(2)
        a3, _ = layer.absorbed_weights()
        assert a3 is not a1 and torch.allclose(a3, 2 * a1)
        layer.kv_b_proj.weight = torch.nn.Parameter(layer.kv_b_proj.weight * 0.5)
        a4, _ = layer.absorbed_weights()
        assert torch.allclose(a4, a1)
        # ``weight.data = ...`` keeps the version counter, and the allocator may hand the new tensor the old one's
        # address: each swap is still seen (the entry keeps the weight it was made from alive)
        w = layer.kv_b_proj.weight
        for i in range(8):
            w.data = torch.full_like(w, float(i))
            assert torch.all(layer.absorbed_weights()[0] == i)
            w.data = torch.full_like(w, -1.0)  # two swaps between calls: the second may take the first's address
            w.data = torch.full_like(w, float(i) + 0.5)
            assert torch.all(layer.absorbed_weights()[0] == i + 0.5)
    # under autograd: recomputed and differentiable
    w_uk, _ = layer.absorbed_weights()
    assert w_uk.requires_grad


@pytest.mark.parametrize("g", [1, 2])
def test_absorbed_weights_hold_no_weight_after_to(g):
    """``absorbed_weights`` keeps no reference to the weight it was computed from: after ``layer.to(...)`` replaces
    the weight, the old weight's storage and the entry made from it are freed at once (not at the next call); the
    next call computes the weights of the new parameter. A layer holding an entry pickles and deep-copies."""
    layer = make_layer(0, g=g, dtype=torch.float32)
    with torch.no_grad():
        w_uk, _ = layer.absorbed_weights()
    old_weight = weakref.ref(layer.kv_b_proj.weight.untyped_storage())
    old_uk = weakref.ref(w_uk)
    twin = copy.deepcopy(layer)
    again = pickle.loads(pickle.dumps(layer))
    del w_uk
    layer.to(torch.float64)
    assert old_weight() is None, "the old weight's storage is still referenced"
    assert old_uk() is None, "the entry made from the old weight is still held"
    with torch.no_grad():
        w_uk, w_uv = layer.absorbed_weights()
        assert w_uk.dtype == torch.float64 and torch.equal(w_uk, layer.w_uk_uv()[0].contiguous())
        for other in (twin, again):
            want = [t.clone() for t in other.w_uk_uv()]
            got = other.absorbed_weights()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            other.kv_b_proj.weight.mul_(2)
            assert torch.equal(other.absorbed_weights()[0], 2 * want[0])


def _materialize(module):
    """FSDP's meta-device initialisation: ``to_empty`` on the CPU, then ``reset_parameters()`` of every module that
    holds parameters or buffers of its own (each initialises only those)."""
    module.to_empty(device="cpu")
    with torch.no_grad():
        for m in module.modules():
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                m.reset_parameters()
    return module


@pytest.mark.parametrize("q_rank", [None, 24])
def test_meta_construction_then_reset_parameters(q_rank):
    """A layer built on meta and materialised as FSDP does (``to_empty`` + each module's ``reset_parameters``): the
    norms are ones and the RoPE frequencies the ones it was built with, so the forward equals a layer built on the
    CPU with the same projections."""
    inv = torch.rand(8, dtype=torch.float64) + 0.1
    kw = dict(q_rank=q_rank, dtype=torch.float32, rope_inv_freq=inv, impl="reference")
    with torch.device("meta"):
        meta = GQLAttention(64, 4, 2, 16, 16, 32, **kw)
    _materialize(meta)
    cpu = GQLAttention(64, 4, 2, 16, 16, 32, **kw)
    for name, p in meta.named_parameters():
        if "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    assert torch.equal(meta.rope_inv_freq, inv)
    with torch.no_grad():
        for name, p in cpu.named_parameters():
            if "layernorm" not in name:
                p.copy_(meta.get_parameter(name))
    x = torch.randn(2, 5, 64)
    assert torch.equal(meta(x), cpu(x))


def test_absorbed_weights_of_a_layer_made_under_inference_mode():
    """Parameters made under ``torch.inference_mode()`` keep no version counter: ``absorbed_weights`` inside it
    gives the current weights (contiguous, in the dtype asked) after in-place writes too, instead of raising."""
    with torch.inference_mode():
        layer = make_layer(0, g=2, dtype=torch.float32)
        w_uk, w_uv = layer.absorbed_weights()
        want = layer.w_uk_uv()
        assert torch.equal(w_uk, want[0]) and torch.equal(w_uv, want[1])
        assert w_uk.is_contiguous() and w_uv.is_contiguous()
        layer.kv_b_proj.weight.mul_(2)
        w_uk, _ = layer.absorbed_weights(torch.float16)
        assert w_uk.dtype == torch.float16 and torch.equal(w_uk, layer.w_uk_uv(torch.float16)[0])


def test_absorbed_weights_kept_under_inference_mode_serve_autograd_later():
    """An entry made inside ``torch.inference_mode()`` (a serving step) is reused outside it by a computation that
    autograd records (a frozen weight, a trainable input): normal tensors, not inference tensors, which autograd
    cannot save for the backward."""
    layer = make_layer(0, g=2, dtype=torch.float32)
    layer.kv_b_proj.weight.requires_grad_(False)
    with torch.inference_mode():
        kept, _ = layer.absorbed_weights()
    w_uk, w_uv = layer.absorbed_weights()
    assert w_uk is kept and not w_uk.is_inference() and not w_uv.is_inference()
    x = torch.randn(3, w_uk.shape[-1], dtype=torch.float32, device=P.device, requires_grad=True)
    (x @ w_uk[0].T).sum().backward()
    torch.testing.assert_close(x.grad, w_uk[0].sum(0).expand(3, -1))  # (float32 tolerances: a GEMM's sum order)


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_float64_layer_decodes_with_the_reference_only(path):
    """A float64 layer with a kernel ``impl`` is refused at its decode step by name (the layer's dtype and impl, not
    an internal tensor), the cache unchanged; with ``impl="reference"`` the same weights decode."""
    layer = make_layer(2, g=2, dtype=torch.float64, path=path)
    cache = layer.make_cache(2, 128, path=path)
    x = randn((2, 5, layer.hidden_size), gen(3), dtype=torch.float64).to(P.device)
    with torch.no_grad():
        layer(x, cache=cache)
        kept = {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
        with pytest.raises(TypeError, match=r"GQLAttention: a torch.float64 layer decodes with impl='reference'"):
            layer(x[:, :1], cache=cache)
        assert all(torch.equal(v, kept[k]) for k, v in vars(cache).items() if isinstance(v, torch.Tensor))
        layer.impl = "reference"
        assert layer(x[:, :1], cache=cache).dtype == torch.float64


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_float64_cache_decodes_with_the_reference_only(path):
    """A float32 layer with a kernel ``impl`` over a float64 cache (``make_cache(dtype=torch.float64)``) is refused at
    its decode step by naming the cache and its dtype (not an internal argument), the cache unchanged; with
    ``impl="reference"`` it decodes."""
    layer = make_layer(2, g=2, path=path)
    cache = layer.make_cache(2, 128, path=path, dtype=torch.float64)
    x = randn((2, 5, layer.hidden_size), gen(3), dtype=torch.float32).to(P.device)
    with torch.no_grad():
        layer(x, cache=cache)
        kept = {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
        with pytest.raises(TypeError, match=r"^cache: a torch.float64 cache decodes with impl='reference' only"):
            layer(x[:, :1], cache=cache)
        assert all(torch.equal(v, kept[k]) for k, v in vars(cache).items() if isinstance(v, torch.Tensor))
        layer.impl = "reference"
        assert layer(x[:, :1], cache=cache).isfinite().all()


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_decode_step_refused_by_the_launch_plan_changes_no_cache_state(path, monkeypatch):
    """A decode step whose attention launch the plan refuses (its smallest tiles past the GPU's shared memory) raises
    before the cache is written, also under autograd (grad mode on, trainable weights: the op runs through its
    custom op)."""
    import dataclasses

    import gqla_triton.ops.gqa.api as gqa_api
    import gqla_triton.ops.gqa.plan as gqa_plan
    import gqla_triton.ops.mla.api as mla_api
    import gqla_triton.ops.mla.plan as mla_plan

    layer = make_layer(5, g=2, path=path)
    cache = layer.make_cache(2, 128, path=path, page_size=PAGE)
    x = randn((2, 5, layer.hidden_size), gen(6), dtype=torch.float32).to(P.device)
    with torch.no_grad():
        layer(x, cache=cache)  # prefill (SDPA): no decode plan yet
    mod = mla_plan if path == "absorb" else gqa_plan
    real = mod.device_info
    monkeypatch.setattr(mod, "device_info", lambda d: dataclasses.replace(real(d), smem_per_block=1024))
    for api in (mla_api, gqa_api):  # no plan kept from an earlier call of these shapes
        monkeypatch.setattr(api, "_CHECKED", type(api._CHECKED)())
    for grad in (False, True):
        kept = {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="shared memory"):
            layer(x[:, :1], cache=cache)
        assert all(torch.equal(v, kept[k]) for k, v in vars(cache).items() if isinstance(v, torch.Tensor)), grad
        assert cache.seqlens([0, 1]) == [5, 5]


def test_reference_decode_sees_writes_through_weight_data():
    """``impl="reference"``'s absorb step after an in-place write through ``kv_b_proj.weight.data`` (which has a
    version counter of its own): the float64 layer reference of the new weights, as the kernels' path gives."""
    gg = gen(4)
    layer = make_layer(4, g=2, impl="reference")
    lat, ids = random_latent_cache(layer, gg, [5, 9], dtype=torch.float32)
    x = randn((2, 1, layer.hidden_size), gg, dtype=torch.float32)
    pos = torch.tensor([[5], [9]])
    with torch.no_grad():
        layer(x, pos, copy.deepcopy(lat), seq_ids=ids)
        layer.kv_b_proj.weight.data.copy_(randn(layer.kv_b_proj.weight.shape, gg, dtype=torch.float32, scale=0.2))
        y = layer(x, pos, copy.deepcopy(lat), seq_ids=ids)
    assert_close("absorb after a .data write", y, gqla_reference(layer, x, pos, past_of(lat, ids)),
                 dtype=torch.float32, eps=1e-4)


def test_layer_arguments_of_the_wrong_kind_are_refused_by_name():
    """Sparse / nested inputs, devices torch cannot name, a path given as a falsy value and an epsilon float32
    flushes: a TypeError / ValueError naming the argument, before any cache changes."""
    layer = make_layer(5, g=2)
    gg = gen(5)
    lat, ids = random_latent_cache(layer, gg, [4, 6], dtype=torch.float32)
    before = lat.seqlens(ids)
    x = randn((2, 1, layer.hidden_size), gg, dtype=torch.float32)
    with torch.no_grad():
        for bad in (x.to_sparse(), torch.nested.nested_tensor([x[0], x[1]])):
            with pytest.raises(TypeError, match="hidden_states: expected a dense"):
                layer(bad, None, lat, seq_ids=ids)
        idx = torch.zeros(2, 1, 4, dtype=torch.int32, device=P.device)
        with pytest.raises(TypeError, match="indices: expected a dense"):
            layer(x, None, lat, seq_ids=ids, indices=idx.to_sparse())
        with pytest.raises(TypeError, match="topk_length: expected a dense"):
            layer(x, None, lat, seq_ids=ids, indices=idx, topk_length=torch.ones(2, dtype=torch.int32).to_sparse())
    assert lat.seqlens(ids) == before
    for bad in ("xyz", -1, 1.5):
        with pytest.raises(TypeError if bad == 1.5 else ValueError, match="device"):
            layer.make_cache(2, 32, page_size=16, device=bad)
        with pytest.raises(TypeError if bad == 1.5 else ValueError, match="device"):
            layer.choose_path(device=bad)
    for path in ("absorb", "grouped", "auto"):  # s_q is the auto choice's; a fixed path still refuses a bad one
        for bad in ("x", 0, True, 1.5):  # a value of another type: TypeError
            with pytest.raises(ValueError if bad == 0 else TypeError, match="^s_q: expected a positive int"):
                layer.make_cache(2, 32, page_size=16, path=path, s_q=bad)
    for bad in ("", False, 0):
        with pytest.raises(ValueError if bad == "" else TypeError, match="path"):
            layer.make_cache(2, 32, page_size=16, path=bad)
    with pytest.raises(ValueError, match="norm_eps"):
        GQLAttention(32, 4, 2, 16, 8, 16, norm_eps=1e-50)
    with pytest.raises(ValueError, match="path: this layer decodes on path='absorb'"):  # forward would refuse it
        make_layer(5, g=2, path="absorb").make_cache(2, 32, page_size=16, path="grouped")


def test_nan_token_reaches_only_the_queries_that_see_it():
    """An MTP step (2 tokens) whose second token is NaN: only that query's output is non-finite, in the float64
    layer reference and on both decode paths (the first query does not see the second token's key)."""
    layer = make_layer(6, g=2)
    gg = gen(6)
    lat, ids = random_latent_cache(layer, gg, [4, 7], dtype=torch.float32)
    grp = GroupedCache.from_latent(lat, layer)
    x = randn((2, 2, layer.hidden_size), gg, dtype=torch.float32)
    x[0, 1, 3] = math.nan
    pos = torch.tensor([[4, 5], [7, 8]])
    ref = gqla_reference(layer, x, pos, past_of(lat, ids))
    want = [[0, 1]]
    assert (~torch.isfinite(ref)).any(-1).nonzero().tolist() == want
    with torch.no_grad():
        for cache in (lat, grp):
            assert (~torch.isfinite(layer(x, pos, cache, seq_ids=ids))).any(-1).nonzero().tolist() == want


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_prefill_nonfinite_token_stays_in_its_sequence(bad):
    """A prefill (torch SDPA) whose third token of sequence 0 is non-finite: that query and the later ones are
    non-finite, as in the float64 layer reference (SDPA may carry it to the earlier ones too: docs/design.md), and
    the other sequence is finite and matches the reference, with no cache and with a cache on either path."""
    layer = make_layer(7, g=2)
    x = randn((2, 5, layer.hidden_size), gen(7), dtype=torch.float32)
    x[0, 2, 3] = bad
    pos = torch.arange(5)[None].expand(2, 5)
    ref = gqla_reference(layer, x, pos)
    assert (~torch.isfinite(ref)).any(-1).nonzero().tolist() == [[0, 2], [0, 3], [0, 4]]
    with torch.no_grad():
        outs = [layer(x, pos)] + [layer(x, pos, layer.make_cache(2, 8, path=p, page_size=PAGE))
                                  for p in ("absorb", "grouped")]
    for y in outs:
        assert not torch.isfinite(y[0, 2:]).all(-1).any()
        assert rel_err(y[1], ref[1]) < 1e-5


def test_gluon_impl_on_the_grouped_path_is_refused_where_the_path_is_chosen():
    """impl='gluon' names the absorb path's Hopper kernel: a layer made for the grouped path, or a grouped cache of
    an 'auto' layer, is refused by name when made; an 'auto' layer's own choice takes the absorb path."""
    with pytest.raises(ValueError, match="impl='gluon'"):
        GQLAttention(64, 8, 4, 16, 8, 32, impl="gluon", path="grouped")
    layer = GQLAttention(64, 8, 4, 16, 8, 32, impl="gluon", path="auto")
    with pytest.raises(ValueError, match="impl='gluon'"):
        layer.make_cache(2, 32, path="grouped", page_size=16)
    assert isinstance(layer.make_cache(2, 32, page_size=16), LatentCache)
    assert GQLAttention(64, 8, 4, 16, 8, 32, impl="gluon", path="absorb").impl == "gluon"


def test_auto_path_choice_and_make_cache():
    layer = make_layer(0, g=2, dtype=torch.float32, path="auto")
    big = GQLAttention(7168, 128, 8, 128, 64, 512, device="meta")
    h20 = big.choose_path(batch=128, seqlen=4096, gpu="h20")
    h200 = big.choose_path(batch=128, seqlen=4096, gpu="h200")
    assert {h20.path, h200.path} <= {"absorb", "grouped"}
    assert h20.path == ("absorb" if h20.absorb_s <= h20.grouped_s else "grouped")
    assert isinstance(layer.make_cache(2, 32, path="absorb", page_size=16), LatentCache)
    assert isinstance(layer.make_cache(2, 32, path="grouped", page_size=16), GroupedCache)
    auto = layer.make_cache(2, 32, page_size=16)
    assert isinstance(auto, LatentCache if layer.choose_path(batch=2, seqlen=32).path == "absorb" else GroupedCache)
    fixed = make_layer(0, g=2, dtype=torch.float32, path="grouped")
    assert fixed.choose_path(gpu="h200").path == "grouped"



def test_auto_path_with_an_8bit_cache_takes_the_absorb_path():
    """``make_cache(dtype=torch.float8_e4m3fn)`` (FlashMLA's layout, or scaled per tensor with ``k_scale``) holds
    only on the absorb path: "auto" takes it where dispatch would pick the grouped path, as for head dims the
    grouped kernels do not take; the grouped path forced by the environment is a ValueError naming it."""
    fp8 = torch.float8_e4m3fn
    layer = GQLAttention(64, 8, 4, 16, 64, 512, dtype=torch.float32, device=P.device)
    monkey = pytest.MonkeyPatch()
    with monkey.context() as m:
        m.setattr(layer, "choose_path", lambda **kw: types.SimpleNamespace(path="grouped", reason="roofline"))
        assert isinstance(layer.make_cache(2, 32, page_size=16), GroupedCache)
        for kw in (dict(dtype=fp8), dict(dtype=fp8, k_scale=0.5)):
            cache = layer.make_cache(2, 32, page_size=16, **kw)
            assert isinstance(cache, LatentCache) and cache.dtype == fp8 and cache.k_scale == kw.get("k_scale")
    with monkey.context() as m:
        m.setenv("GQLA_TRITON_DECODE_PATH", "grouped")
        for kw in (dict(dtype=fp8), dict(dtype=fp8, k_scale=0.5)):
            with pytest.raises(ValueError, match="^GQLA_TRITON_DECODE_PATH=grouped forces a path .*8-bit"):
                layer.make_cache(2, 32, page_size=16, **kw)
        with pytest.raises(TypeError, match="no 8-bit layout"):
            layer.make_cache(2, 32, path="grouped", page_size=16, dtype=fp8)

def test_bad_inputs():
    with pytest.raises(ValueError, match="num_heads"):
        GQLAttention(64, 6, 4, 16, 16, 32)
    with pytest.raises(ValueError, match="rope_dim"):
        GQLAttention(64, 8, 4, 16, 15, 32)
    for bad in (True, 8.0, "8", 0):  # a bool is not a head count, nor a float or a string (TypeError)
        with pytest.raises(ValueError if bad == 0 else TypeError, match="num_heads: expected a positive int"):
            GQLAttention(64, bad, 4, 16, 16, 32)
    with pytest.raises(TypeError, match="max_seqlen"):
        LatentCache(2, True, 32, 16)
    with pytest.raises(ValueError, match="path"):
        GQLAttention(64, 8, 4, 16, 16, 32, path="mla")
    with pytest.raises(ValueError, match="rope_inv_freq: expected a tensor with values"):
        GQLAttention(64, 8, 4, 16, 16, 32, rope_inv_freq=torch.ones(8, device="meta"))
    np_layer = GQLAttention(np.int64(64), np.int32(8), np.int64(4), np.int64(16), np.int64(16), np.int64(32),
                            device="meta")  # numpy ints are ints, as everywhere else
    assert type(np_layer.rope_dim) is int and np_layer.shard(np.int64(1), np.int64(2)).num_groups == 2
    for rank, size in ((False, True), (0, 2.0), (0, True), ("0", 2), (0.0, 2)):
        with pytest.raises(TypeError, match="tp_(size|rank): expected an int"):
            np_layer.shard(rank, size)
    for rank, size in ((0, 0), (2, 2), (-1, 2), (0, 3)):
        with pytest.raises(ValueError, match="tp_"):
            np_layer.shard(rank, size)
    with pytest.raises(ValueError, match="impl"):
        GQLAttention(64, 8, 4, 16, 16, 32, impl="cuda")
    with pytest.raises(ValueError, match="page_size"):
        LatentCache(2, 32, 32, 16, page_size=8)
    # dims the grouped kernels do not take are refused where the path is chosen, not at the first decode step
    with pytest.raises(ValueError, match="path 'grouped' with impl='auto': rope_dim must be a positive multiple"):
        GQLAttention(64, 8, 4, 16, 8, 32, path="grouped")
    with pytest.raises(ValueError, match="v_head_dim: expected a positive multiple of 16"):
        GQLAttention(64, 8, 4, 16, 16, 32, v_head_dim=24, path="grouped", impl="triton")
    odd = GQLAttention(64, 8, 4, 16, 8, 32, dtype=torch.float32, device=P.device)
    with pytest.raises(ValueError, match="rope_dim"):
        odd.make_cache(2, 32, path="grouped", page_size=16)
    assert odd.make_cache(2, 32, path="absorb", page_size=16).rope_dim == 8
    monkey = pytest.MonkeyPatch()
    with monkey.context() as m:  # "auto" where dispatch would pick the grouped path: the absorb path's cache
        m.setattr(odd, "choose_path", lambda **kw: types.SimpleNamespace(path="grouped", reason="roofline"))
        assert isinstance(odd.make_cache(2, 32, page_size=16), LatentCache)
        even = GQLAttention(64, 8, 4, 16, 16, 32, dtype=torch.float32, device=P.device)
        m.setattr(even, "choose_path", lambda **kw: types.SimpleNamespace(path="grouped", reason="roofline"))
        assert isinstance(even.make_cache(2, 32, page_size=16), GroupedCache)
    GQLAttention(64, 8, 4, 16, 8, 32, path="grouped", impl="reference").make_cache(2, 32, page_size=16)
    with monkey.context() as m:  # the grouped path forced by the environment: refused, never another path
        m.setenv("GQLA_TRITON_DECODE_PATH", "grouped")
        with pytest.raises(ValueError, match="^GQLA_TRITON_DECODE_PATH=grouped forces a path .*rope_dim"):
            odd.make_cache(2, 32, page_size=16)
        assert isinstance(odd.make_cache(2, 32, path="absorb", page_size=16), LatentCache)
        m.setenv("GQLA_TRITON_DECODE_PATH", "absorb")
        assert isinstance(odd.make_cache(2, 32, page_size=16), LatentCache)
    assert GQLAttention(64, 8, 4, 16, 0, 32, path="grouped").rope_dim == 0  # no rope key: nothing to refuse
    layer = make_layer(0, g=2, dtype=torch.float32, path="absorb")
    hs = layer.hidden_size
    x = torch.zeros(2, 3, hs, device=P.device)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.zeros(2, 3, hs // 2, device=P.device))
    with pytest.raises(TypeError, match="hidden_states"):
        layer(torch.zeros(2, 3, hs, dtype=torch.int32, device=P.device))
    with pytest.raises(TypeError, match="hidden_states: expected the layer's dtype"):
        layer(torch.zeros(2, 3, hs, dtype=torch.float16, device=P.device))
    with pytest.raises(ValueError, match="positions"):
        layer(x, torch.arange(4))
    with pytest.raises(TypeError, match="positions"):
        layer(x, torch.zeros(3))
    with pytest.raises(ValueError, match="positions: expected a tensor on the CPU or on"):
        layer(x, torch.zeros(2, 3, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="cache"):
        layer(x, None, layer.make_cache(2, 32, path="grouped", page_size=16))
    with pytest.raises(TypeError, match="cache"):
        layer(x, None, {"k": 1})
    cache = layer.make_cache(4, 32, page_size=16)
    with pytest.raises(ValueError, match="seq_ids"):
        layer(x, None, cache, seq_ids=[0])
    with pytest.raises(ValueError, match="seq_ids"):
        layer(x, None, cache, seq_ids=[1, 1])
    with pytest.raises(ValueError, match="seq_ids"):
        layer(x, None, cache, seq_ids=[0, 9])
    with pytest.raises(ValueError, match="c_kv"):
        cache.append([0], torch.zeros(1, 2, 31), torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="max_seqlen"):
        layer(torch.zeros(2, 33, hs, device=P.device), None, cache)
    assert cache.seqlens() == [0, 0, 0, 0] and cache.num_free_pages == cache.num_pages
    with pytest.raises(ValueError, match="indices"):
        layer(x, None, None, indices=torch.zeros(2, 3, 4, dtype=torch.int32, device=P.device))
    with pytest.raises(ValueError, match="topk_length"):
        layer(x, None, None, topk_length=torch.zeros(2, dtype=torch.int32, device=P.device))
    with pytest.raises(ValueError, match="tp_size"):
        layer.shard(0, 3)
    with pytest.raises(ValueError, match="tp_rank"):
        layer.shard(2, 2)


def test_reference_attention_propagates_nonfinite_scores():
    """The layers' torch attention (``impl="reference"``): a query with no key gives 0, a +inf score gives NaN as
    the softmax sends it (the kernels' and ``gqa_decode_reference``'s), not a hidden 0."""
    from gqla_triton.testing.attention import attend

    q = torch.ones(2, 1, 4, dtype=torch.float64)
    k = torch.ones(3, 1, 4, dtype=torch.float64)
    v = torch.ones(3, 1, 2, dtype=torch.float64)
    w = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(attend(q, k, v, 0.5, w), torch.tensor([[[1.0, 1.0]], [[0.0, 0.0]]], dtype=torch.float64))
    k[1] = math.inf
    out = attend(q, k, v, 0.5, w)
    assert torch.isnan(out[0]).all() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_uint64_positions_are_refused():
    layer = GQLAttention(32, 4, 2, 8, 4, 8, impl="reference")
    with pytest.raises(TypeError, match="positions: .*uint64"):
        layer(torch.randn(1, 2, 32), torch.tensor([0, 1], dtype=torch.uint64))


def test_reference_grouped_path_decodes_dims_the_kernels_refuse():
    """``impl="reference"`` takes the grouped path at head dims its kernels refuse (rope_dim 8, v_head_dim 12): a
    decode step runs and equals the absorb path's (float64)."""
    layer = GQLAttention(64, 8, 4, 16, 8, 32, v_head_dim=12, impl="reference", dtype=torch.float64, device=P.device)
    x = randn((2, 5, 64), gen(4), dtype=torch.float64).to(P.device)
    outs = []
    with torch.no_grad():
        for path in ("absorb", "grouped"):
            cache = layer.make_cache(2, 32, path=path, page_size=16)
            layer(x[:, :4], cache=cache)
            outs.append(layer(x[:, 4:], cache=cache))
            assert cache.seqlens() == [5, 5]
    assert rel_err(outs[1], outs[0]) < 1e-10


@pytest.mark.parametrize("path", ["absorb", "grouped"])
def test_layer_torch_compile_dynamic(path):
    """``torch.compile(fullgraph=True, dynamic=True)`` (rope_theta and softmax_scale symbolic) traces a prefill with
    autograd and decode steps, each equal to eager."""
    layer = make_layer(0, g=2, path=path)
    x = randn((2, 6, DIMS["hidden"]), 1, dtype=torch.float32)
    f = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    xg = x.clone().requires_grad_()
    f(xg).square().sum().backward()
    gx, xg.grad = xg.grad, None
    layer(xg).square().sum().backward()
    torch.testing.assert_close(gx, xg.grad, rtol=0, atol=0)
    with torch.no_grad():
        c1, c2 = (layer.make_cache(2, 32, page_size=PAGE) for _ in range(2))
        layer(x[:, :4], cache=c1)
        layer(x[:, :4], cache=c2)
        torch.testing.assert_close(f(x[:, 4:5], cache=c1), layer(x[:, 4:5], cache=c2), rtol=0, atol=0)
