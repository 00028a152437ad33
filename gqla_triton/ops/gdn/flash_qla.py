"""FlashQLA's entry points beside its ``chunk_gated_delta_rule``: ``chunk_gated_delta_rule_fwd`` and
``chunk_gated_delta_rule_bwd`` (the forward and the backward as two calls, for callers that keep their own autograd
state: FlashQLA's tests, its autograd function, frameworks built on it) on this package's chunked kernels, and its
decode form ``recurrent_gated_delta_rule`` on the decode step (``decode.py``).

They run the stages of ``chunk_gated_delta_rule`` (``api.py``): eager calls the launchers, torch.compile the same
custom ops. FlashQLA's intra-card context parallelism is a schedule, not a result: here the plan splits long
sequences itself, so ``auto_cp`` / ``enable_fwd_cp_cache`` change nothing and no CP cache is ever returned.
"""

from __future__ import annotations

import torch

from ...dispatch import device_info
from .._common.host import cdiv
from .._common.validation import (
    check_dense,
    check_flag,
    check_kernel_device,
    check_scale,
    check_tensor,
    is_int,
    refuse_grad,
)
from . import plan as plan_mod
from .api import (
    _REFERENCE,
    _STATE_DTYPES,
    _bwd,
    _bwd_op,
    _fwd,
    _fwd_op,
    check_inputs,
    chunk_gated_delta_rule,  # FlashQLA's top-level name, beside its fwd / bwd
)
from .decode import gated_delta_rule_decode
from .launch import mid_dtype
from .plan import chunk_plan

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_fwd",
           "recurrent_gated_delta_rule"]

CHUNK = 64  # FlashQLA's chunk on Hopper (its A is [B, T, HV, 64])


def _common(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    """Checks both entry points share; returns (N, scale, v_first, state row shape)."""
    v_first = check_flag("state_v_first", state_v_first)
    N, dev = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    row = (HV, V, K) if v_first else (HV, K, V)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(N, *row), dtypes=_STATE_DTYPES)
        check_kernel_device(dev, _REFERENCE, initial_state.dtype)
    check_kernel_device(dev, _REFERENCE, q.dtype)
    return N, float(check_scale("scale", scale, K ** -0.5)), v_first, row


def _no_cp_context(op: str, cp_context) -> None:
    """FlashQLA 0.1.3's ``cp_context`` (its context-parallel plan, inter- or intra-card): only None is taken."""
    if cp_context is not None:
        raise ValueError(f"cp_context: not supported by {op} (FlashQLA's context-parallel plan; here the plan splits "
                         "long sequences by itself and no context parallelism spans cards); pass None or leave it out")


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                               output_final_state=True, output_h=False, auto_cp=True, state_v_first=False,
                               enable_fwd_cp_cache=False, cp_context=None, is_train=None):
    """FlashQLA's forward: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g (log decay), beta ``[B, T, HV]``,
    initial_state ``[N, HV, K, V]`` (``state_v_first``: ``[N, HV, V, K]``) or None, cu_seqlens ``[N+1]`` or None;
    inputs as ``chunk_gated_delta_rule`` takes them (no in-kernel l2norm or gate: FlashQLA's autograd function
    applies those around this call).

    Returns ``(g, A, o, h, final_state, cp_cache)``: g ``[B, T, HV]`` fp32, the decay's cumulative sum within each
    64-token chunk; A ``[B, T, HV, 64]`` (bf16 for bf16 inputs, else fp32), each chunk's ``(I + A)^-1`` with the
    decays in it, for ``chunk_gated_delta_rule_bwd`` only (not FlashQLA's ungated matrix: the two libraries'
    A do not mix); g, A and o are 0 at tokens outside ``[cu[0], cu[N])``; o ``[B, T, HV, V]`` in v's dtype; h the state at each chunk's start in k's dtype with
    ``output_h`` (``[B, ceil(T/64), HV, K, V]``, or ``[1, chunks, HV, K, V]`` over the sequences' own chunks with
    cu_seqlens, which then reads cu_seqlens on the host and is refused under torch.compile; ``[.., V, K]`` rows with
    ``state_v_first``), else None; final_state ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]``) or None without
    ``output_final_state``; cp_cache None. ``auto_cp`` / ``enable_fwd_cp_cache``: bools, no effect (see the
    module docstring); FlashQLA 0.1.3's ``is_train`` (None or a bool: whether a backward follows, which steers its
    CP decision and cache) likewise; its ``cp_context`` (a context-parallel plan) must be None. No autograd: the
    outputs carry no gradient.
    """
    output_final_state = check_flag("output_final_state", output_final_state)
    output_h = check_flag("output_h", output_h)
    check_flag("auto_cp", auto_cp)
    check_flag("enable_fwd_cp_cache", enable_fwd_cp_cache)
    if is_train is not None:
        check_flag("is_train", is_train)
    _no_cp_context("chunk_gated_delta_rule_fwd", cp_context)
    N, scale, v_first, _ = _common(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if output_h and cu_seqlens is not None and torch.compiler.is_compiling():
        raise ValueError("output_h: with cu_seqlens, h has one row per chunk of the sequences, a count that depends "
                         "on cu_seqlens' values: call chunk_gated_delta_rule_fwd(output_h=True) outside "
                         "torch.compile")
    cu_host = plan_mod.host_bounds(cu_seqlens, T, need=output_h)
    q, k, v, g, beta = (t.detach().contiguous() for t in (q, k, v, g, beta))
    h0 = initial_state.detach().contiguous() if initial_state is not None else None
    with torch.no_grad():
        if torch.compiler.is_compiling():
            o, ht, gc, A, _, h, _ = _fwd_op(q, k, v, g, beta, scale, h0, cu_seqlens, output_h, output_h, v_first,
                                            False, False, None, None, CHUNK, "auto")
        else:
            plan = chunk_plan(q, v, cu_seqlens, cu_host, CHUNK, "auto")
            o, ht, gc, A, _, h, _ = _fwd(q, k, v, g, beta, scale, h0, plan, output_h, output_h, v_first, False,
                                         False)
    if cu_seqlens is not None:  # tokens outside [cu[0], cu[N]) belong to no chunk: their g and A rows are 0, as o's
        cu = cu_seqlens.to(torch.int64).clamp(0, T)  # (the kernels' bounds: clamped, running maximum)
        t = torch.arange(T, device=gc.device)
        pad = ((t < cu[0]) | (t >= cu.max()))[None, :, None]
        gc.masked_fill_(pad, 0.0)
        A.masked_fill_(pad[..., None], 0.0)
    if output_h:
        if cu_host is None:
            h = h[:B * cdiv(T, CHUNK)].view(B, cdiv(T, CHUNK), HV, K, V)
        else:
            h = h[:sum(cdiv(b - a, CHUNK) for a, b in zip(cu_host[:-1], cu_host[1:], strict=True))][None]
        if v_first:
            h = h.transpose(-1, -2).contiguous()
    else:
        h = None
    return gc, A, o, h, (ht if output_final_state else None), None


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                               state_v_first=False, auto_cp=True, cp_cache=None, cp_context=None):
    """FlashQLA's backward: the forward's inputs with g and A as ``chunk_gated_delta_rule_fwd`` returned them (g
    the chunk-local cumulative decay, fp32), do ``[B, T, HV, V]`` the output's gradient (fp32, bf16 or fp16, taken in
    v's dtype, the output's, as autograd takes it), dht the final state's
    (``[N, HV, K, V]``, ``[N, HV, V, K]`` with ``state_v_first``) or None. The chunk states are recomputed.

    Returns ``(dq, dk, dv, db, dg, dh0)``: dq, dk ``[B, T, H, K]`` (summed over each q/k head's value heads), dv,
    db (beta's) as their inputs, dg fp32 the gradient of the raw decay (not of its cumulative sum), dh0 in
    initial_state's dtype and layout, or None without initial_state. ``cp_cache`` must be None (the forward here
    never makes one), and so must FlashQLA 0.1.3's ``cp_context``; ``auto_cp``: a bool, no effect.
    """
    check_flag("auto_cp", auto_cp)
    _no_cp_context("chunk_gated_delta_rule_bwd", cp_context)
    if cp_cache is not None:
        raise ValueError("cp_cache: must be None (chunk_gated_delta_rule_fwd here returns no context-parallel "
                         "cache: the plan splits long sequences without one)")
    N, scale, v_first, row = _common(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    check_tensor("g", g, shape=(B, T, HV), dtypes=(torch.float32,))
    check_tensor("A", A, shape=(B, T, HV, CHUNK), dtypes=(mid_dtype(k.dtype),), device=q.device)
    check_tensor("do", do, shape=(B, T, HV, V), dtypes=(torch.float32, torch.bfloat16, torch.float16),
                 device=q.device)
    if dht is not None:
        check_tensor("dht", dht, shape=(N, *row), dtypes=(torch.float32,), device=q.device)
    why = plan_mod.backward_unsupported(device_info(q), CHUNK, K, q.dtype)
    if why is not None:
        raise ValueError(f"q / k: {why}")
    cu_host = plan_mod.host_bounds(cu_seqlens, T)
    do = do.to(v.dtype)  # the output's dtype, as autograd hands an output its gradient
    q, k, v, g, beta, A, do = (t.detach().contiguous() for t in (q, k, v, g, beta, A, do))
    h0 = initial_state.detach().contiguous() if initial_state is not None else None
    dht = dht.detach().contiguous() if dht is not None else None
    with torch.no_grad():
        if torch.compiler.is_compiling():
            dq, dk, dv, dg, db, dh0, _, _ = _bwd_op(q, k, v, g, beta, scale, h0, cu_seqlens, g, A, do, dht, None, None,
                                                    None, v_first, False, False, None, None, CHUNK)
        else:
            plan = chunk_plan(q, v, cu_seqlens, cu_host, CHUNK, "auto")
            dq, dk, dv, dg, db, dh0, _, _ = _bwd(q, k, v, g, beta, scale, h0, plan, g, A, do, dht, None, None, None,
                                                 v_first, False, False)
    return dq, dk, dv, db, dg, (dh0 if initial_state is not None else None)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                               use_qk_l2norm_in_kernel=False, seqlens=None, head_first=False, head_batch=None):
    """FlashQLA's decode form: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``, a batch of B
    sequences of up to T new tokens each, through the token recurrence (``gated_delta_rule_decode``'s kernel).
    initial_state ``[B, HV, K, V]`` (read, not written; None: zeros); seqlens ``[B]`` int32 / int64 on q's device: row b
    holds ``seqlens[b]`` tokens (clamped to [0, T]; None: all T), the rest are padding with o = 0.

    Returns ``(o [B, T, HV, V] in q's dtype, final_state [B, HV, K, V] fp32 after each row's tokens, or None without
    output_final_state)``. ``head_first`` must be False; ``head_batch`` (FlashQLA's heads per program) is a
    schedule, taken as None or a positive int, with no effect. Forward only: an input requiring grad under
    autograd is a ``RuntimeError`` naming it.
    """
    output_final_state = check_flag("output_final_state", output_final_state)
    if check_flag("head_first", head_first):
        raise ValueError("head_first=True is not supported by recurrent_gated_delta_rule (inputs in the "
                         "head-first [B, H, T, ...] layout); only head_first=False")
    if head_batch is not None:
        if not is_int(head_batch):
            raise TypeError(f"head_batch: expected None or a positive int, got {type(head_batch).__name__} "
                            f"{head_batch!r}")
        if head_batch < 1:
            raise ValueError(f"head_batch: expected None or a positive int, got {head_batch!r}")
    check_tensor("q", q, ndim=4)
    check_tensor("v", v, ndim=4, device=q.device)
    for name, t in (("k", k), ("g", g), ("beta", beta)):
        check_dense(name, t)  # (their shapes and dtypes: the decode step's checks)
    B, T, K = q.shape[0], q.shape[1], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(B, HV, K, V), dtypes=_STATE_DTYPES, device=q.device)
    refuse_grad("recurrent_gated_delta_rule", ", or use chunk_gated_delta_rule to train through the recurrence", q=q,
                k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if initial_state is not None:
        state = initial_state.detach().to(torch.float32, copy=True).contiguous()
    else:
        state = torch.zeros(B, HV, K, V, dtype=torch.float32, device=q.device)
    if seqlens is not None:
        check_tensor("seqlens", seqlens, shape=(B,), dtypes=(torch.int32, torch.int64), device=q.device)
        seqlens = seqlens.clamp(0, T).to(torch.int32)  # the kernel's clamp, before an int64 value could wrap
    rows = torch.arange(B, dtype=torch.int32, device=q.device)
    o = gated_delta_rule_decode(q, k, v, g, beta, state, rows, scale=scale,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, accepted=seqlens)
    if seqlens is not None:
        live = torch.arange(T, device=q.device)[None, :] < seqlens[:, None]
        o = torch.where(live[:, :, None, None], o, 0)
    return o.to(q.dtype), (state if output_final_state else None)
