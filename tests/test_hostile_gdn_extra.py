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
