"""fla's in-kernel options in the backward: beta as the recurrence takes it, and the chain rule of the beta transform
and of the gate, one elementwise pass over the ``[rows, HV]`` arrays on each side of ``wy_bwd``, then the
gate parameters' gradients as fixed-order sums of that pass's block partials (one launch for both).

``wy_bwd`` runs at the register limit on sm_90: the sigmoid and the gate derivative inside it cost it 4-7 % (G1 on
the H200), while these passes read and write a few bytes per token and head. So the backward's chunk kernels run
their plain specialisation on beta as taken and on dL/dg; the forward takes the options inside ``wy`` and ``wu``
(there, storing beta as taken for ``wu`` cost ``wy`` more than the sigmoid costs ``wu``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _beta_in, _dbeta_out, _gate_in, _gate_par


@triton.jit
def gdn_beta_in_kernel(beta, bt, n, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, BLOCK: tl.constexpr):
    """bt = beta as taken (``_beta_in``; fp32) for the n elements of beta."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b = _beta_in(tl.load(beta + o, mask=m, other=0.0).to(tl.float32), m, BETA_SIGMOID, NEG_EIGVAL)
    tl.store(bt + o, b, mask=m)


@triton.jit
def gdn_options_bwd_kernel(beta, dbt, dbeta, a, dgl, dg, a_log, dt_bias, part, cu, R, HV, N, BETA: tl.constexpr,
                           BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, GATE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, PADDING: tl.constexpr = False):
    """One block of BR rows of the ``[R, HV]`` arrays. BETA: dbeta (beta's dtype) = the gradient of the loaded
    beta from dbt = dL/d(beta as taken) (fp32). GATE: dg (the raw gate input's dtype) = dgl · dg/da with dgl = dL/dg
    (fp32), a the raw gate input; part ``[2, HV, programs]`` fp32 gets this block's sums of dL/dA_log (dg/dA_log = g)
    and of dL/ddt_bias (= dL/da), summed in a fixed order. PADDING (a varlen plan whose tokens may lie outside every
    sequence, bounds cu ``[N+1]``): rows outside [cu[0], cu[N]) belong to no sequence: their gradients are 0,
    whatever their inputs, and they add nothing to the sums."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BR + tl.arange(0, BR)
    h = tl.arange(0, BH)
    m = (r[:, None] < R) & (h[None, :] < HV)
    lv = m
    if PADDING:
        lv = m & ((r >= tl.load(cu)) & (r < tl.load(cu + N)))[:, None]
    o = r[:, None] * HV + h[None, :]
    if BETA:
        b = _beta_in(tl.load(beta + o, mask=lv, other=0.0).to(tl.float32), lv, BETA_SIGMOID, NEG_EIGVAL)
        db = _dbeta_out(tl.load(dbt + o, mask=lv, other=0.0), b, BETA_SIGMOID, NEG_EIGVAL)
        tl.store(dbeta + o, tl.where(lv, db, 0.0).to(dbeta.dtype.element_ty), mask=m)
    if GATE:
        na, bias = _gate_par(a_log, dt_bias, h, HAS_BIAS, h < HV)
        gv, dgda = _gate_in(tl.load(a + o, mask=lv, other=0.0).to(tl.float32), na[None, :], bias[None, :])
        rev = tl.load(dgl + o, mask=lv, other=0.0)
        da = tl.where(lv, rev * dgda, 0.0)
        tl.store(dg + o, da.to(dg.dtype.element_ty), mask=m)
        np_ = tl.num_programs(0)
        h64 = h.to(tl.int64)  # part holds 2·HV·programs entries: past 2**31 with many heads and tokens
        tl.store(part + h64 * np_ + pid, tl.sum(tl.where(lv, rev * gv, 0.0), 0), mask=h < HV)
        tl.store(part + (HV + h64) * np_ + pid, tl.sum(da, 0), mask=h < HV)


@triton.jit
def gdn_options_sum_kernel(part, da_log, ddt_bias, HV, NP, BLOCK: tl.constexpr):
    """dL/dA_log (program axis 1 = 0) or dL/ddt_bias (= 1) of value head ``program_id(0)``: the sum of the ``NP``
    block partials ``part [2, HV, NP]`` fp32 in a fixed order (blocks of BLOCK, then their running sum), fp32."""
    h = tl.program_id(0)
    which = tl.program_id(1)
    row = part + (which * HV + h).to(tl.int64) * NP
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, NP, BLOCK):
        o = i + tl.arange(0, BLOCK)
        acc += tl.load(row + o, mask=o < NP, other=0.0)
    total = tl.sum(acc, 0)
    if which == 0:
        tl.store(da_log + h, total)
    else:
        tl.store(ddt_bias + h, total)
