"""Adversarial inputs of the Gated DeltaNet ops: every case of ``tools/sanitize_gdn.py`` (g = -inf, one NaN / Inf,
varlen edge lengths, GVA, hostile state indices) against the float64 recurrence, exactly where the non-finite
values go; under the interpreter every load and store is checked to lie inside the tensors of the call
(``AddressCheck``); on the GPU the same cases run without it (``compute-sanitizer`` runs the tool). Then the
rejections: every bad argument is a TypeError / ValueError naming it, raised before any state changes."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from addresscheck import AddressCheck
from harness import P

from gqla_triton.ops.gdn import chunk_gated_delta_rule, gated_delta_rule_decode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import sanitize_gdn as adv  # noqa: E402

DTYPE = torch.float32 if not P.big else torch.bfloat16
K = V = 16 if not P.big else 128


def _wrap():
    if P.big:
        return None

    @contextlib.contextmanager
    def check(tensors):
        with AddressCheck(*tensors) as ac:
            yield
        ac.assert_clean()

    return check


@pytest.mark.parametrize("case", adv.chunk_cases(), ids=lambda c: c.name)
def test_chunk_adversarial(case):
    bad = adv.run_chunk_case(case, device=P.device, dtype=DTYPE, K=K, V=V, wrap=_wrap())
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("case", adv.decode_cases(), ids=lambda c: c.name)
def test_decode_adversarial(case):
    bad = adv.run_decode_case(case, device=P.device, dtype=DTYPE, K=K, V=V, wrap=_wrap())
    assert not bad, "; ".join(bad)


# ------------------------------------------------------------------------------------------------ rejections
def _chunk_args(T=8, N=None):
    d = P.device
    q = torch.randn(1, T, 1, 16, device=d)
    v = torch.randn(1, T, 2, 16, device=d)
    g = -torch.rand(1, T, 2, device=d)
    return [q, q.clone(), v, g, torch.rand(1, T, 2, device=d)]


BAD_CU = [[0, -1, 8], [0, 5, 3, 8], [0, 9], [0, 2**62, 8], [1, 8], [0, 4], [0, 8, 2**63 - 1], [-(2**63), 8]]


@pytest.mark.parametrize("cu", BAD_CU)
@pytest.mark.parametrize("where", ["device", "cpu_copy"])
def test_chunk_bad_cu_seqlens(cu, where):
    xs = _chunk_args()
    t = torch.tensor(cu, dtype=torch.int64)
    if where == "device":
        with pytest.raises(ValueError, match="cu_seqlens"):
            chunk_gated_delta_rule(*xs, cu_seqlens=t.to(P.device))
    else:
        with pytest.raises(ValueError, match="cu_seqlens_cpu"):
            chunk_gated_delta_rule(*xs, cu_seqlens=torch.tensor([0, 3, 8][:len(cu)] + [8] * (len(cu) - 3),
                                                                device=P.device), cu_seqlens_cpu=t)


def test_chunk_strided_cu_seqlens_is_read_by_its_strides():
    xs = _chunk_args(T=70)
    base = torch.tensor([0, -5, 3, 99, 70, 7], dtype=torch.int32, device=P.device)
    ref, _ = chunk_gated_delta_rule(*xs, cu_seqlens=torch.tensor([0, 3, 70], dtype=torch.int32, device=P.device))
    with AddressCheck(*xs, base[::2]) if not P.big else contextlib.nullcontext() as ac:
        o, _ = chunk_gated_delta_rule(*xs, cu_seqlens=base[::2])
    if ac is not None:
        ac.assert_clean()
    assert torch.equal(o, ref)


def test_chunk_rejections():
    xs = _chunk_args()
    f = chunk_gated_delta_rule
    q, k, v, g, b = xs
    cases = [
        (TypeError, "scale", dict(scale="0.5")), (TypeError, "scale", dict(scale=True)),
        (ValueError, "scale", dict(scale=float("nan"))), (TypeError, "scale", dict(scale=torch.tensor(0.5))),
        (TypeError, "output_final_state", dict(output_final_state=1)),
        (TypeError, "use_qk_l2norm_in_kernel", dict(use_qk_l2norm_in_kernel="yes")),
        (TypeError, "save_states", dict(save_states=None)),
        (TypeError, "initial_state", dict(initial_state=torch.zeros(1, 2, 16, 16, device=P.device).half())),
        (ValueError, "initial_state", dict(initial_state=torch.zeros(1, 2, 16, 8, device=P.device))),
        (TypeError, "initial_state", dict(initial_state=[[0.0]])),
        (TypeError, "cu_seqlens", dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int16, device=P.device))),
        (ValueError, "cu_seqlens", dict(cu_seqlens=torch.tensor([[0, 8]], device=P.device))),
    ]
    for exc, name, kw in cases:
        with pytest.raises(exc, match=name):
            f(*xs, **kw)
    with pytest.raises(TypeError, match="v"):
        f(q, k, v.half(), g, b)
    with pytest.raises(TypeError, match="g"):
        f(q, k, v, g.to(torch.int32), b)
    with pytest.raises(TypeError, match="beta"):
        f(q, k, v, g, b.double())
    with pytest.raises(TypeError, match="q"):
        f(q.to(torch.int64), k, v, g, b)


def _decode_args(B=2, P_=4):
    d = P.device
    q = torch.randn(B, 1, 1, 16, device=d)
    return dict(q=q, k=q.clone(), v=torch.randn(B, 1, 2, 16, device=d), g=-torch.rand(B, 1, 2, device=d),
                beta=torch.rand(B, 1, 2, device=d), state=torch.randn(P_, 2, 16, 16, device=d))


@pytest.mark.parametrize("idx", [[0, 4], [1, 1], [3, 2**31 - 1], [2, 2]])
def test_decode_bad_state_indices_change_nothing(idx):
    a = _decode_args()
    before = a["state"].clone()
    with pytest.raises(ValueError, match="state_indices"):
        gated_delta_rule_decode(**a, state_indices=torch.tensor(idx, dtype=torch.int32, device=P.device))
    assert torch.equal(a["state"], before)


def test_decode_repeated_negative_indices_skip():
    """Negative indices skip their sequence (output 0, no row touched); they may repeat."""
    a = _decode_args()
    before = a["state"].clone()
    o = gated_delta_rule_decode(**a, state_indices=torch.tensor([-1, -1], dtype=torch.int32, device=P.device))
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(a["state"], before)


def test_decode_rejections():
    a = _decode_args()
    f = gated_delta_rule_decode
    cases = [
        (TypeError, "scale", dict(scale="x")), (ValueError, "scale", dict(scale=float("inf"))),
        (TypeError, "use_qk_l2norm_in_kernel", dict(use_qk_l2norm_in_kernel=2)),
        (TypeError, "state_indices", dict(state_indices=torch.zeros(2, dtype=torch.int64, device=P.device))),
        (TypeError, "state_indices", dict(state_indices=[0, 1])),
        (ValueError, "state_indices", dict(state_indices=torch.zeros(2, 1, dtype=torch.int32, device=P.device))),
    ]
    for exc, name, kw in cases:
        with pytest.raises(exc, match=name):
            f(**a, **kw)
    for name, bad in (("g", a["g"].to(torch.int32)), ("k", a["k"].half()), ("state", a["state"].double()),
                      ("beta", a["beta"][:, :, :1])):
        with pytest.raises((TypeError, ValueError), match=name):
            f(**{**a, name: bad})


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_decode_backward_raises(impl):
    a = _decode_args()
    q = a["q"].clone().requires_grad_()
    o = gated_delta_rule_decode(**{**a, "q": q}, impl=impl)
    assert o.requires_grad
    with pytest.raises(RuntimeError, match="forward-only"):
        o.sum().backward()
    o = gated_delta_rule_decode(**a, impl=impl)  # nothing requires grad: a plain tensor
    assert not o.requires_grad and o.grad_fn is None
