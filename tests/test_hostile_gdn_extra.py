"""Hostile calls of the Gated DeltaNet ops and layer beside the other hostile suites: refusals by name that leave
every state as it was, and shapes at the edges of what the ops take."""

import pytest
import torch
from harness import P, randn

import gqla_triton as gq
from gqla_triton.ops.gdn import decode as gdn_decode

I32 = dict(dtype=torch.int32, device=P.device)


def _rows(cache):
    return [t.clone() for t in (cache._conv, cache.recurrent_state, cache._lens)]


def _unchanged(cache, rows):
    return all(torch.equal(a, b) for a, b in zip(rows, _rows(cache), strict=True))


@pytest.mark.parametrize("verify", [False, True])
def test_layer_decode_step_past_one_launch_changes_nothing(monkeypatch, verify):
    """A dense decode step whose (sequence x value head x V block) programs pass what one launch of the decode op
    takes (the bound lowered here: 2**31 - 1 programs are millions of sequences) is refused by name before the prep
    kernel advances any conv row or length: the cache is as it was, no verify step pending."""
    m = gq.GatedDeltaNet(32, 1, 2, 16, 16, impl="triton", dtype=torch.float32, device=P.device)
    cache = m.init_cache(3)
    with torch.no_grad():
        m(randn((3, 4, 32), 1), cache, slots=[0, 1, 2])
    before = _rows(cache)
    monkeypatch.setattr(gdn_decode, "MAX_GRID_X", 5)  # 3 sequences x 2 value heads x 1 V block = 6 programs
    for slots in ([0, 1, 2], torch.tensor([2, 0, 1], **I32)):
        with torch.no_grad(), pytest.raises(ValueError, match="^hidden_states: 3 sequences x 2 value heads .* more "
                                                              "than one launch takes"):
            m(randn((3, 1, 32), 2), cache, slots=slots, verify=verify)
        assert _unchanged(cache, before) and not cache.pending


def test_steps_without_value_heads_are_refused_by_name():
    """v with no value heads (HV = 0, a multiple of any H) is refused by the decode step and the functions on it, as
    by the chunked op, the state untouched."""
    from gqla_triton.ops.gdn.flash_qla import recurrent_gated_delta_rule

    q = randn((2, 3, 1, 16), 3)
    v, g = torch.zeros(2, 3, 0, 16, device=P.device), torch.zeros(2, 3, 0, device=P.device)
    pool = torch.zeros(2, 0, 16, 16, device=P.device)
    calls = (lambda: gq.gated_delta_rule_decode(q, q, v, g, g, pool),
             lambda: gq.fused_recurrent_gated_delta_rule(q, q, v),
             lambda: recurrent_gated_delta_rule(q, q, v, g, g),
             lambda: gq.chunk_gated_delta_rule(q, q, v, g, g))
    for call in calls:
        with torch.no_grad(), pytest.raises(ValueError, match="^(q/)?v: .*(non-empty B, s, heads|value heads HV=0)"):
            call()


def test_custom_ops_called_directly_check_their_arguments_by_name():
    """``torch.ops.gqla_triton``'s GDN forward ops called directly (as a serving framework calls custom ops) with an
    argument of another shape than the others give (here ones whose memory the kernels would read in bounds, as
    another layout: silently wrong) are refused by name, as the public functions refuse them, the state
    unchanged."""
    import gqla_triton.ops.gdn.api  # noqa: F401 (registers the ops)

    ops = torch.ops.gqla_triton
    T, HV, K, V = 20, 2, 16, 16
    q = torch.nn.functional.normalize(randn((1, T, 1, K), 4), dim=-1)
    v, g, beta = randn((1, T, HV, V), 5), -torch.rand(1, T, HV, device=P.device), torch.rand(1, T, HV, device=P.device)
    idx = torch.tensor([1], **I32)
    wide = randn((1, T, 2 * HV), 6)  # g over twice the value heads
    pool = randn((4, HV, K, V // 2), 7)  # rows of another width, as many bytes as 2 rows of [HV, K, V]
    before = pool.clone()
    fwd = (K ** -0.5, None, None, False, False, False, False, False, None, None, 64, "triton")
    with torch.no_grad():
        ops.chunk_gated_delta_rule_fwd(q, q, v, g, beta, *fwd)
        cases = [("^g: expected shape", lambda: ops.chunk_gated_delta_rule_fwd(q, q, v, wide, beta, *fwd)),
                 ("^initial_state: expected shape", lambda: ops.chunk_gated_delta_rule_pool(
                     q, q, v, g, beta, K ** -0.5, pool, idx, None, False, False, False, None, None, 64, "triton")),
                 ("^state: expected shape", lambda: ops.gated_delta_rule_decode(
                     q[:, :2], q[:, :2], v[:, :2], g[:, :2], beta[:, :2], pool, idx, K ** -0.5, False, None, None,
                     None, None, None, False, False, False, False))]
        for match, call in cases:
            with pytest.raises(ValueError, match=match):
                call()
    assert torch.equal(pool, before)


def test_chunk_backward_op_called_directly_checks_its_arguments_by_name():
    """``torch.ops.gqla_triton.chunk_gated_delta_rule_bwd`` called directly with a forward tensor of another shape,
    or saved tensors / gradients of other shapes than the forward's (memory the kernels would read as another
    layout, past its end) is refused by name; the forward's own tensors run."""
    import gqla_triton.ops.gdn.api  # noqa: F401 (registers the ops)

    ops = torch.ops.gqla_triton
    T, HV, K, V = 20, 2, 16, 16
    q = torch.nn.functional.normalize(randn((1, T, 1, K), 11), dim=-1)
    v, g, beta = randn((1, T, HV, V), 12), -torch.rand(1, T, HV, device=P.device), torch.rand(1, T, HV, device=P.device)
    h0 = randn((1, HV, K, V), 13)
    with torch.no_grad():
        o, ht, gc, Ainv, w, h, vnew = ops.chunk_gated_delta_rule_fwd(q, q, v, g, beta, K ** -0.5, h0, None, True, True,
                                                                     False, False, False, None, None, 64, "triton")
        args = dict(q=q, k=q, v=v, g=g, beta=beta, scale=K ** -0.5, initial_state=h0, cu_seqlens=None, gc=gc,
                    Ainv=Ainv, do=torch.ones_like(o), dht=torch.ones_like(ht), w=w, h=h, vnew=vnew, v_first=False,
                    beta_sigmoid=False, neg_eigval=False, A_log=None, dt_bias=None, chunk_size=64)
        ops.chunk_gated_delta_rule_bwd(**args)
        bad = [("^g: expected shape", "g", g[:, :, :1]),
               ("^initial_state: expected shape", "initial_state", h0[..., :8]),
               ("^do: expected shape", "do", o[..., :8]), ("^dht: expected shape", "dht", ht[..., :8]),
               ("^gc: expected shape", "gc", gc[:, :8]), ("^Ainv: expected shape", "Ainv", Ainv[..., :32]),
               ("^Ainv: expected dtype", "Ainv", Ainv.half()), ("^w: expected shape", "w", w[..., :8]),
               ("^h: expected shape", "h", h[:, :, :8]), ("^vnew: expected shape", "vnew", vnew[:, :8]),
               ("^w, h, vnew: ", "h", None)]
        for match, name, x in bad:
            with pytest.raises((ValueError, TypeError), match=match):
                ops.chunk_gated_delta_rule_bwd(**{**args, name: x})


def _prep_args(B=2, T=1, H=1, K=16, HV=2, V=16, W=4, P_=3):
    C = 2 * H * K + HV * V
    mixed = randn((B, T, C + HV * V + 2 * HV), 21)
    return dict(mixed=mixed, conv_weight=randn((C, 1, W), 22), conv_state=randn((P_, C, W - 1), 23),
                seqlens=torch.zeros(P_, **I32), slots=torch.arange(B, **I32), A_log=randn((HV,), 24),
                dt_bias=randn((HV,), 25), num_slots=P_, num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V,
                update=True)


def test_decode_prep_op_called_directly_checks_its_arguments_by_name():
    """``torch.ops.gqla_triton.gdn_decode_prep`` called directly with a pool of fewer rows than ``num_slots``, conv
    rows or weights of another width, a shorter length vector or head sizes that disagree with ``mixed`` (rows the
    kernel would read and write past their end) is refused by name, the conv rows and lengths unchanged."""
    import gqla_triton.layers.gdn_step  # noqa: F401 (registers the ops)

    ops = torch.ops.gqla_triton
    args = _prep_args()
    ops.gdn_decode_prep(**{**args, "conv_state": args["conv_state"].clone(), "seqlens": args["seqlens"].clone()})
    pool, lens = args["conv_state"], args["seqlens"]
    before = pool.clone(), lens.clone()
    small = pool[:1].clone()
    cases = [("^num_slots: ", dict(conv_state=small, seqlens=lens[:1].clone())),
             ("^conv_weight: expected", dict(conv_weight=args["conv_weight"][:32])),
             ("^conv_state: expected shape", dict(conv_weight=args["conv_weight"][..., :2])),
             ("^conv_state: expected shape", dict(conv_state=pool[..., :1].contiguous())),
             ("^seqlens: expected shape", dict(seqlens=lens[:1].clone())),
             ("^slots: expected shape", dict(slots=args["slots"][:1])),
             ("^A_log: expected shape", dict(A_log=args["A_log"][:1])),
             ("^mixed: expected", dict(head_v_dim=32))]
    for match, kw in cases:
        with torch.no_grad(), pytest.raises((ValueError, TypeError), match=match):
            ops.gdn_decode_prep(**{**args, **kw})
        assert torch.equal(pool, before[0]) and torch.equal(lens, before[1])
    assert small.shape[0] == 1


def test_gated_norm_op_called_directly_checks_its_arguments_by_name():
    """``torch.ops.gqla_triton.gdn_gated_norm`` called directly with z, weight or rows of other shapes than o's (the
    kernel reads them at o's offsets) is refused by name."""
    import gqla_triton.layers.gdn_step  # noqa: F401 (registers the ops)

    ops = torch.ops.gqla_triton
    o, z, w, rows = randn((2, 3, 2, 16), 31), randn((2, 3, 2, 16), 32), randn((16,), 33), torch.tensor([0, -1], **I32)
    ops.gdn_gated_norm(o, z, w, 1e-6, rows)
    for match, args in (("^z: expected shape", (o, z[:1], w, 1e-6, rows)),
                        ("^weight: expected shape", (o, z, w[:4], 1e-6, rows)),
                        ("^rows: expected shape", (o, z, w, 1e-6, rows[:1])),
                        ("^eps: ", (o, z, w, float("nan"), rows))):
        with pytest.raises(ValueError, match=match):
            ops.gdn_gated_norm(*args)
