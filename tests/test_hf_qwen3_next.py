"""GatedDeltaNet against transformers' Qwen3-Next linear-attention layer (``Qwen3NextGatedDeltaNet``).

A tiny random ``Qwen3NextConfig`` (nothing downloaded); the transformers layer's weights go into ``GatedDeltaNet``
through ``from_hf``. Every output is judged against the float64 reference layer holding the same weights, with the
data-derived tolerance of the harness: transformers' own layer at the test dtype sets the error bound for ours,
and our low-precision reference layer sets it for transformers' (so a wrong weight mapping fails either way).
Prefill, then 16 cached decode steps with transformers' cache object on its side; its cache's states are carried
into and out of ``GatedDeltaNetCache``.
"""

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gen, pick, randn, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

from gqla_triton.layers import GatedDeltaNet

# optional; 5.17 is the first release with DynamicCache's linear-attention layers (what the H200 machine has)
transformers = pytest.importorskip("transformers", minversion="5.17")
import inspect  # noqa: E402

from transformers import Qwen3NextConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

F64 = torch.float64
STEPS = 16
FEW = settings(max_examples=examples(2, 6))
ONE = settings(max_examples=examples(1, 4))  # 16 decode steps per example: slow under the interpreter


def _config(H, G, D, W=4):
    return Qwen3NextConfig(hidden_size=pick(32, 256), num_hidden_layers=1, layer_types=["linear_attention"],
                           linear_num_key_heads=H, linear_num_value_heads=H * G, linear_key_head_dim=D,
                           linear_value_head_dim=D, linear_conv_kernel_dim=W, rms_norm_eps=1e-6)


def _hf_layer(cfg, seed, dtype):
    """transformers' layer with every parameter drawn from ``seed`` (same values on every device)."""
    layer = Qwen3NextGatedDeltaNet(cfg, 0)
    g = gen(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                v = torch.rand(p.shape, generator=g, dtype=F64).mul(15.99).add(0.01).log()
            elif name == "dt_bias":
                v = torch.randn(p.shape, generator=g, dtype=F64) - 2
            elif name == "norm.weight":
                v = torch.rand(p.shape, generator=g, dtype=F64) + 0.5
            elif name == "conv1d.weight":
                v = torch.randn(p.shape, generator=g, dtype=F64) * 0.5
            else:
                v = torch.randn(p.shape, generator=g, dtype=F64) * p.shape[1] ** -0.5
            p.copy_(v)
    return layer.to(device=P.device, dtype=dtype)


def _ours(hf, impl, dtype):
    return GatedDeltaNet.from_hf(hf, impl=impl, dtype=dtype)


# transformers renamed the layer's cache argument (cache_params before 5.24, cache after)
_HF_CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3NextGatedDeltaNet.forward).parameters else "cache_params"


def _hf_states(cache):
    """(conv state, recurrent state) of layer 0 of transformers' cache (``get_conv_state`` from 5.24 on)."""
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(0), cache.get_recurrent_state(0)
    return cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]


def _run(layer, xs, cache):
    """Outputs of ``layer`` over the chunks ``xs`` ([B, t, hidden] each) in order, through ``cache``."""
    with torch.no_grad():
        return [layer(x, **{_HF_CACHE_KW: cache}) if isinstance(layer, Qwen3NextGatedDeltaNet) else layer(x, cache)
                for x in xs]


def _chunks(x, T):
    return [x[:, :T]] + [x[:, T + i:T + i + 1] for i in range(x.shape[1] - T)]


def _decode_case(B, T, H, G, dtype, seed):
    """A random layer and ``B`` sequences of ``T`` prompt tokens then ``STEPS`` decode tokens: ``(config,
    transformers' layer, the input chunks in float64, the same in dtype)``."""
    cfg = _config(H, G, pick(16, 128))
    hf = _hf_layer(cfg, seed, dtype)
    xs64 = _chunks(randn((B, T + STEPS, cfg.hidden_size), seed + 1, dtype=F64), T)
    return cfg, hf, xs64, [x.to(dtype) for x in xs64]


@pytest.mark.parametrize("dtype", P.dtypes)
@FEW
@given(B=st.integers(1, 2), T=st.integers(1, pick(20, 200)), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
       seed=seeds())
def test_prefill_matches_transformers(B, T, H, G, dtype, seed):
    """No cache: ours (kernels and the reference impl) == transformers' layer, at the profile's dtypes."""
    cfg = _config(H, G, pick(16, 128))
    hf = _hf_layer(cfg, seed, dtype)
    x64 = randn((B, T, cfg.hidden_size), seed + 1, dtype=F64)
    x = x64.to(dtype)
    with torch.no_grad():
        out64 = _ours(hf, "reference", F64)(x64)
        out_hf = hf(x)
        out_ref = _ours(hf, "reference", dtype)(x)
        out_tr = _ours(hf, "triton", dtype)(x)
    assert_close("transformers vs float64 reference", out_hf, out64, out_ref, dtype=dtype)
    assert_close("ours (reference impl)", out_ref, out64, out_hf, dtype=dtype)
    assert_close("ours (triton)", out_tr, out64, out_hf, dtype=dtype)


@pytest.mark.parametrize("dtype", P.dtypes)
@ONE
@given(T=st.integers(1, pick(12, 150)), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]), seed=seeds())
def test_cached_decode_matches_transformers(T, H, G, dtype, seed):
    """Prefill T tokens into a cache, then 16 single-token decode steps: every step's output and the final
    states of ours (kernels and the reference impl) equal transformers' (its DynamicCache on its side)."""
    B = 2
    cfg, hf, xs64, xs = _decode_case(B, T, H, G, dtype, seed)
    r64 = _ours(hf, "reference", F64)
    c64 = r64.init_cache(B)
    out64 = _run(r64, xs64, c64)
    hf_cache = DynamicCache(config=cfg)
    out_hf = _run(hf, xs, hf_cache)
    rlp = _ours(hf, "reference", dtype)  # ours, reference impl: also the low-precision bound for transformers'
    c_lp = rlp.init_cache(B)
    out_lp = _run(rlp, xs, c_lp)
    m = _ours(hf, "triton", dtype)
    cache = m.init_cache(B)
    out = _run(m, xs, cache)
    for i, (o, o64, oh, ol) in enumerate(zip(out, out64, out_hf, out_lp, strict=True)):
        what = "prefill" if i == 0 else f"decode step {i}"
        assert_close(f"transformers {what}", oh, o64, ol, dtype=dtype)
        assert_close(f"ours (reference impl) {what}", ol, o64, oh, dtype=dtype)
        assert_close(f"ours (triton) {what}", o, o64, oh, dtype=dtype)
    conv64, rec64 = c64.hf_states()
    hf_conv, hf_rec = _hf_states(hf_cache)
    for name, c in (("triton", cache), ("reference impl", c_lp)):
        conv, rec = c.hf_states()
        assert tuple(conv.shape) == tuple(hf_conv.shape)
        assert torch.equal(conv[..., 0], torch.zeros_like(conv[..., 0]))
        assert_close(f"conv state ({name})", conv[..., 1:], conv64[..., 1:], hf_conv[..., 1:], dtype=dtype)
        assert_close(f"recurrent state ({name})", rec, rec64, hf_rec, dtype=dtype)
        assert c.seqlens.tolist() == [T + STEPS] * B


def _on_our_functions(monkeypatch, layer) -> dict:
    """transformers' layer with the two GDN functions it takes from fla replaced by ours, each called as its hub
    wrapper calls fla's (keywords outside the function's signature dropped); returns the calls counted per name."""
    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    from gqla_triton.ops.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    calls = {"chunk": 0, "recurrent": 0}

    def as_fla(fn, name):
        names = set(inspect.signature(fn).parameters)

        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **{k: v for k, v in kw.items() if k in names})
        return call

    for what, fn, attrs in (
            ("chunk", chunk_gated_delta_rule, ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")),
            ("recurrent", fused_recurrent_gated_delta_rule,
             ("torch_recurrent_gated_delta_rule", "recurrent_gated_delta_rule"))):
        # the module function (transformers from 5.25) and the layer's bound attribute (earlier releases)
        if hasattr(mod, attrs[0]):
            monkeypatch.setattr(mod, attrs[0], as_fla(fn, what))
        if hasattr(layer, attrs[1]):
            monkeypatch.setattr(layer, attrs[1], as_fla(fn, what))
    return calls


@ONE
@given(T=st.integers(1, pick(12, 150)), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]), dtype=dtypes(),
       seed=seeds())
def test_transformers_layer_runs_on_our_fla_functions(T, H, G, dtype, seed):
    """transformers' own layer with ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` taken from
    here where it would take fla's: prefill and 16 cached decode steps as close to float64 as its torch path."""
    B = 2
    cfg, hf, xs64, xs = _decode_case(B, T, H, G, dtype, seed)
    r64 = _ours(hf, "reference", F64)
    out64 = _run(r64, xs64, r64.init_cache(B))
    out_hf = _run(hf, xs, DynamicCache(config=cfg))
    with pytest.MonkeyPatch.context() as mp:
        calls = _on_our_functions(mp, hf)
        cache = DynamicCache(config=cfg)
        out = _run(hf, xs, cache)
    assert calls == {"chunk": 1, "recurrent": STEPS}, calls
    for i, (o, o64, oh) in enumerate(zip(out, out64, out_hf, strict=True)):
        what = "prefill" if i == 0 else f"decode step {i}"
        assert_close(f"transformers on our functions, {what}", o, o64, oh, dtype=dtype)
    assert _hf_states(cache)[1].dtype == torch.float32


@ONE
@given(T=st.integers(1, pick(12, 150)), dtype=dtypes(), seed=seeds())
def test_cache_states_carry_across_implementations(T, dtype, seed):
    """transformers prefills, ours decodes from its cache's states (load_hf_states); and ours prefills,
    transformers decodes from ours (hf_states): both give the decode outputs of one implementation throughout."""
    B, H, G = 2, 2, 2
    cfg, hf, xs64, xs = _decode_case(B, T, H, G, dtype, seed)
    r64 = _ours(hf, "reference", F64)
    out64 = _run(r64, xs64, r64.init_cache(B))
    m = _ours(hf, "triton", dtype)

    # transformers -> ours, into slots 2 and 0 of a larger cache
    hf_cache = DynamicCache(config=cfg)
    out_hf = _run(hf, xs, hf_cache)
    hf_cache2 = DynamicCache(config=cfg)
    _run(hf, xs[:1], hf_cache2)
    cache = m.init_cache(B + 1)
    cache.load_hf_states(*_hf_states(hf_cache2), slots=[2, 0], seqlen=T)
    assert cache.holds() == [True, False, True]
    cache.slots = [2, 0]
    out = _run(m, xs[1:], cache)
    for i, (o, o64, oh) in enumerate(zip(out, out64[1:], out_hf[1:], strict=True)):
        assert_close(f"ours decode step {i + 1} from transformers' prefill", o, o64, oh, dtype=dtype)
    assert cache.seqlens.tolist() == [T + STEPS, 0, T + STEPS]

    # ours -> transformers
    cache = m.init_cache(B)
    _run(m, xs[:1], cache)
    conv, rec = cache.hf_states()
    hf_cache3 = DynamicCache(config=cfg)
    hf_cache3.update_conv_state(conv, 0)
    hf_cache3.update_recurrent_state(rec, 0)
    out2 = _run(hf, xs[1:], hf_cache3)
    for i, (o, o64, oh) in enumerate(zip(out2, out64[1:], out_hf[1:], strict=True)):
        assert_close(f"transformers decode step {i + 1} from our prefill", o, o64, oh, dtype=dtype)


def test_state_dict_round_trip_and_config_form():
    """from_hf(config, state_dict, prefix=...) == from_hf(layer); hf_state_dict() returns the weights exactly."""
    cfg = _config(2, 2, 16 if not P.big else 128)
    hf = _hf_layer(cfg, 7, torch.float32)
    sd = {f"model.layers.3.linear_attn.{k}": v for k, v in hf.state_dict().items()}
    sd["model.layers.3.input_layernorm.weight"] = torch.ones(cfg.hidden_size)  # outside the prefix: ignored
    a = GatedDeltaNet.from_hf(hf)
    b = GatedDeltaNet.from_hf(cfg, sd, prefix="model.layers.3.linear_attn.", layer_idx=3)
    assert b.layer_idx == 3 and a.layer_idx == 0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    back = a.hf_state_dict()
    ref = hf.state_dict()
    assert sorted(back) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(back[k], v), k
    assert a.in_proj.weight.dtype == torch.float32 and a.in_proj.weight.device == hf.in_proj_qkvz.weight.device


def test_bad_weights_are_refused_and_change_nothing():
    cfg = _config(2, 2, 16 if not P.big else 128)
    hf = _hf_layer(cfg, 3, torch.float32)
    m = GatedDeltaNet.from_hf(hf)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sd = dict(hf.state_dict())

    def refused(exc, match, state_dict, **kw):
        with pytest.raises(exc, match=match):
            m.load_hf_state_dict(state_dict, **kw)
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k

    refused(ValueError, "missing 'A_log'", {k: v for k, v in sd.items() if k != "A_log"})
    refused(ValueError, "unexpected keys.*conv1d.bias", {**sd, "conv1d.bias": torch.zeros(m.conv_dim)})
    refused(ValueError, "out_proj.weight has shape", {**sd, "out_proj.weight": torch.zeros(3, 3)})
    refused(TypeError, "dt_bias must be a floating-point tensor", {**sd, "dt_bias": torch.zeros(4, dtype=torch.int64)})
    refused(TypeError, "state_dict: expected a mapping", [1, 2])
    refused(TypeError, "prefix", sd, prefix=3)
    with pytest.raises(ValueError, match="hidden_act"):
        GatedDeltaNet.from_hf(Qwen3NextConfig(**{**cfg.to_dict(), "hidden_act": "gelu"}), sd)
    with pytest.raises(ValueError, match="state_dict: a config needs"):
        GatedDeltaNet.from_hf(cfg)
    with pytest.raises(ValueError, match="state_dict: the weights are read from the given layer"):
        GatedDeltaNet.from_hf(hf, sd)
    with pytest.raises(TypeError, match="layer_or_config"):
        GatedDeltaNet.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="layer_or_config"):
        GatedDeltaNet.from_hf(object(), sd)


def test_bad_hf_states_are_refused_and_change_nothing():
    cfg = _config(1, 2, 16 if not P.big else 128)
    m = GatedDeltaNet.from_hf(_hf_layer(cfg, 5, torch.float32))
    cache = m.init_cache(3)
    with torch.no_grad():
        cache.conv_state.normal_()
        cache.recurrent_state.normal_()
    keep = (cache.conv_state.clone(), cache.recurrent_state.clone(), cache.seqlens.clone(), cache.holds())
    conv = torch.zeros(2, m.conv_dim, m.conv_size, device=P.device)
    rec = torch.zeros(2, m.num_v_heads, m.head_k_dim, m.head_v_dim, device=P.device)
    for exc, match, args, kw in (
        (ValueError, "conv_state: expected", (conv[..., :1], rec), {}),
        (ValueError, "conv_state: expected", (conv[:, 1:], rec), {}),
        (ValueError, "recurrent_state: expected", (conv, rec[:1]), {}),
        (TypeError, "recurrent_state: expected a floating-point", (conv, rec.long()), {}),
        (TypeError, "conv_state: expected a torch.Tensor", (conv.tolist(), rec), {}),
        (ValueError, "slots: duplicate", (conv, rec), {"slots": [1, 1]}),
        (ValueError, "slots: slot 3 outside", (conv, rec), {"slots": [0, 3]}),
        (ValueError, "slots: expected 2 slots", (conv, rec), {"slots": [0]}),
        (ValueError, "seqlen", (conv, rec), {"seqlen": -1}),
    ):
        with pytest.raises(exc, match=match):
            cache.load_hf_states(*args, **kw)
        assert torch.equal(cache.conv_state, keep[0]) and torch.equal(cache.recurrent_state, keep[1])
        assert torch.equal(cache.seqlens, keep[2]) and cache.holds() == keep[3]


@pytest.mark.gpu_only
@given(T=st.integers(1, 300), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]), seed=seeds())
@settings(max_examples=examples(1, 6))
def test_bf16_prefill_and_decode_match_transformers(T, H, G, seed):
    """bf16 on the GPU: prefill + 16 decode steps of ours (kernels) against transformers' bf16 layer; the float64
    reference layer with the same (bf16-rounded) weights decides, transformers' error sets the bound."""
    dtype = torch.bfloat16
    B = 2
    cfg = _config(H, G, 128)
    hf = _hf_layer(cfg, seed, dtype)
    x64 = randn((B, T + STEPS, cfg.hidden_size), seed + 1, dtype=F64)
    xs64 = _chunks(x64.to(dtype).to(F64), T)
    xs = [x.to(dtype) for x in xs64]
    r64 = _ours(hf, "reference", F64)
    out64 = _run(r64, xs64, r64.init_cache(B))
    out_hf = _run(hf, xs, DynamicCache(config=cfg))
    m = _ours(hf, "auto", dtype)
    out = _run(m, xs, m.init_cache(B))
    for i, (o, o64, oh) in enumerate(zip(out, out64, out_hf, strict=True)):
        assert_close(f"ours bf16 {'prefill' if i == 0 else f'decode step {i}'}", o, o64, oh, dtype=dtype)


def test_weights_into_a_meta_layer_are_refused_by_name():
    """``from_hf(..., device="meta")`` names ``device`` (a meta layer holds no weights), and ``load_hf_state_dict``
    into a layer built on meta is a ``ValueError`` saying so, not an error from reading a meta tensor."""
    cfg = _config(1, 2, 16 if not P.big else 128)
    hf = _hf_layer(cfg, 4, torch.float32)
    with pytest.raises(ValueError, match="^device: expected a device with storage, got meta"):
        GatedDeltaNet.from_hf(hf, device="meta")
    with pytest.raises(ValueError, match="^device: expected a device with storage, got meta"):
        GatedDeltaNet.from_hf(cfg, hf.state_dict(), device="meta")
    m = GatedDeltaNet.from_hf(hf).to_empty(device="meta")
    with pytest.raises(ValueError, match="on the meta device"):
        m.load_hf_state_dict(hf.state_dict())


def test_hf_states_of_a_free_slot_are_zero_states():
    """A freed slot holds no state (a prefill into it starts from zeros): ``hf_states`` gives it the zero states a
    fresh cache gives, not the rows its last sequence left; held slots keep theirs."""
    cfg = _config(1, 2, 16 if not P.big else 128)
    m = GatedDeltaNet.from_hf(_hf_layer(cfg, 6, torch.float32), impl="reference")
    cache = m.init_cache(2)
    with torch.no_grad():
        m(randn((2, 5, cfg.hidden_size), gen(7), dtype=torch.float32), cache)
    held = cache.hf_states([1])
    cache.free([0])
    conv, rec = cache.hf_states()
    zero_conv, zero_rec = m.init_cache(1).hf_states()
    assert torch.equal(conv[:1], zero_conv) and torch.equal(rec[:1], zero_rec)
    assert torch.equal(conv[1:], held[0]) and torch.equal(rec[1:], held[1])
    assert bool(held[1].abs().sum() > 0)
