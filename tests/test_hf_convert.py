"""Model-level TransGQLA: a tiny random ``transformers`` Llama (built from a config, nothing downloaded) converted
by ``convert_llama``, against the original model."""

import copy

import pytest
import torch
from harness import P, assert_close, gen, pick
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[hf]'")

from gqla_triton.convert import GQLAHFAttention, convert_llama, set_decode_path  # noqa: E402


def tiny_llama(seed, *, g, h=4, d=16, layers=2, vocab=96, attn="sdpa", dtype=torch.float32, rope_type=None):
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 500.0}
    if rope_type == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=pick(48, 256), intermediate_size=pick(64, 512),
                                   num_hidden_layers=layers, num_attention_heads=h, num_key_value_heads=g,
                                   head_dim=d, max_position_embeddings=256, rope_parameters=rope,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).eval().to(device=P.device, dtype=dtype)


def float64_model(model):
    """The original model in float64 with its rotary angles in float64 too (HF computes them in float32)."""
    m = copy.deepcopy(model).to("cpu", torch.float64)
    rot = m.model.rotary_emb

    def forward(x, position_ids):
        ang = position_ids[..., None].to(torch.float64) * rot.inv_freq.to(torch.float64)
        emb = torch.cat([ang, ang], -1)
        return emb.cos() * rot.attention_scaling, emb.sin() * rot.attention_scaling

    rot.forward = forward
    return m


def full_rank(model):
    c = model.config
    return dict(kv_rank=2 * c.num_key_value_heads * c.head_dim, rope_dim=c.num_key_value_heads * c.head_dim)


def ids_for(seed, B, T, vocab=96):
    return torch.randint(0, vocab, (B, T), generator=gen(seed)).to(P.device)


@given(g=st.sampled_from([1, 2, 4]), rope_type=st.sampled_from([None, "llama3"]), seed=st.integers(0, 2**16))
@settings(max_examples=pick(4, 6))
def test_full_rank_conversion_gives_the_original_logits(g, rope_type, seed):
    dtype = torch.float32 if not P.big else torch.bfloat16
    model = tiny_llama(seed, g=g, dtype=dtype, rope_type=rope_type)
    ids = ids_for(seed + 1, 2, 12)
    with torch.no_grad():
        ref = float64_model(model)(ids.cpu()).logits
        lowp = model(ids).logits
        conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="reference")
        out = conv(ids).logits
    assert_close("converted logits", out, ref, lowp, dtype=dtype)
    assert sum(isinstance(m, GQLAHFAttention) for m in conv.modules()) == model.config.num_hidden_layers


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padded_batch_without_cache(attn):
    """A left-padded batch (HF's 4-D mask: float for eager, bool for sdpa) without a cache: the real tokens'
    logits are those of each sequence run alone."""
    model = tiny_llama(3, g=2, attn=attn)
    ids = ids_for(4, 2, 10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    kw = dict(attention_mask=mask, position_ids=pos, use_cache=False)
    with torch.no_grad():
        m64 = float64_model(model)
        ref = torch.cat([m64(ids[:1, 3:].cpu()).logits[0], m64(ids[1:].cpu()).logits[0]])
        keep = mask.bool()
        lowp = model(ids, **kw).logits[keep]
        conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="reference")
        out = conv(ids, **kw).logits[keep]
        assert_close("padded logits", out, ref, lowp, dtype=torch.float32)
        with pytest.raises(ValueError, match="attention_mask"):  # the GQLA caches hold no padding
            conv(ids, attention_mask=mask, use_cache=True)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_custom_float_mask_without_cache_is_added_to_the_scores_as_the_source_adds_it(attn):
    """A custom 4-D float mask (HF passes it through as it is) adds its values to the scores, in the source model and
    in the converted one: a finite bias is not a hidden key, HF's minimum is; a query row that sees no key gives 0."""
    model = tiny_llama(5, g=2, attn=attn)
    ids = ids_for(6, 2, 7)
    low = torch.finfo(torch.float32).min
    mask = torch.full((2, 1, 7, 7), low).triu(1)
    mask[0, 0, 4, 1], mask[0, 0, 5, :3], mask[1, 0, 6, 2] = -2.0, 1.5, low
    with torch.no_grad():
        ref = float64_model(model)(ids.cpu(), attention_mask=mask.double().cpu(), use_cache=False).logits
        lowp = model(ids, attention_mask=mask.to(P.device), use_cache=False).logits
        conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="reference")
        out = conv(ids, attention_mask=mask.to(P.device), use_cache=False).logits
        assert_close("biased-mask logits", out, ref, lowp, dtype=torch.float32)
        x = torch.randn(1, 3, model.config.hidden_size, generator=gen(7)).to(P.device)
        blind = torch.full((1, 1, 3, 3), low).triu(1)
        blind[0, 0, 1] = low  # query 1 sees no key
        got, _ = conv.model.layers[0].self_attn(x, attention_mask=blind.to(P.device))
    assert torch.equal(got[0, 1], torch.zeros_like(got[0, 1])) and got[0, [0, 2]].abs().min() > 0


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_generate_greedy_matches_on_both_paths(impl):
    """float32 in both profiles: greedy tokens are compared exactly, and low-precision rounding may flip a near tie."""
    model = tiny_llama(5, g=2)
    ids = ids_for(6, 2, 9)
    kw = dict(max_new_tokens=pick(5, 16), do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl=impl, max_seqlen=32, page_size=16)
        got = {"no cache": conv.generate(ids, attention_mask=torch.ones_like(ids), use_cache=False, **kw)}
        for path in ("absorb", "grouped"):
            set_decode_path(conv, path)
            got[path] = conv.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            caches = [m.gqla_cache for m in conv.modules() if isinstance(m, GQLAHFAttention)]
            assert all(type(c).__name__ == ("LatentCache" if path == "absorb" else "GroupedCache") for c in caches)
    for name, tokens in got.items():
        assert torch.equal(tokens, want), (name, tokens.tolist(), want.tolist())


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_beam_search_follows_the_hf_cache_reorders(impl):
    """Beam search reorders the HF cache's rows every step (``reorder_cache``: a selection with repeats); the
    adapters' GQLA caches follow, so the beams and their scores are the original model's."""
    model = tiny_llama(11, g=2, layers=2)
    ids = ids_for(12, 1, 6)
    kw = dict(max_new_tokens=pick(6, 10), num_beams=3, num_return_sequences=3, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl=impl, max_seqlen=32, page_size=16)
        got = conv.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences), (got.sequences.tolist(), want.sequences.tolist())
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_interleaved_hf_caches_keep_their_own_gqla_caches(impl):
    """Two conversations, each with its own HF cache, through one converted model, step by step in turn (a server
    interleaving requests): each decodes against its own tokens. A conversation whose HF cache is dropped frees its
    GQLA cache (the latest call's stays as ``gqla_cache``)."""
    import gc
    import weakref

    model = tiny_llama(21, g=2, layers=1)
    a, b = ids_for(22, 1, 10), ids_for(23, 1, 10)
    conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl=impl, max_seqlen=32, page_size=16)
    attn = conv.model.layers[0].self_attn
    ca, cb = (transformers.DynamicCache(config=model.config) for _ in range(2))
    with torch.no_grad():
        want = {n: conv(x, use_cache=False).logits[:, -2:] for n, x in (("a", a), ("b", b))}
        conv(a[:, :8], past_key_values=ca, use_cache=True)
        conv(b[:, :8], past_key_values=cb, use_cache=True)
        got = {"a": [], "b": []}
        for t in (8, 9):
            for n, x, c in (("a", a, ca), ("b", b, cb)):
                got[n].append(conv(x[:, t:t + 1], past_key_values=c, use_cache=True).logits)
    for n in ("a", "b"):
        torch.testing.assert_close(torch.cat(got[n], 1), want[n], rtol=1e-4, atol=1e-4)
    assert attn.gqla_cache is attn._caches[id(cb)][1]  # b's step ran last
    held = weakref.ref(attn._caches[id(ca)][1])
    del ca, c
    gc.collect()
    assert held() is None, "the GQLA cache of a dropped HF cache is still held"
    assert list(attn._caches) == [id(cb)]


def test_cropped_hf_cache_is_refused():
    """Assisted / speculative generation crops the HF cache; the GQLA caches cannot drop tokens, so the next call
    is a ValueError instead of attention over the dropped tokens."""
    model = tiny_llama(13, g=2, layers=1)
    ids = ids_for(14, 1, 10)
    conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="reference", max_seqlen=32, page_size=16)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        conv(ids[:, :8], past_key_values=cache, use_cache=True)
        cache.crop(-2)
        with pytest.raises(ValueError, match="cropped or replaced"):
            conv(ids[:, 8:9], past_key_values=cache, use_cache=True)


def test_refused_cached_calls_leave_both_caches_as_they_were():
    """A cached call the adapter refuses (past ``max_seqlen``, the wrong dtype) is refused before the HF cache
    records its tokens: both caches keep their length and the next valid step decodes. Masks, positions and
    arguments of the wrong kind are refused by name (an integer 4-D mask, whose HF meaning is 1 = attend, is read
    neither way)."""
    model = tiny_llama(15, g=2, layers=1)
    ids = ids_for(16, 1, 20)
    conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="reference", max_seqlen=16, page_size=16)
    cache = transformers.DynamicCache(config=model.config)
    attn = conv.model.layers[0].self_attn
    with torch.no_grad():
        conv(ids[:, :10], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="max_seqlen 16"):
            conv(ids[:, 10:18], past_key_values=cache, use_cache=True)
        x = torch.randn(1, 1, model.config.hidden_size, dtype=torch.float64, device=P.device)
        with pytest.raises(TypeError, match="hidden_states: expected the layer's dtype"):
            attn(x, None, None, past_key_values=cache)
        assert cache.get_seq_length(0) == 10 and attn.gqla_cache.seqlens([0]) == [10]
        conv(ids[:, 10:11], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length(0) == 11
        y = torch.randn(1, 3, model.config.hidden_size, device=P.device)
        for kw, err, what in ((dict(position_ids=torch.arange(4, device=P.device)[None]), ValueError, "position_ids"),
                              (dict(cache_position=torch.arange(5, device=P.device)), ValueError, "cache_position"),
                              (dict(position_ids=torch.arange(3.0, device=P.device)[None]), TypeError,
                               "position_ids"),
                              (dict(attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.int64, device=P.device)),
                               TypeError, "attention_mask"),
                              (dict(attention_mask=torch.ones(2, 1, 3, 3, dtype=torch.bool, device=P.device)),
                               ValueError, "attention_mask")):
            with pytest.raises(err, match=what):
                attn(y, None, **kw)
        for bad in (((torch.zeros(1),),), object()):  # a legacy tuple cache, not a cache at all
            with pytest.raises(TypeError, match="^cache: expected a HF cache"):
                attn(y, None, past_key_values=bad)
    with pytest.raises(TypeError, match="layer_idx"):
        GQLAHFAttention(attn.attn, "0")


def test_truncated_conversion_calibration_helps():
    """Below full rank the error grows as the rank falls; calibrating on token ids lowers it on those ids."""
    model = tiny_llama(7, g=2, layers=1)
    ids = ids_for(8, 2, 16)
    with torch.no_grad():
        ref = float64_model(model)(ids.cpu()).logits
        errs, cal = [], None
        for r in (8, 16, 24, 32):  # rope_dim = g·d: RoPE exact, the values through the rank-r latent
            conv = convert_llama(copy.deepcopy(model), kv_rank=r, rope_dim=32, impl="reference")
            errs.append(((conv(ids).logits.double().cpu() - ref).norm() / ref.norm()).item())
            if r == 16:
                conv = convert_llama(copy.deepcopy(model), kv_rank=r, rope_dim=32, calib_input_ids=ids,
                                     impl="reference")
                cal = ((conv(ids).logits.double().cpu() - ref).norm() / ref.norm()).item()
    assert all(a > b for a, b in zip(errs[:-1], errs[1:], strict=True)), errs
    assert errs[-1] < 1e-5 and cal < errs[1], (errs, cal)


def _refused_leaving_it_unchanged(model, match: str, **kw) -> None:
    """``convert_llama(model, **kw)`` is a ``ValueError`` matching ``match``, and the model is left as it was."""
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        convert_llama(model, **{"kv_rank": 32, "rope_dim": 16, "impl": "reference", **kw})
    assert not any(isinstance(m, GQLAHFAttention) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_convert_llama_bad_inputs():
    model = tiny_llama(9, g=2, layers=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="rope_dim"):
        convert_llama(model, kv_rank=8, rope_dim=34)  # > g·d
    with pytest.raises(ValueError, match="decode_path"):
        convert_llama(model, kv_rank=8, rope_dim=8, decode_path="mla")
    assert not any(isinstance(m, GQLAHFAttention) for m in model.modules())  # rejected calls changed nothing
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(TypeError, match="model"):
        convert_llama(torch.nn.Linear(2, 2), kv_rank=8, rope_dim=8)
    biased = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, attention_bias=True))
    with pytest.raises(ValueError, match="bias"):
        convert_llama(biased, kv_rank=8, rope_dim=8)
    convert_llama(model, kv_rank=8, rope_dim=8)
    with pytest.raises(ValueError, match="already converted"):
        convert_llama(model, kv_rank=8, rope_dim=8)
    with pytest.raises(ValueError, match="path"):
        set_decode_path(model, "mla")


def _small(cls, cfg_cls, **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return cls(cfg_cls(**{**base, **kw})).eval().to(P.device)


@pytest.mark.parametrize("variant", ["cohere", "olmo_clip", "smollm3_nope", "qk_norm_flag", "stablelm_qk_layernorm",
                                     "hunyuan_qk_layernorm", "bitnet_sub_norm", "diffllama", "ministral3_scaled_q"])
def test_attention_variants_that_change_the_function_are_refused(variant):
    """Llama-shaped models whose attention is not Llama's (interleaved RoPE pairs, clamped q / k / v, layers
    without RoPE, q / k / output norms under any name, differential attention, queries scaled by their position
    past ``original_max_position_embeddings``: Ministral 3's ``llama_4_scaling_beta``) would convert into another
    function: refused, and the model left as it was."""
    T = transformers
    model = {"cohere": lambda: _small(T.CohereForCausalLM, T.CohereConfig),
             "olmo_clip": lambda: _small(T.OlmoForCausalLM, T.OlmoConfig, clip_qkv=0.05),
             "smollm3_nope": lambda: _small(T.SmolLM3ForCausalLM, T.SmolLM3Config, num_hidden_layers=4),
             "qk_norm_flag": lambda: _small(T.CohereForCausalLM, T.CohereConfig, use_qk_norm=True),
             "stablelm_qk_layernorm": lambda: _small(T.StableLmForCausalLM, T.StableLmConfig, qk_layernorm=True,
                                                     partial_rotary_factor=1.0),
             "hunyuan_qk_layernorm": lambda: _small(T.HunYuanDenseV1ForCausalLM, T.HunYuanDenseV1Config, head_dim=8),
             "bitnet_sub_norm": lambda: _small(T.BitNetForCausalLM, T.BitNetConfig),
             "diffllama": lambda: _small(T.DiffLlamaForCausalLM, T.DiffLlamaConfig),
             "ministral3_scaled_q": lambda: _small(T.Ministral3ForCausalLM, T.Ministral3Config, head_dim=8)}[variant]()
    _refused_leaving_it_unchanged(model, "model: .*(rotary|rotates|clip_qkv|no_rope|normalizes|beyond Llama|"
                                         "llama_4_scaling_beta)")


def test_llama_family_models_with_llama_attention_still_convert_exactly():
    T = transformers
    for model in (_small(T.LlamaForCausalLM, T.LlamaConfig), _small(T.OlmoForCausalLM, T.OlmoConfig),
                  _small(T.SmolLM3ForCausalLM, T.SmolLM3Config, num_hidden_layers=2, no_rope_layers=[1, 1]),
                  _small(T.Ministral3ForCausalLM, T.Ministral3Config, head_dim=8, rope_parameters={
                      "rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.0,
                      "original_max_position_embeddings": 4})):
        ids = torch.randint(0, 64, (1, 12), generator=gen(3)).to(P.device)
        with torch.no_grad():
            ref = model(ids).logits.double()
            convert_llama(model, kv_rank=32, rope_dim=16, impl="reference")
            out = model(ids).logits.double()
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max(), type(model).__name__


def test_models_without_llama_layers_are_refused_by_name_leaving_no_hooks():
    """A decoder layer without ``self_attn`` (JetMoe's mixture of attention heads; a layer whose attention was
    removed) or a ``rotary_emb`` without one ``inv_freq`` is a ``TypeError`` naming ``model``, raised before the
    calibration hooks are placed: none is left on any attention."""
    T = transformers
    with pytest.raises(TypeError, match=r"^model: layers \[0, 1\] have no self_attn"):
        convert_llama(_small(T.JetMoeForCausalLM, T.JetMoeConfig), kv_rank=32, rope_dim=16)
    model = _small(T.LlamaForCausalLM, T.LlamaConfig)
    del model.model.layers[1].self_attn
    with pytest.raises(TypeError, match=r"^model: layers \[1\] have no self_attn"):
        convert_llama(model, kv_rank=32, rope_dim=16, calib_input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert not model.model.layers[0].self_attn._forward_pre_hooks
    model = _small(T.LlamaForCausalLM, T.LlamaConfig)
    del model.model.rotary_emb.inv_freq
    with pytest.raises(TypeError, match="^model: .*rotary_emb .*inv_freq"):
        convert_llama(model, kv_rank=32, rope_dim=16)


def test_a_grouped_decode_path_its_kernels_cannot_take_is_refused_where_it_is_chosen():
    """``decode_path="grouped"`` with decode kernels whose grouped op does not take the converted head dims (head_dim
    24 is no multiple of 16) is refused by ``convert_llama`` (naming ``decode_path``, the model left as it was) and by
    ``set_decode_path`` (naming ``path``, no attention changed), not at the first cached call; ``impl="reference"``
    takes any dims."""
    model = tiny_llama(13, g=2, d=24, layers=1)
    _refused_leaving_it_unchanged(model, "^decode_path: .*head_dim", decode_path="grouped", impl="triton")
    conv = convert_llama(copy.deepcopy(model), kv_rank=32, rope_dim=16, impl="triton", max_seqlen=16, page_size=16)
    ids = ids_for(14, 1, 4)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        conv(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="^path: .*head_dim"):
            set_decode_path(conv, "grouped")
        attn = conv.model.layers[0].self_attn
        assert attn.decode_path == "absorb" and attn._cache_of(cache) is not None
        conv(ids[:, :1], past_key_values=cache, use_cache=True)
    ref = convert_llama(copy.deepcopy(model), kv_rank=32, rope_dim=16, impl="reference", decode_path="grouped")
    assert ref.model.layers[0].self_attn.decode_path == "grouped"


def test_calib_input_ids_and_page_size_are_checked_before_any_change():
    model = tiny_llama(9, g=2, layers=1)
    before = copy.deepcopy(model.state_dict())
    bad = [(torch.tensor([[1, 2, 999]]), ValueError, "vocabulary|\\[0, 96\\)"),
           (torch.tensor([[-1, 2]]), ValueError, "\\[0, 96\\)"),
           (torch.tensor([[1.0, 2.0]]), TypeError, "int64"),
           (torch.tensor([[True, False]]), TypeError, "int64"),
           (torch.tensor([1, 2, 3]), ValueError, "\\[B, T\\]"),
           (torch.zeros(1, 0, dtype=torch.long), ValueError, "non-empty"),
           ([[1, 2]], TypeError, "torch.Tensor")]
    for ids, err, msg in bad:
        if isinstance(ids, torch.Tensor):
            ids = ids.to(P.device)
        with pytest.raises(err, match=f"calib_input_ids: .*({msg})"):
            convert_llama(model, kv_rank=8, rope_dim=8, calib_input_ids=ids)
    for page_size in (17, 0, "64", True):
        with pytest.raises(TypeError if isinstance(page_size, (str, bool)) else ValueError, match="page_size"):
            convert_llama(model, kv_rank=8, rope_dim=8, page_size=page_size)
    assert not any(isinstance(m, GQLAHFAttention) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_model_on_the_meta_device_is_refused_by_name():
    """A model built on the meta device (no weights loaded yet) holds no values to factorize: a ``ValueError``
    naming what is on meta (the model's rotary buffer, else the attention's weights)."""
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="^model: .*meta device"):
        convert_llama(model, kv_rank=8, rope_dim=8)
    inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    model.model.rotary_emb.register_buffer("inv_freq", inv, persistent=False)
    with pytest.raises(ValueError, match="^source: q_proj is on the meta device"):
        convert_llama(model, kv_rank=8, rope_dim=8)
    assert not any(isinstance(m, GQLAHFAttention) for m in model.modules())


def test_a_decode_step_the_layer_refuses_leaves_both_caches_as_they_were():
    """A cached step that ``GQLAttention`` itself refuses (a float64 layer decoding with the kernels) after a beam
    reorder of the HF cache: the HF cache records nothing and the GQLA cache keeps its rows, so the same step
    runs once the model is back in float32 (attending over the reordered rows)."""
    model = tiny_llama(31, g=2, layers=1)
    ids = ids_for(32, 2, 9)
    conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="triton", max_seqlen=32, page_size=16)
    attn = conv.model.layers[0].self_attn
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        want = conv(torch.cat([ids[:, :8].flip(0), ids[:, 8:]], 1), use_cache=False).logits[:, -1:]
        conv(ids[:, :8], past_key_values=cache, use_cache=True)
        cache.reorder_cache(torch.tensor([1, 0], device=P.device))
        conv.to(torch.float64)
        with pytest.raises(TypeError, match="impl='reference' only"):
            conv(ids[:, 8:], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length(0) == 8 and attn.gqla_cache.seqlens([0, 1]) == [8, 8]
        conv.to(torch.float32)
        got = conv(ids[:, 8:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_converted_model_saved_whole_loads_and_generates_the_same():
    """``torch.save`` of the whole converted model (after a cached call) and ``torch.load``: the copy generates the
    original model's tokens."""
    import io

    model = tiny_llama(33, g=2, layers=1)
    ids = ids_for(34, 1, 6)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="reference", max_seqlen=16, page_size=16)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        assert torch.equal(conv.generate(ids, **kw), want)
        buf = io.BytesIO()
        torch.save(conv, buf)
        buf.seek(0)
        got = torch.load(buf, weights_only=False).generate(ids, **kw)
    assert torch.equal(got, want), (got.tolist(), want.tolist())


@pytest.mark.parametrize("family", ["qwen2", "starcoder2"])
def test_attention_with_biases_is_refused_naming_the_model(family):
    """Qwen2's q / k / v biases (no ``attention_bias`` in its config) and Starcoder2's (``use_bias``): a
    ``ValueError`` naming ``model`` and the biased projection, the model left as it was."""
    T = transformers
    model = (_small(T.Qwen2ForCausalLM, T.Qwen2Config) if family == "qwen2" else
             _small(T.Starcoder2ForCausalLM, T.Starcoder2Config, sliding_window=None))
    _refused_leaving_it_unchanged(model, "^model: layer 0's attention's q_proj has a bias")


def test_a_converted_state_dict_loads_into_the_model_converted_alike():
    """The documented way back from a state dict: the source architecture converted with the same arguments, then
    ``load_state_dict``; ``set_decode_path`` forgets the GQLA caches, so a HF cache in progress is refused."""
    model = tiny_llama(35, g=2, layers=1)
    ids = ids_for(36, 1, 6)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    args = dict(**full_rank(model), impl="reference", max_seqlen=16, page_size=16)
    conv = convert_llama(copy.deepcopy(model), **args)
    fresh = convert_llama(transformers.LlamaForCausalLM(model.config).eval().to(P.device), **args)
    fresh.load_state_dict(conv.state_dict())
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        assert torch.equal(fresh.generate(ids, **kw), model.generate(ids, **kw))
        fresh(ids, past_key_values=cache, use_cache=True)
        set_decode_path(fresh, "grouped")
        with pytest.raises(ValueError, match="no GQLA cache"):
            fresh(ids[:, :1], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("reorder", [False, True], ids=["in_place", "beam_reorder"])
def test_a_step_the_hf_cache_cannot_take_leaves_both_caches_as_they_were(reorder):
    """A step past a user-built ``StaticCache``'s capacity is refused (naming ``cache``) before either cache
    changes; a HF cache update that raises after the GQLA step ran rolls that step back. Either way the next step
    that fits runs as if the refused one had never been tried (after a beam reorder too)."""
    model = tiny_llama(35, g=2, layers=1)
    ids = ids_for(36, 2, 10)
    conv = convert_llama(copy.deepcopy(model), **full_rank(model), impl="triton", max_seqlen=32, page_size=16)
    attn = conv.model.layers[0].self_attn
    static = transformers.StaticCache(config=model.config, max_cache_len=10)
    dynamic = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        full = ids if not reorder else torch.cat([ids[:, :8].flip(0), ids[:, 8:]], 1)
        want = conv(full, use_cache=False).logits[:, -2:]
        for cache in (static, dynamic):
            conv(ids[:, :8], past_key_values=cache, use_cache=True)
            if reorder:
                cache.reorder_cache(torch.tensor([1, 0], device=P.device))
        with pytest.raises(ValueError, match=r"cache: 3 more tokens after 8 pass the 10 tokens .*\(StaticCache\)"):
            conv(torch.cat([ids[:, 8:], ids[:, 8:9]], 1), past_key_values=static, use_cache=True)
        assert static.get_seq_length(0) == 8 and attn._cache_of(static).seqlens([0, 1]) == [8, 8]

        real = dynamic.update

        def broken(*a, **k):
            raise RuntimeError("update failed")
        dynamic.update = broken
        with pytest.raises(RuntimeError, match="update failed"):
            conv(ids[:, 8:], past_key_values=dynamic, use_cache=True)
        dynamic.update = real
        gq = attn._cache_of(dynamic)
        assert dynamic.get_seq_length(0) == 8 and gq.seqlens() == [8, 8, 0, 0]
        for cache in (static, dynamic):
            got = conv(ids[:, 8:], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
