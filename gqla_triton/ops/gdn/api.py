"""``chunk_gated_delta_rule``: chunked Gated DeltaNet for prefill and training, fla / FlashQLA compatible.

The public function validates its inputs, then either runs the torch reference (``impl="reference"``) or the
Triton stages (``launch.py``): eager calls through ``_ChunkGDN`` (an autograd.Function calling the launchers),
torch.compile through the one custom op pair ``gqla_triton::chunk_gated_delta_rule_fwd`` / ``_bwd`` (with fakes
and ``register_autograd``). Both routes run the same launchers with the same autograd formulas. A call over a
state pool (``state_indices``, inference only) is the custom op ``gqla_triton::chunk_gated_delta_rule_pool``, which
mutates the pool, or its launcher directly when eager.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...dispatch import device_info
from .._common.boundary import route
from .._common.impl import check_impl
from .._common.memo import CheckedCalls, call_key
from .._common.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bools,
    check_contiguous,
    check_disjoint,
    check_flag,
    check_kernel_device,
    check_pool_rows,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    contiguous,
    inference_writes,
)
from . import plan as plan_mod
from .compat import (
    check_chunk_indices,
    check_chunk_size,
    check_fla_options,
    check_gate,
    graph_capture,
    state_v_first,
)
from .launch import States, chunk_gdn_bwd, chunk_gdn_fwd, h_rows, mid_dtype, sout_sm90_unsupported
from .plan import BT, ChunkPlan, backward_unsupported, chunk_plan, host_cu_seqlens
from .reference import L2NORM_EPS, chunk_gated_delta_rule_ref, gate_ref

__all__ = ["chunk_gated_delta_rule"]

_REFERENCE = "gqla_triton.ops.gdn.reference.chunk_gated_delta_rule_ref"
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gate(A_log, dt_bias):
    """The launchers' ``gate`` argument: None without the in-kernel gate (A_log None)."""
    return (A_log, dt_bias) if A_log is not None else None


def _fwd(q, k, v, g, beta, scale, initial_state, plan: ChunkPlan, save_states: bool, needs_grad: bool,
         v_first: bool, beta_sigmoid: bool, neg_eigval: bool, A_log=None, dt_bias=None):
    """chunk_gdn_fwd's outputs with the saved states flattened: (o, ht, gc, Ainv, w, h, vnew); without save_states
    w, h and vnew are three distinct empty tensors (outputs of a custom op may not alias each other).
    ``needs_grad``: a backward may follow; its forward runs the kernels a recomputing backward runs again (no
    ``sout``), so save_states True and False give bitwise-equal results."""
    opt = dict(v_first=v_first, beta_sigmoid=beta_sigmoid, neg_eigval=neg_eigval, gate=_gate(A_log, dt_bias),
               fuse=not needs_grad)
    if not save_states:
        o, ht, gc, Ainv = chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, plan, **opt)
        return o, ht, gc, Ainv, q.new_empty(0), q.new_empty(0), q.new_empty(0)
    o, ht, gc, Ainv, st = chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, plan, keep_h=True, **opt)
    return o, ht, gc, Ainv, *st


def _bwd(q, k, v, g, beta, scale, initial_state, plan: ChunkPlan, gc, Ainv, do, dht, w, h, vnew, v_first,
         beta_sigmoid, neg_eigval, A_log=None, dt_bias=None):
    """chunk_gdn_bwd's gradients, always eight: dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias (the last two distinct
    empty tensors where there is no such parameter)."""
    states = States(w, h, vnew) if w is not None else None
    out = chunk_gdn_bwd(q, k, v, g, beta, scale, initial_state, plan, gc, Ainv, do, dht, states, v_first=v_first,
                        beta_sigmoid=beta_sigmoid, neg_eigval=neg_eigval, gate=_gate(A_log, dt_bias))
    if A_log is None:
        return (*out, q.new_empty(0), q.new_empty(0))
    dA, ddt = out[6], out[7]
    return (*out[:6], dA.to(A_log.dtype), ddt.to(dt_bias.dtype) if dt_bias is not None else q.new_empty(0))


# ----------------------------------------------------------------------------------- torch.library + autograd
@torch.library.custom_op("gqla_triton::chunk_gated_delta_rule_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, save_states: bool,
            needs_grad: bool, v_first: bool, beta_sigmoid: bool, neg_eigval: bool, A_log: torch.Tensor | None,
            dt_bias: torch.Tensor | None, chunk_size: int, impl: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_op_call(q, k, v, g, beta, scale, initial_state, cu_seqlens, None, v_first, beta_sigmoid, neg_eigval, A_log,
                   dt_bias, chunk_size, impl)
    q, k, v, g, beta, initial_state, A_log, dt_bias = contiguous(q, k, v, g, beta, initial_state, A_log, dt_bias)
    return _fwd(q, k, v, g, beta, scale, initial_state,
                chunk_plan(q, v, cu_seqlens, chunk_size=chunk_size, impl=impl), save_states, needs_grad, v_first,
                beta_sigmoid, neg_eigval, A_log, dt_bias)


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states, needs_grad, v_first, beta_sigmoid,
      neg_eigval, A_log, dt_bias, chunk_size, impl):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = (v.new_empty(B, T, HV, V), q.new_empty(N, HV, *((V, K) if v_first else (K, V)), dtype=torch.float32),
           q.new_empty(B, T, HV, dtype=torch.float32), q.new_empty(B, T, HV, chunk_size, dtype=mid_dtype(k.dtype)))
    if not save_states:
        return (*out, q.new_empty(0), q.new_empty(0), q.new_empty(0))
    rows = h_rows(B, T, N, cu_seqlens is not None, chunk_size)
    return (*out, k.new_empty(B, T, HV, K), k.new_empty(rows, HV, K, V), v.new_empty(B, T, HV, V))


@torch.library.custom_op("gqla_triton::chunk_gated_delta_rule_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, gc: torch.Tensor,
            Ainv: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None, w: torch.Tensor | None,
            h: torch.Tensor | None, vnew: torch.Tensor | None, v_first: bool, beta_sigmoid: bool, neg_eigval: bool,
            A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, chunk_size: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor]:
    _check_bwd_op_call(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, w, h, vnew, v_first,
                       beta_sigmoid, neg_eigval, A_log, dt_bias, chunk_size)
    q, k, v, g, beta, initial_state, gc, Ainv, do, dht, w, h, vnew, A_log, dt_bias = contiguous(
        q, k, v, g, beta, initial_state, gc, Ainv, do, dht, w, h, vnew, A_log, dt_bias)
    return _bwd(q, k, v, g, beta, scale, initial_state, chunk_plan(q, v, cu_seqlens, chunk_size=chunk_size), gc,
                Ainv, do, dht, w, h, vnew, v_first, beta_sigmoid, neg_eigval, A_log, dt_bias)


@_bwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, w, h, vnew, v_first, beta_sigmoid,
      neg_eigval, A_log, dt_bias, chunk_size):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dA = A_log.new_empty(A_log.shape) if A_log is not None else q.new_empty(0)
    ddt = dt_bias.new_empty(dt_bias.shape) if A_log is not None and dt_bias is not None else q.new_empty(0)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), q.new_empty(N, HV, *((V, K) if v_first else (K, V)),
                                                dtype=initial_state.dtype if initial_state is not None else torch.float32),
            dA, ddt)


def _save(ctx, q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states, needs_grad, v_first, beta_sigmoid,
          neg_eigval, A_log, dt_bias, chunk_size, output):
    """What both backward routes read: the inputs, gc, Ainv and (with save_states) the forward's states."""
    _, _, gc, Ainv, w, h, vnew = output
    ctx.scale = scale
    ctx.chunk_size = chunk_size
    ctx.opts = (v_first, beta_sigmoid, neg_eigval)
    ctx.has_h0 = initial_state is not None
    ctx.set_materialize_grads(False)  # unused outputs (final state, gc, Ainv, states) pass None, not zero tensors
    states = (w, h, vnew) if save_states else (None, None, None)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, gc, Ainv, *states, A_log, dt_bias)


def _backward_with(bwd, plan, ctx, do, dht):
    """The gradients of the forward's inputs: ``bwd`` is ``_bwd`` (eager, with the forward's ``plan``) or ``_bwd_op``
    (traced; plan None: the op takes the saved cu_seqlens and plans inside itself)."""
    q, k, v, g, beta, initial_state, cu_seqlens, gc, Ainv, w, h, vnew, A_log, dt_bias = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    traced = plan is None  # the op plans inside itself from the saved cu_seqlens and the chunk size
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd(q, k, v, g, beta, ctx.scale, initial_state,
                                              cu_seqlens if traced else plan, gc, Ainv, do, dht, w, h, vnew,
                                              *ctx.opts, A_log, dt_bias, *((ctx.chunk_size,) if traced else ()))
    grads = (dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_h0 else None), None, None, None, None, None, None,
             dA if A_log is not None else None, ddt if dt_bias is not None else None)
    return (*grads, None, None) if traced else grads  # the op's last inputs are the chunk size and impl


def _setup_context(ctx, inputs, output):
    _save(ctx, *inputs[:-1], output)  # the op's last input is impl


def _backward(ctx, do, dht, *_unused):
    # AOT autograd traces this backward on fake tensors (where is_compiling() is False): it stays an opaque op
    return _backward_with(_bwd_op, None, ctx, do, dht)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _ChunkGDN(torch.autograd.Function):
    """Eager route: the launchers and autograd formulas of the custom op, without torch.library's dispatch (tens
    of microseconds per call, which set the pace of small forwards such as G3). The forward's plan is kept for
    the backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, plan, save_states, needs_grad, v_first, beta_sigmoid,
                neg_eigval, A_log, dt_bias):
        out = _fwd(q, k, v, g, beta, scale, initial_state, plan, save_states, needs_grad, v_first, beta_sigmoid,
                   neg_eigval, A_log, dt_bias)
        _save(ctx, q, k, v, g, beta, scale, initial_state, None, save_states, needs_grad, v_first, beta_sigmoid,
              neg_eigval, A_log, dt_bias, plan.BT, out)
        ctx.plan = plan
        ctx.mark_non_differentiable(*out[2:])
        return out

    @staticmethod
    def backward(ctx, do, dht, *_unused):
        if not torch.is_grad_enabled():
            return _backward_with(_bwd, ctx.plan, ctx, do, dht)
        # create_graph=True: the gradients hang off a node of the saved inputs and the output gradients, so a
        # backward toward any of them (``autograd.grad(..., inputs)`` prunes the nodes that lead elsewhere) reaches
        # it and raises
        return _ChunkGDNGrads.apply(ctx, do, dht, *ctx.saved_tensors)


class _ChunkGDNGrads(torch.autograd.Function):
    """``_ChunkGDN``'s gradients under ``create_graph=True``: the backward kernels have no backward, so a double
    backward through them is an error, not a zero."""

    @staticmethod
    def forward(ctx, fwd_ctx, do, dht, *_saved):
        return _backward_with(_bwd, fwd_ctx.plan, fwd_ctx, do, dht)

    @staticmethod
    def backward(ctx, *_grads):
        raise RuntimeError("chunk_gated_delta_rule: trying to differentiate twice (a double backward, e.g. a gradient "
                           "penalty): the backward kernels have no backward; impl='reference' differentiates twice")


def _eager(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states, needs_grad, v_first, beta_sigmoid,
           neg_eigval, A_log, dt_bias, chunk_size, impl, *, cu_host, plan=None):
    """The eager forward: through ``_ChunkGDN`` where a backward may follow, else the launchers themselves (no
    autograd node to build, no placeholder outputs: their cost paces short inference chunks); (o, ht, ...).
    ``plan``: this call's ``chunk_plan`` where the caller has it."""
    if plan is None:
        plan = chunk_plan(q, v, cu_seqlens, cu_host, chunk_size, impl)
    if not needs_grad:
        return chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, plan, v_first=v_first, beta_sigmoid=beta_sigmoid,
                             neg_eigval=neg_eigval, gate=_gate(A_log, dt_bias))
    return _ChunkGDN.apply(q, k, v, g, beta, scale, initial_state, plan, save_states, needs_grad, v_first,
                           beta_sigmoid, neg_eigval, A_log, dt_bias)


# ------------------------------------------------------------------------------------------- state pool (inference)
def _pool(q, k, v, g, beta, scale, state_pool, state_indices, cu_seqlens, v_first, beta_sigmoid, neg_eigval,
          A_log, dt_bias, chunk_size, impl, *, cu_host):
    return chunk_gdn_fwd(q, k, v, g, beta, scale, state_pool, chunk_plan(q, v, cu_seqlens, cu_host, chunk_size, impl),
                         state_indices=state_indices, v_first=v_first, beta_sigmoid=beta_sigmoid,
                         neg_eigval=neg_eigval, gate=_gate(A_log, dt_bias))[0]


@torch.library.custom_op("gqla_triton::chunk_gated_delta_rule_pool", mutates_args=("state_pool",))
def _pool_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
             state_pool: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None,
             v_first: bool, beta_sigmoid: bool, neg_eigval: bool, A_log: torch.Tensor | None,
             dt_bias: torch.Tensor | None, chunk_size: int, impl: str) -> torch.Tensor:
    # the public function cannot read it while tracing
    check_pool_rows("state_indices", state_indices, state_pool.shape[0])
    check_contiguous("state_pool", state_pool)
    check_disjoint("state_pool", state_pool, q=q, k=k, v=v, g=g, beta=beta, state_indices=state_indices,
                   cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    _check_op_call(q, k, v, g, beta, scale, state_pool, cu_seqlens, state_indices, v_first, beta_sigmoid, neg_eigval,
                   A_log, dt_bias, chunk_size, impl)
    q, k, v, g, beta, state_indices, A_log, dt_bias = contiguous(q, k, v, g, beta, state_indices, A_log, dt_bias)
    return _pool(q, k, v, g, beta, scale, state_pool, state_indices, cu_seqlens, v_first, beta_sigmoid, neg_eigval,
                 A_log, dt_bias, chunk_size, impl, cu_host=None)


@_pool_op.register_fake
def _(q, k, v, g, beta, scale, state_pool, state_indices, cu_seqlens, v_first, beta_sigmoid, neg_eigval, A_log,
      dt_bias, chunk_size, impl):
    check_contiguous("state_pool", state_pool)
    return v.new_empty(v.shape)


def _reference_pool(q, k, v, g, beta, scale, state_pool, state_indices, l2, cu_seqlens, cu_host, v_first,
                    chunk_size):
    """The reference over gathered pool rows (zeros for rows outside [0, P)), its final states scattered back."""
    P = state_pool.shape[0]
    live = (state_indices >= 0) & (state_indices < P)
    rows = torch.where(live, state_indices, 0).long()
    h0 = torch.where(live[:, None, None, None], state_pool[rows], 0.0)
    o, ht = _reference(q, k, v, g, beta, scale, h0, True, l2, cu_seqlens, cu_host, v_first, chunk_size)
    with inference_writes(state_pool):
        state_pool[rows[live]] = ht[live].to(state_pool.dtype)
    return o, None


# ------------------------------------------------------------------------------------------------ public op
def _check_gluon(q, k, v, chunk_size: int, grad: bool) -> None:
    """``impl="gluon"``: the Hopper kernel can run this call's forward (contiguous q, k, v), else a ValueError says
    why."""
    if grad:
        raise ValueError("impl='gluon': the Gluon GDN kernel is the forward without gradient, but an input requires "
                         "grad; use impl='auto' or 'triton', or run under torch.no_grad()")
    why = sout_sm90_unsupported(device_info(q), chunk_size, q, k, v)
    if why is not None:
        raise ValueError(f"impl='gluon': the Gluon GDN kernel cannot run here: {why}")


def _check_pool_call(q, k, v, g, beta, pool, state_indices, output_final_state, N, row, params=(),
                     cu_seqlens=None, state_dtypes=_STATE_DTYPES) -> None:
    check_tensor("state_indices", state_indices, shape=(N,), dtypes=INDEX_DTYPES, device=q.device)
    if pool is None:
        raise ValueError("initial_state: state_indices needs the state pool [P, HV, K, V] as initial_state")
    check_tensor("initial_state", pool, shape=(None, *row), dtypes=state_dtypes)
    if pool.shape[0] == 0:
        raise ValueError("initial_state: the state pool has no rows")
    check_contiguous("initial_state", pool)  # the pool's rows are updated in place
    if output_final_state:
        raise ValueError("output_final_state: must be False with state_indices (the final states are written into "
                         "the pool rows)")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, pool, *params)):
        raise ValueError("state_indices: the call over a state pool is inference only, but an input requires grad; "
                         "run it under torch.no_grad() / torch.inference_mode() or detach the inputs")
    check_disjoint("initial_state", pool, q=q, k=k, v=v, g=g, beta=beta, state_indices=state_indices,
                   cu_seqlens=cu_seqlens, **dict(zip(("A_log", "dt_bias"), params, strict=False)))


def _beta_ref(beta: torch.Tensor, sigmoid: bool, neg_eigval: bool) -> torch.Tensor:
    """beta as the recurrence takes it (the kernels' ``_beta_in``), in fp32 or wider."""
    if not (sigmoid or neg_eigval):
        return beta
    b = beta.to(torch.promote_types(beta.dtype, torch.float32))
    b = torch.sigmoid(b) if sigmoid else b
    return 2.0 * b if neg_eigval else b


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens, cu_host, v_first,
               chunk_size):
    cu = torch.tensor(cu_host) if cu_host is not None else cu_seqlens  # the host copy: no second device read
    if v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    o, ht = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state, use_qk_l2norm=l2, cu_seqlens=cu,
                                       chunk_size=chunk_size)
    if ht is not None:  # float32 as the kernels' (float64 where an input is)
        ht = (ht.transpose(-1, -2) if v_first else ht).to(torch.promote_types(ht.dtype, torch.float32)).contiguous()
    return o.to(v.dtype), ht


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, ref: bool = False,
                 no_tokens: bool = False) -> tuple[int, torch.device]:
    """The checks of the chunked op's tensors every entry point shares (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
    g, beta ``[B, T, HV]``, cu_seqlens ``[N+1]`` or None; one device; the head dims the kernels take; float64 too
    with ``ref``, the pure-torch path; T = 0 too with ``no_tokens``, as the custom ops take it); initial_state only
    joins the device check. Returns (N, the device)."""
    dtypes = FLOAT_DTYPES + ((torch.float64,) if ref else ())
    check_tensor("q", q, ndim=4, dtypes=dtypes)
    B, T, H, K = q.shape
    check_tensor("k", k, shape=(B, T, H, K), dtypes=dtypes)
    check_tensor("v", v, shape=(B, T, None, None), dtypes=dtypes)
    HV, V = v.shape[2], v.shape[3]
    check_tensor("g", g, shape=(B, T, HV), dtypes=dtypes)
    check_tensor("beta", beta, shape=(B, T, HV), dtypes=dtypes)
    check_same_dtype(q=q, k=k, v=v)
    dev = check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(f"v: value heads HV={HV} must be a positive multiple of the q/k heads H={H}")
    for name, d, hi in (("K (q/k head dim)", K, 256), ("V (v head dim)", V, 1024)):
        if d <= 0 or d > hi:
            raise ValueError(f"{name}: expected 1 <= {name.split()[0]} <= {hi}, got {d}")
    if T < (0 if no_tokens else 1) or B < 1:
        raise ValueError(f"q: expected B >= 1 and T >= 1, got shape {list(q.shape)}")
    N = B
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen input needs B == 1, got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: expected at least 2 entries [0, ..., T]")
        N = cu_seqlens.numel() - 1
    return N, dev


class _Call(NamedTuple):
    """What validating a call of ``chunk_gated_delta_rule`` derives from its arguments (``_check_call``)."""

    chunk_size: int
    v_first: bool
    l2: bool  # use_qk_l2norm_in_kernel
    output_final_state: bool
    scale: float
    cu_host: list[int] | None
    bt: int  # the kernels' chunk (``plan.kernel_chunk``)


def _check_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                cu_seqlens_cpu, chunk_indices, state_indices, save_states, use_gate_in_kernel, A_log, dt_bias,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, state_layout, chunk_size, impl, fla_options,
                no_tokens: bool = False) -> _Call:
    """Every check of ``chunk_gated_delta_rule``'s arguments (a ``TypeError`` / ``ValueError`` naming the first
    that fails; ``no_tokens``: T = 0 taken, as the custom ops take it); reads no device memory."""
    check_impl(impl, op="chunk_gated_delta_rule", gluon=True)
    check_fla_options("chunk_gated_delta_rule", fla_options)
    chunk_size = check_chunk_size(chunk_size)
    v_first = state_v_first(state_layout, fla_options)
    check_bools(use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval)
    if isinstance(use_qk_l2norm_in_kernel, torch.Tensor):  # fla releases that put cu_seqlens ninth, positionally
        raise TypeError(f"use_qk_l2norm_in_kernel: expected a bool, got a tensor of shape "
                        f"{list(use_qk_l2norm_in_kernel.shape)} (cu_seqlens is the tenth argument here, as in fla: "
                        "pass it by keyword)")
    if isinstance(cu_seqlens, bool):  # fla 0.6 puts use_beta_sigmoid_in_kernel tenth, cu_seqlens thirteenth
        raise TypeError("cu_seqlens: expected a torch.Tensor or None, got a bool (cu_seqlens is the tenth argument "
                        "here, as in FlashQLA; fla 0.6 puts use_beta_sigmoid_in_kernel there: pass options by "
                        "keyword)")
    use_qk_l2norm_in_kernel = check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    output_final_state = check_flag("output_final_state", output_final_state)
    ref = impl == "reference"
    N, dev = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, ref=ref, no_tokens=no_tokens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    check_gate(use_gate_in_kernel, A_log, dt_bias, HV, q, reference=ref)
    row = (HV, V, K) if v_first else (HV, K, V)
    sdt = _STATE_DTYPES + ((torch.float64,) if ref and q.dtype == torch.float64 else ())  # float64 calls only
    if state_indices is not None:
        _check_pool_call(q, k, v, g, beta, initial_state, state_indices, output_final_state, N, row, (A_log, dt_bias),
                         cu_seqlens, sdt)
    elif initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(N, *row), dtypes=sdt)
    scale = check_scale("scale", scale, K ** -0.5)
    if not isinstance(save_states, bool):
        raise TypeError(f"save_states: expected a bool, got {type(save_states).__name__}")
    if impl != "reference":
        check_kernel_device(dev, _REFERENCE, q.dtype, initial_state.dtype if initial_state is not None else None)
    capture = graph_capture(fla_options, T, N, cu_seqlens)
    if cu_seqlens_cpu is not None:
        cu_host = host_cu_seqlens(cu_seqlens_cpu, cu_seqlens, T)
    if cu_seqlens_cpu is None or capture:  # a graph call plans from cu_seqlens itself (replays may change it)
        cu_host = plan_mod.host_bounds(cu_seqlens, T, need=impl == "reference")
    # a graph call's chunk_indices are fla's fixed-capacity metadata (rows past the real chunks): shape [*, 2] only
    check_chunk_indices(chunk_indices, cu_seqlens, None if capture else cu_host, chunk_size)
    bt = plan_mod.kernel_chunk(chunk_size, dev, impl)
    if state_indices is not None and not torch.compiler.is_compiling():
        check_pool_rows("state_indices", state_indices, initial_state.shape[0])
    return _Call(chunk_size, v_first, use_qk_l2norm_in_kernel, output_final_state, scale, cu_host, bt)


# chunk_gated_delta_rule's checked calls (``_common.memo``), each with its ``chunk_plan`` (such calls have no
# cu_seqlens: their plan follows from the key and the config)
_CHECKED = CheckedCalls()


def _call_key(tensors: tuple, flags: tuple, scale, state_layout, chunk_size, impl, extra) -> tuple | None:
    """The memo key of a call (``memo.call_key``), or None (checked every time) for calls whose checks read values
    (cu_seqlens and its host copy, chunk_indices, state_indices: ``extra``; the caller leaves out calls with fla's
    options) and for ``impl`` "gluon" / "reference". ``tensors``: q, k, v, g, beta, initial_state, A_log, dt_bias
    (None where absent)."""
    if any(x is not None for x in extra) or impl not in ("auto", "triton"):
        return None
    return call_key(tensors, (*flags, scale, state_layout, chunk_size, impl))


def _check_op_call(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_indices, v_first, beta_sigmoid,
                   neg_eigval, A_log, dt_bias, chunk_size, impl) -> None:
    """The public function's checks in a forward custom op's body (a direct ``torch.ops`` call reaches it unchecked),
    kept per call as the public function keeps them: the inputs as the op takes them (q and k normalised already,
    the gate in the kernel where ``A_log`` is given, sequences of no tokens taken)."""
    flags = (False, False, True, A_log is not None, beta_sigmoid, neg_eigval, "op")  # (no public call's key: T = 0)
    layout = "vk" if v_first else "kv"
    key = _call_key((q, k, v, g, beta, initial_state, A_log, dt_bias), flags, scale, layout, chunk_size, impl,
                    (cu_seqlens, None, None, state_indices))
    if _CHECKED.get(key) is None:
        _CHECKED.put(key, _check_call(q, k, v, g, beta, scale, initial_state, False, False, cu_seqlens, None, None,
                                      state_indices, True, A_log is not None, A_log, dt_bias, beta_sigmoid,
                                      neg_eigval, layout, chunk_size, impl, {}, no_tokens=True))


def _check_bwd_op_call(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, w, h, vnew, v_first,
                       beta_sigmoid, neg_eigval, A_log, dt_bias, chunk_size) -> None:
    """The backward op's checks in its body (a direct ``torch.ops`` call reaches it unchecked), kept per call as
    ``_check_op_call`` keeps the forward's: the forward's inputs as the forward op checks them, then what the
    forward op returned (gc ``[B, T, HV]`` fp32, Ainv ``[B, T, HV, chunk_size]`` ``mid_dtype``, the saved states
    w, h, vnew all or none, in the forward's shapes and dtypes) and the gradients do (o's shape) and dht (the final
    state's shape, or None)."""
    layout = "vk" if v_first else "kv"
    flags = ("bwd", A_log is not None, beta_sigmoid, neg_eigval)
    key = _call_key((q, k, v, g, beta, initial_state, A_log, dt_bias, gc, Ainv, do, dht, w, h, vnew), flags, scale,
                    layout, chunk_size, "triton", (cu_seqlens,))
    if _CHECKED.get(key) is not None:
        return
    call = _check_call(q, k, v, g, beta, scale, initial_state, False, False, cu_seqlens, None, None, None, True,
                       A_log is not None, A_log, dt_bias, beta_sigmoid, neg_eigval, layout, chunk_size, "triton", {},
                       no_tokens=True)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_tensor("gc", gc, shape=(B, T, HV), dtypes=(torch.float32,))
    check_tensor("Ainv", Ainv, shape=(B, T, HV, chunk_size), dtypes=(mid_dtype(k.dtype),))
    check_tensor("do", do, shape=(B, T, HV, V), dtypes=FLOAT_DTYPES)
    if dht is not None:
        check_tensor("dht", dht, shape=(N, HV, *((V, K) if v_first else (K, V))), dtypes=FLOAT_DTYPES)
    states = (w, h, vnew)
    if any(x is None for x in states) and any(x is not None for x in states):
        raise ValueError("w, h, vnew: the forward's saved states are given all three or none")
    if w is not None:
        check_tensor("w", w, shape=(B, T, HV, K), dtypes=(k.dtype,))
        check_tensor("h", h, shape=(h_rows(B, T, N, cu_seqlens is not None, chunk_size), HV, K, V), dtypes=(k.dtype,))
        check_tensor("vnew", vnew, shape=(B, T, HV, V), dtypes=(v.dtype,))
    check_same_device(q=q, gc=gc, Ainv=Ainv, do=do, dht=dht, w=w, h=h, vnew=vnew)
    _CHECKED.put(key, call)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, cu_seqlens_cpu=None, chunk_indices=None,
                           state_indices=None, save_states=True, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_layout="kv",
                           chunk_size=BT, impl="auto", **fla_options):
    """Chunked gated delta rule (Triton forward + backward), drop-in for fla's / FlashQLA's function.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` with ``HV % H == 0`` (value head i uses q/k head
            ``i // (HV // H)``); all one dtype in (bfloat16, float16, float32; float64 too with
            ``impl="reference"``); any K <= 256, V <= 1024.
        g: ``[B, T, HV]`` log-space decay (<= 0; -inf is a full decay: the state is reset at that token); beta:
            ``[B, T, HV]`` in (0, 1) (logits with ``use_beta_sigmoid_in_kernel``); each float32, bfloat16 or float16
            (float64 too with ``impl="reference"``), independently of q's dtype.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``state_layout="vk"``: ``[N, HV, V, K]``) float32, bfloat16 or float16, or
            None (N = B, or the number of sequences with varlen); read in the kernels as it is, in fp32 arithmetic
            (with fp16 q / k / v their products take the states in fp16: entries past 65504 overflow).
            With ``state_indices`` the state pool ``[P, HV, K, V]`` (``"vk"``: ``[P, HV, V, K]``) in one of those
            dtypes, contiguous; the final states are rounded to its dtype.
        output_final_state: also return the final states ``[N, HV, K, V]`` (``"vk"``: ``[N, HV, V, K]``) float32,
            whatever initial_state's dtype, as fla (float64 for float64 inputs; must be False with
            ``state_indices``: the final states go into the pool).
        use_qk_l2norm_in_kernel: normalise q and k over K first (``x·rsqrt(Σx² + 1e-6)``, differentiable).
        cu_seqlens: ``[N+1]`` int32/int64 cumulative sequence bounds (varlen; then B must be 1), any strides:
            sequence n owns tokens ``[cu[n], cu[n+1])`` (0 tokens allowed); tokens outside ``[cu[0], cu[N])``
            belong to no sequence (padding, as a serving batch padded to a graph's size, or FlashQLA's
            ``cu[N] < T``): their outputs and gradients are 0 and they touch no state. A CPU tensor is checked:
            non-decreasing within ``[0, T]`` (``ValueError``). A GPU tensor is never read on the host: the plan is
            built on the device (one small kernel; no sync, so the call can be captured in a CUDA graph), its
            values clamped to ``[0, T]`` and made non-decreasing (a running maximum), so no value can reach
            outside the inputs.
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (a CPU tensor or a sequence of ints, as fla's
            option of the same name): the plan is built on the host from it (checked: shape, non-decreasing
            within ``[0, T]``; not compared with the device copy, which would need a sync), with the exact chunk
            counts and sequence lengths; index tensors are reused across calls with the same values. The kernels
            then read the plan's own device copy of these bounds, so a call whose two copies differ follows
            ``cu_seqlens_cpu`` (and stays within its tensors).
        chunk_indices: fla's precomputed ``[NT, 2]`` (sequence, chunk) pairs of the varlen input's chunks of
            ``chunk_size`` tokens;
            accepted and unused (the plan comes from ``cu_seqlens``), it must describe the chunks of ``cu_seqlens``
            (``ValueError`` otherwise: its shape is checked against the host values of ``cu_seqlens`` where there
            are any, its values when it is a CPU tensor).
        state_indices: ``[N]`` int32 on the inputs' device, or None. Given, ``initial_state`` is a state pool:
            sequence n starts from pool row ``state_indices[n]`` and its final state is written back into that row
            in place (the kernels read and write the rows through the index; no other row is touched). A negative
            index means a zero initial state and no write. An index ``>= P`` raises ``ValueError`` when
            ``state_indices`` is a CPU tensor, and on a device is treated like a negative one (never accessed);
            likewise a row named twice raises ``ValueError`` on the CPU, and on a device leaves that row's content
            unspecified (memory-safe). Inference only: a ``ValueError`` when any input requires grad under
            autograd. Returns ``(o, None)``.
        save_states: when a gradient is needed, keep the forward's per-chunk states for the backward: w
            ``[B,T,HV,K]``, h ``[chunks, HV, K, V]`` and v_new ``[B,T,HV,V]`` in the input dtype (about 4x v's size
            at K = V; h alone is 2x). False recomputes them in the backward as fla does (the w / u stage and the
            state pass run again). No effect without autograd.
        use_gate_in_kernel: ``g`` holds the raw gate input ``a`` (g's dtypes) and the kernels take the decay
            ``-exp(A_log)·softplus(a + dt_bias)`` (softplus is x itself above 20), as fla's option; the gradient
            of ``g`` is then that of ``a``, and A_log / dt_bias get theirs.
        A_log, dt_bias: ``[HV]`` float32 or q's dtype, on q's device; A_log is required with
            ``use_gate_in_kernel`` (dt_bias None: no bias), both refused without it.
        use_beta_sigmoid_in_kernel: ``beta`` holds logits; the kernels take ``sigmoid(beta)`` (its gradient is the
            logits' gradient), as fla's option.
        allow_neg_eigval: beta doubled (after the sigmoid), so ``I - beta k kᵀ`` may have eigenvalues down to -1.
        state_layout: ``"kv"`` (state rows ``[K, V]``) or ``"vk"`` (``[V, K]``, the decode layout of vLLM / SGLang /
            FlashInfer) for initial_state, the final state, the state pool and the initial state's gradient; fla's
            ``state_v_first=True`` is the same as ``"vk"``; its deprecated name ``transpose_state_layout`` is taken
            as fla takes it (a ``DeprecationWarning``; a ``ValueError`` together with ``state_v_first=True``).
        chunk_size: tokens per chunk, 16, 32 or 64 (fla's choices and default): the kernels' chunk (the same
            function at every size, rounded differently; 64 is the tuned one; the GPU kernels take 16 as 32,
            ``plan.kernel_chunk``). fla's ``chunk_indices`` count chunks of this size.
        impl: ``"auto"``: this GPU's table decides (the H200's runs a forward without gradient of at least 1024
            chunk x value-head units through the Hopper Gluon kernel where it applies, the Triton kernels
            otherwise); ``"triton"``: the portable Triton kernels only; ``"gluon"``: the forward without gradient
            through the Gluon kernel (sm_90, bf16, K 128, V a multiple of 32, chunk_size 64; sequences never split),
            a ``ValueError`` saying why where it cannot, also where an input requires grad; ``"reference"``: the
            torch chunked reference (``chunk_gated_delta_rule_ref``, differentiable, any device).
        **fla_options: fla's / FlashQLA's other keywords, accepted at the value that computes what this function
            computes: ``head_first=False``, ``cp_context=None``; ``state_v_first`` / ``transpose_state_layout``
            (bools, see ``state_layout``); FlashQLA's ``auto_cp``, ``enable_fwd_cp_cache`` and ``force_intra_cp``
            (bools, either value: they schedule FlashQLA's intra-card context parallelism and change no result;
            here the plan splits long sequences by itself, results independent of the split); fla's CUDA-graph
            options ``use_graph``, ``graph_mode`` (``"eager"`` / ``"force_graph"`` / ``"auto"``), ``graph_t_max``,
            ``graph_n_max``, ``graph_nt_max``, ``graph_actual_tokens`` / ``_sequences`` / ``_nt``,
            ``min_graph_utilization`` and ``chunk_offsets`` (``compat.graph_capture``: a graph call plans from
            cu_seqlens on its device, never from ``cu_seqlens_cpu``, so replays may change the lengths; fla's
            fixed-capacity ``chunk_indices`` are taken; no result changes). Any other value of these (head-first
            inputs, context parallelism) is a ``ValueError`` naming the option as unsupported; any other keyword a
            ``TypeError`` naming it.
    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None)``; differentiable in q, k, v, g,
        beta, initial_state, A_log, dt_bias (its gradient in its dtype and layout; with ``state_indices``: ``(o, None)``, not
        differentiable).
        Math: ``S_t = e^(g_t)·S_{t−1}; S_t += beta_t·k_t (v_t − S_tᵀk_t)ᵀ; o_t = scale·S_tᵀq_t``.
    """
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    flags = (use_qk_l2norm_in_kernel, output_final_state, save_states, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval)
    key = None if fla_options else _call_key(tensors, flags, scale, state_layout, chunk_size, impl,
                                             (cu_seqlens, cu_seqlens_cpu, chunk_indices, state_indices))
    call = _CHECKED.get(key)
    if call is None:
        call = _check_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens, cu_seqlens_cpu, chunk_indices, state_indices, save_states, use_gate_in_kernel,
                           A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_layout, chunk_size, impl,
                           fla_options)
        _CHECKED.put(key, call)
    # a float scale is its own checked value (the key holds it: 0.0 and -0.0 share one); another, its conversion
    scale = scale if type(scale) is float else call.scale
    chunk_size, v_first, use_qk_l2norm_in_kernel, output_final_state, _, cu_host, bt = call
    if impl == "reference":
        beta = _beta_ref(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
        if use_gate_in_kernel:
            g = gate_ref(g.to(torch.promote_types(g.dtype, torch.float32)), A_log, dt_bias)
        if state_indices is not None:
            return _reference_pool(q, k, v, g, beta, float(scale), initial_state, state_indices,
                                   use_qk_l2norm_in_kernel, cu_seqlens, cu_host, v_first, bt)
        return _reference(q, k, v, g, beta, float(scale), initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens, cu_host, v_first, bt)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q, k, v, g, beta = contiguous(q, k, v, g, beta)
    if use_gate_in_kernel:
        A_log, dt_bias = contiguous(A_log, dt_bias)
    h0 = contiguous(initial_state)[0] if initial_state is not None and state_indices is None else None
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, h0, A_log, dt_bias))
    if impl == "gluon":
        _check_gluon(q, k, v, chunk_size, grad)
    if grad and impl != "reference":
        why = backward_unsupported(device_info(q), bt, q.shape[3], q.dtype)
        if why is not None:
            raise ValueError(f"q / k: {why}")
    if state_indices is not None:  # inference only (_check_pool_call): grad is False
        run = route(_pool_op, functools.partial(_pool, cu_host=cu_host))
        return run(q, k, v, g, beta, float(scale), initial_state, state_indices.contiguous(), cu_seqlens,
                   v_first, use_beta_sigmoid_in_kernel, allow_neg_eigval, A_log, dt_bias, bt, impl), None
    plan = None
    if key is not None:  # (no key while torch.compile traces; a split plan's segment tensors are not kept: they
        # arrived on the current stream)
        plan = _CHECKED.plan(key, lambda: chunk_plan(q, v, None, None, bt, impl), keep=lambda p: p.seg is None)
    fwd = route(_fwd_op, functools.partial(_eager, cu_host=cu_host, plan=plan))
    o, ht, *_ = fwd(q, k, v, g, beta, float(scale), h0, cu_seqlens, save_states and grad, grad, v_first,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, A_log, dt_bias, bt, impl)
    return o, (ht if output_final_state else None)
