"""fla's ``fused_recurrent_gated_delta_rule``: the token-by-token gated delta rule with fla's signature and results
(``(o, final_state)``, initial states read, never written), run by the decode step's kernel over a state pool of
its own. What Hugging Face's Qwen3-Next layer calls for its recurrent (decode) path when fla is installed."""

from __future__ import annotations

import torch

from .._common.validation import FLOAT_DTYPES, check_flag, check_tensor
from .compat import check_fla_options
from .compat import state_v_first as layout_v_first
from .decode import gated_delta_rule_decode

__all__ = ["fused_recurrent_gated_delta_rule"]


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    **fla_options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token, as fla's function of this name. Forward only (as fla's).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV a multiple of H); with ``cu_seqlens``, ``B == 1`` and the
            ``T`` tokens hold ``N`` sequences packed in order.
        g: ``[B, T, HV]`` log-space decay, or None (no decay); with ``use_gate_in_kernel`` the raw gate input
            (required then), the kernel forming ``-exp(A_log)·softplus(g + dt_bias)``.
        gk, gv: fla's per-key / per-value decays ``[B, T, HV, K]`` / ``[B, T, HV, V]`` (log space) or None: with g
            they scale the state before each update, ``S = exp(g)·diag(exp(gk))·S·diag(exp(gv))``.
        beta: ``[B, T, HV]``, or fla's per-value beta ``[B, T, HV, V]``, or None (all ones).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) in fp32, bf16 or fp16 (float64
            too with the reference), or None (zeros); read, not written.
        output_final_state: return the final states ``[N, HV, K, V]`` (or ``[N, HV, V, K]``) in fp32 (float64 with
            the reference on float64 inputs).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval:
            as ``gated_delta_rule_decode``.
        state_v_first: V-first state rows. fla's deprecated name ``transpose_state_layout`` is taken too, as fla
            takes it: a ``DeprecationWarning``, and a ``ValueError`` together with ``state_v_first=True``.
        cu_seqlens: ``[N+1]`` int32 / int64 sequence bounds (see ``gated_delta_rule_decode``).
        impl: ``"auto"`` / ``"triton"`` (the decode kernel) or ``"reference"`` (the torch recurrence).
        **fla_options: ``head_first=False``, ``transpose_state_layout`` (a bool); another value is a
            ``ValueError``, another keyword a ``TypeError``.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state fp32 or None)``. Inputs may require grad: the outputs then
        carry a backward that raises (fla has none either); ``chunk_gated_delta_rule`` is the differentiable form.
    """
    check_fla_options("fused_recurrent_gated_delta_rule", fla_options)
    for name, flag in (("state_v_first", state_v_first), ("use_gate_in_kernel", use_gate_in_kernel)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    v_first = layout_v_first("kv", {**fla_options, "state_v_first": state_v_first})
    output_final_state = check_flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    ref = impl == "reference"
    fdt = FLOAT_DTYPES + ((torch.float64,) if ref else ())
    check_tensor("q", q, ndim=4, dtypes=fdt)
    check_tensor("v", v, ndim=4, dtypes=fdt, device=q.device)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if g is None:
        if use_gate_in_kernel:
            raise ValueError("g: required with use_gate_in_kernel=True (the raw gate input)")
        g = torch.zeros(B, T, HV, dtype=torch.float32, device=q.device)
    if beta is None:
        beta = torch.ones(B, T, HV, dtype=q.dtype, device=q.device)
    N = B
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, device=q.device)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected [N+1] with N >= 1, got shape {list(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
    rows = (N, HV, V, K) if v_first else (N, HV, K, V)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=rows, dtypes=fdt, device=q.device)
    pool_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # float64: the reference only
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
              state_layout="vk" if v_first else "kv", impl=impl)
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, gk, gv)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args):
        o, final = _ForwardOnly.apply(rows, pool_dtype, kw, *args)
    else:
        o, final = _recur(rows, pool_dtype, kw, *args)
    return o, (final if output_final_state else None)


def _recur(rows, pool_dtype, kw, q, k, v, g, beta, initial_state, A_log, dt_bias, gk, gv):
    """Run the decode step over a new pool of ``rows`` holding the initial states (zeros without them): returns
    ``(o, the pool of final states)``."""
    if initial_state is None:
        pool = torch.zeros(rows, dtype=pool_dtype, device=q.device)
    else:
        pool = initial_state.detach().to(pool_dtype, memory_format=torch.contiguous_format, copy=True)
    o = gated_delta_rule_decode(q, k, v, g, beta, pool, gk=gk, gv=gv, **kw)
    return o, pool


class _ForwardOnly(torch.autograd.Function):
    """The recurrence for inputs that require grad: computed without a graph, its outputs' backward raises."""

    @staticmethod
    def forward(ctx, rows, pool_dtype, kw, q, k, v, g, beta, initial_state, A_log, dt_bias, gk, gv):
        return _recur(rows, pool_dtype, kw, q, k, v, g, beta, initial_state, A_log, dt_bias, gk, gv)

    @staticmethod
    def backward(ctx, do, dfinal):
        # NotImplementedError (a RuntimeError), the type fla's backward raises
        raise NotImplementedError("fused_recurrent_gated_delta_rule is forward-only (as fla's): no gradient is "
                                  "defined; chunk_gated_delta_rule computes the same function with gradients")
