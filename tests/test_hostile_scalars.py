"""Every keyword of the public ops (``mla_decode`` over a bf16-style and an FP8 cache), called with hostile values
(None, bools, 0, ±1, 2**31, ±2**63, 1.5, NaN, ±inf, a string, a list, a tuple, 0-d and 1-d tensors, an object):
each call either runs or is refused with a ``TypeError`` / ``ValueError`` that names the argument. Nothing else
(no raw torch / Triton error, no crash)."""

import math

import pytest
import torch
from harness import P

import gqla_triton as gq

pytestmark = pytest.mark.skipif(P.big, reason="CPU profile: tiny shapes through the interpreter (the GPU profile "
                                               "runs the adversarial decode and GDN suites)")

HOSTILE = [None, True, False, 0, -1, 1, 2, 3, 7, 2**31, 2**63, -2**63, 1.5, math.nan, math.inf, -math.inf, "x", [1],
           (1,), torch.tensor(1), torch.tensor([1.0]), object()]


def _unclear(fn, keywords, label: str = "") -> list[str]:
    """Each keyword of ``fn`` called with every hostile value: the calls neither run nor are refused by a
    TypeError / ValueError that names the keyword."""
    out = []
    for name in keywords:
        for value in HOSTILE:
            try:
                fn(**{name: value})
            except (TypeError, ValueError, NotImplementedError) as e:
                if name not in str(e) and name.strip("_") not in str(e):
                    out.append(f"{label}{name}={value!r}: {type(e).__name__}: {str(e)[:120]}")
            except Exception as e:  # noqa: BLE001 - any other exception is the failure these tests look for
                out.append(f"{label}{name}={value!r}: raw {type(e).__name__}: {str(e)[:120]}")
    return out


def _ops():
    g = torch.Generator().manual_seed(0)
    B, page, r, dr, hq = 2, 16, 32, 16, 16
    bt = torch.arange(6, dtype=torch.int32).view(2, 3)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    kv = torch.randn(6, page, 1, r + dr, generator=g)
    q = torch.randn(B, 1, hq, r + dr, generator=g)

    def mla(**o):
        hdv = o.pop("head_dim_v", r)
        return gq.mla_decode(q, kv, bt, lens, hdv, **o)

    def fmla(**o):  # FlashMLA's interface over the same cache
        hdv = o.pop("head_dim_v", r)
        meta = o.pop("tile_scheduler_metadata", gq.get_mla_metadata()[0])
        return gq.flash_mla_with_kvcache(q, kv, bt, lens, hdv, meta, **o)

    rows = torch.randint(-1, 6 * page, (B, 1, 24), generator=g, dtype=torch.int32)

    def fmla_sparse(**o):  # physical rows, with an extra cache unless the keyword under test is one of its pair
        o.setdefault("indices", rows)
        if "extra_k_cache" not in o and "extra_indices_in_kvcache" not in o:
            o.update(extra_k_cache=kv[:2], extra_indices_in_kvcache=rows % (2 * page))
        return fmla(**o)

    kc, vc = torch.randn(6, page, 2, 16, generator=g), torch.randn(6, page, 2, 16, generator=g)
    kr, qg = torch.randn(6, page, 16, generator=g), torch.randn(B, 1, 32, 32, generator=g)

    def gqa(**o):
        return gq.gqa_decode(qg, kc, vc, bt, lens, k_rope_cache=o.pop("k_rope_cache", kr), **o)

    T, H, K, V = 20, 1, 16, 16
    x = [torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g),
         torch.randn(1, T, 2, V, generator=g), -torch.rand(1, T, 2, generator=g), torch.rand(1, T, 2, generator=g)]

    def chunk(**o):
        return gq.chunk_gated_delta_rule(*x, **o)

    def fqla_fwd(**o):
        return gq.chunk_gated_delta_rule_fwd(*x, **o)

    g_cum, A, o_, _, ht, _ = gq.chunk_gated_delta_rule_fwd(*x)

    def fqla_bwd(**o):
        return gq.chunk_gated_delta_rule_bwd(x[0], x[1], x[2], o.pop("g", g_cum), x[4], o.pop("A", A),
                                             o.pop("do", torch.ones_like(o_)), **o)

    def fqla_recurrent(**o):
        return gq.recurrent_gated_delta_rule(*x, **o)

    def recurrent(**o):
        o.setdefault("g", x[3])
        o.setdefault("beta", x[4])
        return gq.fused_recurrent_gated_delta_rule(*x[:3], **o)

    xd = [torch.randn(2, 1, H, K, generator=g), torch.randn(2, 1, H, K, generator=g),
          torch.randn(2, 1, 2, V, generator=g), -torch.rand(2, 1, 2, generator=g), torch.rand(2, 1, 2, generator=g)]
    pool = torch.randn(3, 2, K, V, generator=g)

    def dec(**o):
        return gq.gated_delta_rule_decode(*xd, o.pop("state", pool.clone()), **o)

    kv8 = gq.quantize_latent_fp8(torch.randn(6, page, 1, 576, generator=g))
    q8 = torch.randn(B, 1, hq, 576, generator=g)

    def mla8(**o):
        hdv = o.pop("head_dim_v", 512)
        return gq.mla_decode(q8, kv8, bt, lens, hdv, **o)

    def quant(**o):
        return gq.quantize_latent_fp8(torch.randn(3, 576, generator=g), **o)

    def quant_paged(**o):  # the paged layouts' 512 values per token
        return gq.quantize_latent_fp8(torch.randn(2, 4, 1, 512, generator=g), **{"layout": "model1", **o})

    def dequant(**o):
        return gq.dequantize_latent_fp8(kv8, **o)

    s_q, s_kv = 3, 20
    qp, kvp = torch.randn(s_q, hq, r + dr, generator=g), torch.randn(s_kv, 1, r + dr, generator=g)
    idx_p = torch.randint(-1, s_kv, (s_q, 1, 8), generator=g, dtype=torch.int32)

    def prefill(**o):
        return gq.mla_sparse_prefill(qp, kvp, o.pop("indices", idx_p), o.pop("head_dim_v", r), **o)

    def fmla_prefill(**o):  # FlashMLA's sparse prefill over the same rows
        return gq.flash_mla_sparse_fwd(qp, kvp, o.pop("indices", idx_p), o.pop("sm_scale", 0.1), **{"d_v": r, **o})

    def sched(**o):
        return gq.get_mla_decoding_metadata(**{"seqlens_k": lens, "num_q_tokens_per_head_k": hq, "h_k": 1, **o})

    return {
        "mla_decode fp8": (mla8, ["head_dim_v", "softmax_scale", "causal", "num_splits", "impl", "indices",
                                  "topk_length"]),
        "quantize_latent_fp8": (quant, ["pow2_scales"]),
        "quantize_latent_fp8 paged": (quant_paged, ["layout"]),
        "dequantize_latent_fp8": (dequant, ["dtype", "kv_format"]),
        "mla_sparse_prefill": (prefill, ["head_dim_v", "softmax_scale", "topk_length", "num_splits", "impl",
                                         "indices"]),
        "flash_mla_sparse_fwd": (fmla_prefill, ["sm_scale", "d_v", "attn_sink", "topk_length", "use_legacy",
                                                "return_log2_lse", "indices"]),
        "get_mla_decoding_metadata": (sched, ["seqlens_k", "num_q_tokens_per_head_k", "h_k", "h_q",
                                              "is_fp8_kvcache", "topk"]),
        "mla_decode": (mla, ["head_dim_v", "softmax_scale", "causal", "num_splits", "impl", "indices", "topk_length",
                             "return_lse"]),
        "gqa_decode": (gqa, ["softmax_scale", "causal", "num_splits", "impl", "indices", "topk_length"]),
        "flash_mla_with_kvcache": (fmla, ["head_dim_v", "tile_scheduler_metadata", "num_splits", "softmax_scale",
                                          "causal", "is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache",
                                          "extra_indices_in_kvcache", "topk_length", "extra_topk_length",
                                          "enable_batch_invariant", "use_legacy", "kv_format", "descale_q",
                                          "descale_k"]),
        "flash_mla_with_kvcache sparse": (fmla_sparse, ["indices", "attn_sink", "extra_k_cache",
                                                        "extra_indices_in_kvcache", "topk_length", "extra_topk_length",
                                                        "causal", "softmax_scale", "is_fp8_kvcache",
                                                        "enable_batch_invariant", "use_legacy", "kv_format"]),
        "chunk_gated_delta_rule": (chunk, ["scale", "initial_state", "output_final_state", "cu_seqlens", "chunk_size",
                                           "use_qk_l2norm_in_kernel", "impl", "save_states", "allow_neg_eigval",
                                           "use_beta_sigmoid_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias",
                                           "cu_seqlens_cpu", "chunk_indices", "head_first"]),
        "chunk_gated_delta_rule_fwd": (fqla_fwd, ["scale", "initial_state", "cu_seqlens", "output_final_state",
                                                  "output_h", "auto_cp", "state_v_first", "enable_fwd_cp_cache"]),
        "chunk_gated_delta_rule_bwd": (fqla_bwd, ["g", "A", "do", "dht", "scale", "initial_state", "cu_seqlens",
                                                  "state_v_first", "auto_cp", "cp_cache"]),
        "recurrent_gated_delta_rule": (fqla_recurrent, ["scale", "initial_state", "output_final_state",
                                                        "use_qk_l2norm_in_kernel", "seqlens", "head_first",
                                                        "head_batch"]),
        "gated_delta_rule_decode": (dec, ["state", "state_indices", "scale", "use_qk_l2norm_in_kernel", "impl",
                                          "A_log", "dt_bias", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                                          "allow_neg_eigval", "cu_seqlens", "intermediate_states"]),
        "fused_recurrent_gated_delta_rule": (recurrent, ["g", "gk", "gv", "beta", "scale", "initial_state",
                                                         "output_final_state", "use_qk_l2norm_in_kernel",
                                                         "use_gate_in_kernel", "A_log", "dt_bias",
                                                         "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                                                         "state_v_first", "cu_seqlens", "impl", "head_first",
                                                         "transpose_state_layout"]),
    }


@pytest.mark.parametrize("op", ["mla_decode", "mla_decode fp8", "quantize_latent_fp8", "quantize_latent_fp8 paged",
                                "dequantize_latent_fp8", "mla_sparse_prefill", "flash_mla_sparse_fwd",
                                "get_mla_decoding_metadata", "gqa_decode",
                                "flash_mla_with_kvcache", "flash_mla_with_kvcache sparse", "chunk_gated_delta_rule",
                                "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd",
                                "recurrent_gated_delta_rule", "gated_delta_rule_decode",
                                "fused_recurrent_gated_delta_rule"])
def test_hostile_keyword_values_run_or_are_refused_by_name(op):
    fn, keywords = _ops()[op]
    fn()  # the base call is valid
    unclear = _unclear(fn, keywords)
    assert not unclear, f"{op}: {len(unclear)} calls not refused by name:\n" + "\n".join(unclear[:20])


def _layers():
    from gqla_triton.layers.cache import GroupedCache, LatentCache
    from gqla_triton.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetCache
    from gqla_triton.layers.gqla import GQLAttention

    gdn = dict(hidden_size=32, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    gqla = dict(hidden_size=64, num_heads=16, num_groups=2, head_dim=16, rope_dim=16, kv_rank=32)
    lc = dict(max_batch=2, max_seqlen=32, kv_rank=32, rope_dim=16, page_size=16)
    gc = dict(max_batch=2, max_seqlen=32, num_groups=2, head_dim=16, rope_dim=16, page_size=16)
    gdc = dict(num_seqs=2, conv_dim=8, conv_size=4, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    torch.manual_seed(0)
    layer = GQLAttention(**gqla, impl="triton", dtype=torch.float32)
    gl = GatedDeltaNet(**gdn, impl="triton")
    x, xg = torch.randn(2, 1, 64), torch.randn(2, 5, 32)

    def fwd(**o):
        return layer(x, o.pop("positions", None), layer.make_cache(3, 64, page_size=16, path="absorb"), **o)

    def gfwd(**o):
        return gl(xg, o.pop("cache", gl.init_cache(3)), **o)

    return {
        "GatedDeltaNet": (lambda **o: GatedDeltaNet(**{**gdn, **o}),
                          list(gdn) + ["conv_size", "norm_eps", "layer_idx", "impl", "dtype", "save_states"]),
        "GQLAttention": (lambda **o: GQLAttention(**{**gqla, **o}),
                         list(gqla) + ["q_rank", "v_head_dim", "rope_theta", "softmax_scale", "path", "impl", "dtype",
                                       "kv_norm", "norm_eps", "rope_inv_freq"]),
        "LatentCache": (lambda **o: LatentCache(**{**lc, **o}),
                        list(lc) + ["num_pages", "dtype", "auto_reserve", "compute_dtype"]),
        "GroupedCache": (lambda **o: GroupedCache(**{**gc, **o}),
                         list(gc) + ["v_head_dim", "num_pages", "dtype", "auto_reserve"]),
        "GatedDeltaNetCache": (lambda **o: GatedDeltaNetCache(**{**gdc, **o}), list(gdc) + ["dtype"]),
        "GQLAttention.forward": (fwd, ["positions", "seq_ids", "indices", "topk_length"]),
        "GQLAttention.make_cache": (lambda **o: layer.make_cache(**{**dict(max_batch=2, max_seqlen=32), **o}),
                                    ["max_batch", "max_seqlen", "path", "page_size", "num_pages", "dtype", "s_q",
                                     "auto_reserve"]),
        "GQLAttention.choose_path": (lambda **o: layer.choose_path(**{**dict(batch=2, seqlen=32), **o}),
                                     ["batch", "seqlen", "s_q"]),
        "GatedDeltaNet.forward": (gfwd, ["cache", "cu_seqlens", "slots", "verify"]),
        "GatedDeltaNet.init_cache": (lambda **o: gl.init_cache(**{**dict(num_seqs=2), **o}), ["num_seqs"]),
    }


@pytest.mark.parametrize("target", ["GatedDeltaNet", "GQLAttention", "LatentCache", "GroupedCache",
                                    "GatedDeltaNetCache", "GQLAttention.forward", "GQLAttention.make_cache",
                                    "GQLAttention.choose_path", "GatedDeltaNet.forward", "GatedDeltaNet.init_cache"])
def test_hostile_layer_and_cache_arguments_run_or_are_refused_by_name(target):
    """The layers' and caches' constructors and methods (sizes up to ±2**63, NaN / inf eps and theta, strings and
    tensors for flags): each call runs or is refused by a TypeError / ValueError naming the argument (``device`` is
    torch's to refuse)."""
    fn, keywords = _layers()[target]
    fn()
    unclear = _unclear(fn, keywords)
    assert not unclear, f"{target}: {len(unclear)} calls not refused by name:\n" + "\n".join(unclear[:20])


def test_hostile_conversion_and_norm_arguments_run_or_are_refused_by_name():
    """``trans_gqla``'s and ``RMSNorm``'s keywords with the hostile values, and source weights that are not finite
    2-D floating tensors: each call runs or is refused by name."""
    h, g, d, hid = 4, 2, 8, 32
    gen = torch.Generator().manual_seed(0)
    src = {"q_proj": torch.randn(h * d, hid, generator=gen), "k_proj": torch.randn(g * d, hid, generator=gen),
           "v_proj": torch.randn(g * d, hid, generator=gen), "o_proj": torch.randn(hid, h * d, generator=gen)}
    base = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=16, rope_dim=4)
    targets = {
        "trans_gqla": (lambda **o: gq.trans_gqla(src, **{**base, **o}),
                       list(base) + ["v_head_dim", "rope_theta", "rope_inv_freq", "rope_attention_scaling",
                                     "softmax_scale", "calib", "balance_kv", "path", "impl", "dtype"]),
        "RMSNorm": (lambda **o: gq.RMSNorm(**{"dim": 8, **o}), ["dim", "eps", "dtype"]),
    }
    unclear = []
    for label, (fn, keywords) in targets.items():
        fn()
        unclear += _unclear(fn, keywords, f"{label} ")
    for k in src:
        for bad, exc in (([1.0, 2.0], TypeError), (torch.randn(3), ValueError), (src[k].int(), TypeError),
                         (torch.full_like(src[k], math.nan), ValueError)):
            try:
                gq.trans_gqla({**src, k: bad}, **base)
                unclear.append(f"trans_gqla source {k}: {type(bad).__name__} accepted")
            except (TypeError, ValueError) as e:
                if k not in str(e) or type(e) is not exc:
                    unclear.append(f"trans_gqla source {k}: {type(e).__name__} {str(e)[:120]}")
    assert not unclear, f"{len(unclear)} calls not refused by name:\n" + "\n".join(unclear[:20])


def test_hostile_cache_method_arguments_are_refused_by_name_and_change_nothing():
    """Every slot / count / page argument of ``LatentCache``'s methods with the hostile values plus bad slot lists
    (duplicates, -1, out of range, a tuple, a tensor): each call runs or raises a TypeError / ValueError, and a
    refused call leaves the cache exactly as it was."""
    from test_kv_cache import assert_unchanged, snapshot

    from gqla_triton.layers.cache import LatentCache

    values = HOSTILE + [[0, 0], [0, -1], [5], (0, 1), torch.tensor([0, 1])]
    calls = {
        "gather": lambda c, v: c.gather(v), "slot_index": lambda c, v: c.slot_index(v),
        "seqlens": lambda c, v: c.seqlens(v), "reserved": lambda c, v: c.reserved(v),
        "holds_tokens": lambda c, v: c.holds_tokens(v), "tables": lambda c, v: c.tables(v),
        "reserve(seq_ids)": lambda c, v: c.reserve(v, 3), "reserve(num_tokens)": lambda c, v: c.reserve([0], v),
        "free": lambda c, v: c.free(v), "fork(src)": lambda c, v: c.fork(v, 2), "fork(dst)": lambda c, v: c.fork(0, v),
        "append(seq_ids)": lambda c, v: c.append(v, torch.randn(1, 2, 32), torch.randn(1, 2, 16)),
        "append(c_kv)": lambda c, v: c.append([0], v, torch.randn(1, 2, 16)),
        "latent_rows(start)": lambda c, v: c.latent_rows(v), "latent_rows(stop)": lambda c, v: c.latent_rows(0, v),
    }
    bad = []
    for label, call in calls.items():
        for v in values:
            cache = LatentCache(3, 64, 32, 16, page_size=16)
            cache.append([0, 1], torch.randn(2, 5, 32), torch.randn(2, 5, 16))
            before = snapshot(cache)
            try:
                call(cache, v)
            except (TypeError, ValueError) as e:
                try:
                    assert_unchanged(before, cache)
                except AssertionError:
                    bad.append(f"{label}({v!r}): refused ({e}) but the cache changed")
            except Exception as e:  # noqa: BLE001 - any other exception is the failure this test looks for
                bad.append(f"{label}({v!r}): raw {type(e).__name__}: {str(e)[:120]}")
    assert not bad, "\n".join(bad[:20])


_KINDS = {  # what each kind of argument takes: any other value is a TypeError naming the argument
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "real": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "choice": lambda v: isinstance(v, str),
    "flag": lambda v: isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)),
    "device": lambda v: isinstance(v, (str, torch.device)) or (isinstance(v, int) and not isinstance(v, bool)),
}


def _mistyped(fn, kinds: dict[str, str], label: str = "") -> list[str]:
    """Each keyword of ``fn`` (``kinds``: its kind, ``"?"`` where None is taken too) called with every hostile value
    of another type: the calls not refused by a TypeError that names the keyword."""
    out = []
    for name, kind in kinds.items():
        takes = _KINDS[kind.rstrip("?")]
        for value in HOSTILE:
            if takes(value) or (value is None and kind.endswith("?")):
                continue
            try:
                fn(**{name: value})
                out.append(f"{label}{name}={value!r}: accepted")
            except TypeError as e:
                if not str(e).startswith(f"{name}: ") and f"{name}: " not in str(e):
                    out.append(f"{label}{name}={value!r}: TypeError not naming it: {str(e)[:120]}")
            except Exception as e:  # noqa: BLE001 - any other exception is the failure this test looks for
                out.append(f"{label}{name}={value!r}: {type(e).__name__}: {str(e)[:120]}")
    return out


def test_arguments_of_the_wrong_type_are_a_type_error_naming_them():
    """A number, choice, flag or device argument given a value of another type (a string, a bool, a tensor, a
    list, None where one is required, a float where an int is) is a TypeError that names it, in the ops, the
    layers and caches, the conversion and ``RMSNorm``; a value of the right type outside its range stays a
    ValueError (the sweeps above)."""
    ops, layers = _ops(), _layers()
    h, g, d, hid = 4, 2, 8, 32
    gen = torch.Generator().manual_seed(0)
    src = {"q_proj": torch.randn(h * d, hid, generator=gen), "k_proj": torch.randn(g * d, hid, generator=gen),
           "v_proj": torch.randn(g * d, hid, generator=gen), "o_proj": torch.randn(hid, h * d, generator=gen)}
    base = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=16, rope_dim=4)
    decode = dict(softmax_scale="real?", causal="flag", num_splits="int", impl="choice")
    targets = {
        "mla_decode": (ops["mla_decode"][0], dict(head_dim_v="int", **decode)),
        "mla_decode fp8": (ops["mla_decode fp8"][0], dict(head_dim_v="int", num_splits="int", impl="choice")),
        "quantize_latent_fp8": (ops["quantize_latent_fp8 paged"][0], dict(layout="choice")),
        "dequantize_latent_fp8": (ops["dequantize_latent_fp8"][0], dict(kv_format="choice?")),
        "mla_sparse_prefill": (ops["mla_sparse_prefill"][0], dict(head_dim_v="int", softmax_scale="real?",
                                                                  num_splits="int", impl="choice")),
        "flash_mla_sparse_fwd": (ops["flash_mla_sparse_fwd"][0], dict(sm_scale="real?", d_v="int")),
        "gqa_decode": (ops["gqa_decode"][0], decode),
        "flash_mla_with_kvcache": (ops["flash_mla_with_kvcache"][0], dict(head_dim_v="int", softmax_scale="real?",
                                                                          kv_format="choice?")),
        "chunk_gated_delta_rule": (ops["chunk_gated_delta_rule"][0], dict(scale="real?", chunk_size="int",
                                                                          impl="choice")),
        "gated_delta_rule_decode": (ops["gated_delta_rule_decode"][0], dict(scale="real?", impl="choice")),
        "fused_recurrent_gated_delta_rule": (ops["fused_recurrent_gated_delta_rule"][0],
                                             dict(scale="real?", impl="choice")),
        "GatedDeltaNet": (layers["GatedDeltaNet"][0], dict(norm_eps="real", impl="choice", device="device?")),
        "GQLAttention": (layers["GQLAttention"][0], dict(rope_theta="real", norm_eps="real", softmax_scale="real?",
                                                         path="choice", impl="choice", device="device?")),
        "GQLAttention.make_cache": (layers["GQLAttention.make_cache"][0], dict(path="choice?")),
        "LatentCache": (layers["LatentCache"][0], dict(device="device?")),
        "trans_gqla": (lambda **o: gq.trans_gqla(src, **{**base, **o}),
                       dict(rope_theta="real", rope_attention_scaling="real", softmax_scale="real?", path="choice",
                            impl="choice", device="device?")),
        "RMSNorm": (lambda **o: gq.RMSNorm(**{"dim": 8, **o}), dict(eps="real", device="device?")),
        "rope_inv_freq": (lambda **o: gq.layers.rope.rope_inv_freq(**{"d": 8, **o}),
                          dict(theta="real", device="device?")),
        "choose_decode_path": (lambda **o: gq.choose_decode_path(
            dict(num_heads=16, num_groups=2, head_dim=16, rope_dim=16, kv_rank=32), 1, "h20", **o),
            dict(override="choice?")),
        "select_config": (lambda **o: gq.select_config(**{"op": "combine", **o}), dict(op="choice")),
    }
    bad = []
    for label, (fn, kinds) in targets.items():
        bad += _mistyped(fn, kinds, f"{label} ")
    assert not bad, f"{len(bad)} calls of the wrong type not a TypeError by name:\n" + "\n".join(bad[:30])


def test_numpy_scalars_of_the_right_type_are_taken():
    """numpy integers and floats are ints and real numbers to every check (a TypeError is for other types)."""
    import numpy as np

    from gqla_triton.ops._common import validation as V

    assert V.check_eps("eps", np.float32(0.5)) == 0.5 and V.check_positive_real("theta", np.float64(2.0)) == 2.0
    assert V.check_norm_eps("norm_eps", np.float32(1e-6)) == float(np.float32(1e-6))
    assert V.check_num_splits(np.int64(3)) == 3 and V.check_softmax_scale(np.float32(0.5), 1.0) == 0.5
    assert V.check_device(None) is None and V.check_device("cpu") == torch.device("cpu")
    for fn, value in ((V.check_eps, -1e-3), (V.check_positive_real, np.float64(0.0)), (V.check_eps, math.nan)):
        with pytest.raises(ValueError, match="^x: "):
            fn("x", value)
    with pytest.raises(ValueError, match="^num_splits: "):
        V.check_num_splits(np.int64(2000))
    with pytest.raises(ValueError, match="^device: "):
        V.check_device("gpu")
