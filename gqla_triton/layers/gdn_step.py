"""Fused pieces of a ``GatedDeltaNet`` decode step, around ``gated_delta_rule_decode``.

``gdn_decode_prep``: one kernel from the fused input projection ``mixed [B, T, D]`` (columns
``[q | k | v | z | b | a]``) and the conv rows of the sequences' slots to the inputs of the decode op: the causal
depthwise conv + SiLU of ``[q; k; v]`` (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, contiguous: the layout the decode
op reads), the gates ``g = -exp(A_log)·softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (fp32), the pool row of
each sequence (negative = skipped) and, unless a verify step, the conv rows and lengths advanced in place.

``gdn_gated_norm``: one kernel for the output gate ``RMSNorm(o)·weight·silu(z)`` per value head (fp32), z read in
place from ``mixed`` (any strides), written ``[B, T, HV·V]`` (the layout ``o_proj`` reads), zero for skipped
sequences.

Each runs its Triton kernel directly when eager (CUDA, or the CPU interpreter) and through a ``torch.library``
custom op (with a fake) under torch.compile. ``gdn_decode_prep_ref`` / ``gdn_gated_norm_ref`` are the torch
references (any device and dtype, float64 included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..ops._common.alloc import empty
from ..ops._common.boundary import route
from ..ops._common.host import MAX_GRID_Y, cdiv, next_pow2, on_device
from ..ops._common.memo import CheckedCalls, call_key
from ..ops._common.validation import (
    FLOAT_DTYPES,
    INT32_MAX,
    check_contiguous,
    check_disjoint,
    check_eps,
    check_int_in,
    check_kernel_device,
    check_positive_int,
    check_same_device,
    check_tensor,
    contiguous,
    forward_only,
    refuse_grad,
    requires_grad,
)
from ..ops.gdn.kernels.common import _softplus
from .norm import gated_rms_norm

__all__ = ["gdn_decode_prep", "gdn_decode_prep_ref", "gdn_gated_norm", "gdn_gated_norm_ref"]

_PREP_REF = "gqla_triton.layers.gdn_step.gdn_decode_prep_ref"
_NORM_REF = "gqla_triton.layers.gdn_step.gdn_gated_norm_ref"
_CHECKED = CheckedCalls()  # the custom ops' checked calls (``_common.memo``)


# ------------------------------------------------------------------------------------------------ decode prep
@triton.jit(do_not_specialize=["num_slots"])
def gdn_decode_prep_kernel(
    x, conv_w, pool, lens, slots, a_log, dt_bias,
    q, k, v, g, beta, rows,
    T, num_slots, s_xb, s_xt, s_xc,
    KD: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, W: tl.constexpr,
    BC: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr, UPDATE: tl.constexpr,
):
    # one program per (sequence, BC-wide channel block), and one more per sequence (the last along axis 1) for its
    # gates, its pool row and its length, in parallel with the conv. Stream of a channel: [its window (W-1
    # entries), token 0, ..., token T-1].
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    C = 2 * KD + VD
    W1 = W - 1

    slot = tl.load(slots + i_b).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    row = tl.where(live, slot, 0)  # a skipped sequence reads no window (zeros) and writes none

    if i_c == tl.num_programs(1) - 1:
        tl.store(rows + i_b, tl.where(live, slot, -1).to(tl.int32))
        if UPDATE:
            n = tl.load(lens + row, mask=live, other=0)
            tl.store(lens + row, tl.minimum(n.to(tl.int64) + T, 2147483647).to(tl.int32), mask=live)  # saturates
        o_h = tl.arange(0, BH)
        m_h = o_h < HV
        neg_a = -tl.exp(tl.load(a_log + o_h, mask=m_h, other=0.0).to(tl.float32))
        dtb = tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)
        pt = x + i_b * s_xb + (2 * KD + 2 * VD + o_h).to(tl.int64) * s_xc  # b's channels
        pa = x + i_b * s_xb + (2 * KD + 2 * VD + HV + o_h).to(tl.int64) * s_xc  # a's
        for t in range(T):
            tok = i_b * T + t
            b_raw = tl.load(pt, mask=m_h, other=0.0).to(tl.float32)
            a_raw = tl.load(pa, mask=m_h, other=0.0).to(tl.float32)
            tl.store(beta + tok * HV + o_h, tl.sigmoid(b_raw), mask=m_h)
            tl.store(g + tok * HV + o_h, neg_a * _softplus(a_raw + dtb), mask=m_h)
            pt += s_xt
            pa += s_xt
    else:
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        m_live = o_c < tl.where(live, C, 0)  # m_c for a live sequence, else nothing
        o_c64 = o_c.to(tl.int64)
        p_win = pool + row * (C * W1) + o_c64 * W1
        p_x = x + i_b * s_xb + o_c64 * s_xc
        is_q = o_c < KD
        is_k = (o_c >= KD) & (o_c < 2 * KD)
        is_v = (o_c >= 2 * KD) & m_c
        off_qk = tl.where(is_q, o_c, o_c - KD)
        off_v = o_c - 2 * KD

        zero_c = tl.zeros([BC], dtype=tl.int32)
        p_xt = p_x  # token t's inputs
        for t in range(T):
            acc = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(W):
                # tap j reads stream position t + j: window entry t + j, or token t + j - (W-1)
                pos = zero_c + (t + j)
                wj = tl.load(conv_w + o_c64 * W + j, mask=m_c, other=0.0).to(tl.float32)
                xw = tl.load(p_win + tl.minimum(pos, W1 - 1), mask=m_live & (pos < W1), other=0.0).to(tl.float32)
                back = tl.full([], j - W1, tl.int64) * s_xt  # (W - 1 - j) tokens back, in int64: any strides
                xt = tl.load(p_xt + back, mask=m_c & (pos >= W1), other=0.0).to(tl.float32)
                acc += wj * (xw + xt)  # one of xw, xt is the masked 0
            y = acc.to(x.dtype.element_ty).to(tl.float32)  # the conv output in the input dtype, as the torch path
            y = (y / (1.0 + tl.exp(-y))).to(q.dtype.element_ty)
            tok = i_b * T + t
            tl.store(q + tok * KD + off_qk, y, mask=is_q)
            tl.store(k + tok * KD + off_qk, y, mask=is_k)
            tl.store(v + tok * VD + off_v, y, mask=is_v)
            p_xt += s_xt

        if UPDATE:
            # the window after the step: stream positions T .. T+W-2
            o_w = tl.arange(0, BW)
            pos = T + o_w
            in_win = pos < W1
            m2 = m_live[:, None] & (o_w < W1)[None, :]
            nw = tl.load(p_win[:, None] + tl.where(in_win, pos, 0)[None, :], mask=m2 & in_win[None, :], other=0.0)
            nx = tl.load(p_x[:, None] + (tl.where(in_win, 0, pos - W1).to(tl.int64) * s_xt)[None, :],
                         mask=m2 & (pos >= W1)[None, :], other=0.0)
            new = tl.where(in_win[None, :], nw, nx)
            tl.debug_barrier()  # every read of the window (by any thread of the program) precedes its overwrite
            tl.store(p_win[:, None] + o_w[None, :], new, mask=m2)


def _prep_shapes(mixed, H, K, HV, V):
    B, T = mixed.shape[:2]
    return (B, T, H, K), (B, T, HV, V), (B, T, HV)


def _prep_grid(B: int, C: int) -> tuple[tuple[int, int], int]:
    """The prep kernel's ``(grid, BC)`` for ``B`` sequences of ``C`` conv channels: the sequences along axis 0
    (CUDA takes up to 2**31 - 1 there), the BC-wide channel blocks and the gates' program along axis 1."""
    BC = min(512, max(16, next_pow2(C)))
    return (B, cdiv(C, BC) + 1), BC


def _prep_launch(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots: int, num_heads: int,
                 head_k_dim: int, num_v_heads: int, head_v_dim: int, update: bool):
    qk_shape, v_shape, g_shape = _prep_shapes(mixed, num_heads, head_k_dim, num_v_heads, head_v_dim)
    B, T = qk_shape[:2]
    dev = mixed.device
    q = empty(qk_shape, dtype=mixed.dtype, device=dev)
    k = empty(qk_shape, dtype=mixed.dtype, device=dev)
    v = empty(v_shape, dtype=mixed.dtype, device=dev)
    g = empty(g_shape, dtype=torch.float32, device=dev)
    beta = empty(g_shape, dtype=torch.float32, device=dev)
    rows = empty(B, dtype=torch.int32, device=dev)
    KD, VD = num_heads * head_k_dim, num_v_heads * head_v_dim
    C = 2 * KD + VD
    W = conv_weight.shape[-1]
    grid, BC = _prep_grid(B, C)
    with on_device(mixed.device):
        gdn_decode_prep_kernel[grid](
            mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias,
            q, k, v, g, beta, rows,
            T, num_slots, mixed.stride(0), mixed.stride(1), mixed.stride(2),
            KD=KD, VD=VD, HV=num_v_heads, W=W, BC=BC, BW=next_pow2(W - 1), BH=next_pow2(num_v_heads),
            UPDATE=bool(update), num_warps=max(1, min(4, BC // 128)),
        )
    return q, k, v, g, beta, rows


@torch.library.custom_op("gqla_triton::gdn_decode_prep", mutates_args=("conv_state", "seqlens"))
def _prep_op(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, seqlens: torch.Tensor,
             slots: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_slots: int, num_heads: int,
             head_k_dim: int, num_v_heads: int, head_v_dim: int, update: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # a direct torch.ops call reaches here unchecked: the public function's checks (kept per call), after what they
    # read every call (addresses)
    _check_written(conv_state, seqlens)
    check_disjoint("conv_state", conv_state, seqlens=seqlens, mixed=mixed, slots=slots, conv_weight=conv_weight,
                   A_log=A_log, dt_bias=dt_bias)
    check_disjoint("seqlens", seqlens, mixed=mixed, slots=slots, conv_weight=conv_weight, A_log=A_log,
                   dt_bias=dt_bias)
    key = None if slots.device.type == "cpu" else call_key(  # (a CPU slots' values are read: checked every call)
        (mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias),
        ("prep", num_slots, num_heads, head_k_dim, num_v_heads, head_v_dim, update))
    if _CHECKED.get(key) is None:
        _CHECKED.put(key, _check_prep_call(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots,
                                           num_heads, head_k_dim, num_v_heads, head_v_dim, update, no_tokens=True))
    conv_weight, slots, A_log, dt_bias = contiguous(conv_weight, slots, A_log, dt_bias)
    return _prep_launch(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots, num_heads,
                        head_k_dim, num_v_heads, head_v_dim, update)


def _check_written(conv_state: torch.Tensor, seqlens: torch.Tensor) -> None:
    """What the prep op writes in place is contiguous (the kernel writes it without strides)."""
    check_contiguous("conv_state", conv_state)
    check_contiguous("seqlens", seqlens, aligned=False)  # int32 lengths, one per slot


@_prep_op.register_fake
def _(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots, num_heads, head_k_dim, num_v_heads,
      head_v_dim, update):
    _check_written(conv_state, seqlens)
    qk_shape, v_shape, g_shape = _prep_shapes(mixed, num_heads, head_k_dim, num_v_heads, head_v_dim)
    return (mixed.new_empty(qk_shape), mixed.new_empty(qk_shape), mixed.new_empty(v_shape),
            mixed.new_empty(g_shape, dtype=torch.float32), mixed.new_empty(g_shape, dtype=torch.float32),
            mixed.new_empty(qk_shape[0], dtype=torch.int32))


def _check_prep(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots, H, K, HV, V, ref,
                no_tokens: bool = False):
    """Validation shared by the kernel and the reference; returns ``(num_slots, H, K, HV, V)`` as ints.
    ``no_tokens``: T = 0 taken too, as the custom op takes it."""
    H, K, HV, V = (check_positive_int(name, val) for name, val in
                   (("num_heads", H), ("head_k_dim", K), ("num_v_heads", HV), ("head_v_dim", V)))
    fdt = FLOAT_DTYPES + ((torch.float64,) if ref else ())
    KD, VD = H * K, HV * V
    C = 2 * KD + VD
    check_tensor("mixed", mixed, ndim=3, dtypes=fdt)
    B, T, D = mixed.shape
    if not (1 <= B <= INT32_MAX and T >= (0 if no_tokens else 1)):
        raise ValueError(f"mixed: expected 1 <= B <= {INT32_MAX} and T >= 1, got {list(mixed.shape)}")
    blocks = _prep_grid(B, C)[0][1]
    if not ref and blocks > MAX_GRID_Y:
        raise ValueError(f"num_heads, head_k_dim, num_v_heads, head_v_dim: {C} conv channels (2·H·K + HV·V) take "
                         f"{blocks} programs per sequence, more than a grid axis holds ({MAX_GRID_Y})")
    if D != C + VD + 2 * HV:
        raise ValueError(f"mixed: expected [B, T, {C + VD + 2 * HV}] (q, k, v, z, b, a: 2·{KD} + 2·{VD} + 2·{HV}), "
                         f"got {list(mixed.shape)}")
    check_same_device(mixed=mixed, conv_weight=conv_weight, conv_state=conv_state, seqlens=seqlens, slots=slots,
                      A_log=A_log, dt_bias=dt_bias)
    check_tensor("conv_weight", conv_weight, ndim=3, dtypes=fdt)
    W = conv_weight.shape[-1]
    if conv_weight.shape[:2] != (C, 1) or W < 2:
        raise ValueError(f"conv_weight: expected [{C}, 1, W] with W >= 2, got {list(conv_weight.shape)}")
    check_tensor("conv_state", conv_state, shape=(None, C, W - 1), dtypes=(mixed.dtype,))
    P = conv_state.shape[0]
    check_tensor("seqlens", seqlens, shape=(P,), dtypes=(torch.int32,))
    check_tensor("slots", slots, shape=(B,), dtypes=(torch.int32,))
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(name, t, shape=(HV,), dtypes=fdt)
    check_contiguous("conv_state", conv_state)  # written in place without strides
    check_contiguous("seqlens", seqlens, aligned=False)  # int32 lengths, one per slot
    reads = dict(mixed=mixed, slots=slots, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias)
    check_disjoint("conv_state", conv_state, seqlens=seqlens, **reads)
    check_disjoint("seqlens", seqlens, **reads)
    if num_slots is None:
        num_slots = P
    num_slots = check_int_in("num_slots", num_slots, 0, P)
    if slots.device.type == "cpu" and not torch.compiler.is_compiling():  # read only where it costs no sync
        live = slots[(slots >= 0) & (slots < num_slots)]
        if live.unique().numel() != live.numel():  # two sequences would update one row in place
            raise ValueError(f"slots: a slot is named by more than one sequence in {slots.tolist()}")
    return num_slots, H, K, HV, V


def _check_prep_call(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots, H, K, HV, V, update,
                     no_tokens: bool = False):
    """Every check of ``gdn_decode_prep``'s arguments (the public function's and its custom op's); returns
    ``(num_slots, H, K, HV, V)`` as ints."""
    checked = _check_prep(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots, H, K, HV, V,
                          ref=False, no_tokens=no_tokens)
    if not isinstance(update, bool):
        raise TypeError(f"update: expected a bool, got {type(update).__name__}")
    for dt in (mixed.dtype, conv_weight.dtype, A_log.dtype, dt_bias.dtype):
        check_kernel_device(mixed.device, _PREP_REF, dt)
    refuse_grad("gdn_decode_prep", mixed=mixed, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias)
    return checked


def gdn_decode_prep(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, seqlens: torch.Tensor,
                    slots: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, num_heads: int,
                    head_k_dim: int, num_v_heads: int, head_v_dim: int, num_slots: int | None = None,
                    update: bool = True):
    """The decode op's inputs for ``T`` new tokens of each of ``B`` sequences, in one kernel.

    Args:
        mixed: ``[B, T, 2·H·K + 2·HV·V + 2·HV]`` (B <= 2**31 - 1) bf16 / fp16 / fp32, any strides: the fused input
            projection, columns ``[q (H·K) | k (H·K) | v (HV·V) | z (HV·V) | b (HV) | a (HV)]``.
        conv_weight: ``[C, 1, W]`` (``C = 2·H·K + HV·V``; W >= 2), any of those dtypes and strides.
        conv_state: ``[P, C, W-1]`` contiguous, mixed's dtype: the pool of conv windows (the last ``W-1`` pre-conv
            inputs of each slot, oldest first).
        seqlens: ``[P]`` int32 contiguous: tokens per slot.
        slots: ``[B]`` int32: each sequence's slot. Never read on the host: an entry outside ``[0, num_slots)``
            (negative, or any larger value) skips that sequence: its conv starts from a zero window and no row of
            ``conv_state`` / ``seqlens`` is read or written for it; every pool access is at a row inside
            ``[0, num_slots)``. Live entries must be distinct: a CPU tensor with a repeated one is a ``ValueError``;
            on a device (not read: no sync) a repeated one stays memory-safe, its rows' contents unspecified.
        A_log, dt_bias: ``[HV]``, any of those dtypes.
        num_slots: rows of the pool that are slots (default ``P``; at most ``P``).
        update: advance each live sequence's window by its ``T`` tokens and its length by ``T`` (in place);
            False (a verify step) leaves both as they are.

    ``conv_state`` and ``seqlens`` share no memory with each other or with the other arguments (``ValueError``).

    Returns ``(q, k, v, g, beta, rows)``: q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` contiguous in mixed's dtype
    (``silu(conv)``, the conv rounded to mixed's dtype first, as the torch path); g, beta ``[B, T, HV]`` fp32;
    rows ``[B]`` int32: the slot, or -1 for a skipped sequence (the decode op's ``state_indices``).
    """
    num_slots, num_heads, head_k_dim, num_v_heads, head_v_dim = _check_prep_call(
        mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots, num_heads, head_k_dim, num_v_heads,
        head_v_dim, update)
    step = route(_prep_op, _prep_launch)
    return step(mixed, conv_weight.contiguous(), conv_state, seqlens, slots.contiguous(), A_log.contiguous(),
                dt_bias.contiguous(), num_slots, num_heads, head_k_dim, num_v_heads, head_v_dim, update)


def add_token_counts(lens: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
    """``lens[rows] += counts`` for int32 token counts, saturating at 2^31 − 1 as the prep kernel does; ``rows``
    are distinct but for a scratch row, whose count nothing reads."""
    lens.index_add_(0, rows, torch.minimum(counts.long(), 2**31 - 1 - lens[rows].long()).to(torch.int32))


def gdn_decode_prep_ref(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                        seqlens: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                        num_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                        num_slots: int | None = None, update: bool = True):
    """``gdn_decode_prep`` in torch ops, as the layer's torch path computes it: the conv in at least float32,
    rounded to mixed's dtype, SiLU in that dtype; the gates in float32 (float64 for float64 inputs). Same
    arguments (float64 allowed), results and in-place updates; reads ``slots`` on the host."""
    num_slots, H, K, HV, V = _check_prep(mixed, conv_weight, conv_state, seqlens, slots, A_log, dt_bias, num_slots,
                                         num_heads, head_k_dim, num_v_heads, head_v_dim, ref=True)
    B, T, _ = mixed.shape
    KD, VD = H * K, HV * V
    C, W = 2 * KD + VD, conv_weight.shape[-1]
    s = slots.long()
    live = (s >= 0) & (s < num_slots)
    old = conv_state.new_zeros(B, *conv_state.shape[1:])  # a skipped sequence's window (an empty pool: all)
    old[live] = conv_state[s[live]]
    stream = torch.cat([old.transpose(1, 2), mixed[..., :C]], 1)  # [B, W-1+T, C]
    cdt = torch.promote_types(mixed.dtype, torch.float32)
    wc = conv_weight[:, 0].t().to(cdt)  # [W, C]
    y = stream[:, 0:T].to(cdt) * wc[0]
    for j in range(1, W):
        y = y + stream[:, j:j + T].to(cdt) * wc[j]
    y = F.silu(y.to(mixed.dtype))
    q = y[..., :KD].reshape(B, T, H, K).contiguous()
    k = y[..., KD:2 * KD].reshape(B, T, H, K).contiguous()
    v = y[..., 2 * KD:].reshape(B, T, HV, V).contiguous()
    gdt = torch.float64 if mixed.dtype == torch.float64 else torch.float32
    b = mixed[..., C + VD:C + VD + HV].to(gdt)
    a = mixed[..., C + VD + HV:].to(gdt)
    beta = torch.sigmoid(b)
    g = -torch.exp(A_log.to(gdt)) * F.softplus(a + dt_bias.to(gdt))
    rows = torch.where(live, s, -1).to(torch.int32)
    if update:
        idx = s[live]
        conv_state[idx] = stream[:, T:].transpose(1, 2)[live].to(conv_state.dtype)
        add_token_counts(seqlens, idx, torch.full_like(idx, T))
    return q, k, v, g, beta, rows


# ------------------------------------------------------------------------------------------------ gated norm
@triton.jit
def gdn_gated_norm_kernel(
    o, z, w, rows, out, T, eps,
    s_ob, s_ot, s_oh, s_ov, s_zb, s_zt, s_zh, s_zv,
    HV: tl.constexpr, V: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    # one program per (token, BH value heads)
    i_tok = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_b = i_tok // T
    i_t = i_tok % T
    o_h = i_h * BH + tl.arange(0, BH)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    m = (o_h < HV)[:, None] & m_v[None, :]
    if HAS_ROWS:
        live = tl.load(rows + i_b) >= 0
        m_in = (o_h < tl.where(live, HV, 0))[:, None] & m_v[None, :]  # nothing of a skipped sequence is read
    else:
        m_in = m
    oh, ov = o_h.to(tl.int64)[:, None], o_v.to(tl.int64)[None, :]
    b_o = tl.load(o + i_b * s_ob + i_t * s_ot + oh * s_oh + ov * s_ov, mask=m_in, other=0.0).to(tl.float32)
    b_z = tl.load(z + i_b * s_zb + i_t * s_zt + oh * s_zh + ov * s_zv, mask=m_in, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_v, mask=m_v, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_o * b_o, 1) / V + eps)
    y = b_o * r[:, None] * b_w[None, :] * (b_z / (1.0 + tl.exp(-b_z)))
    if HAS_ROWS:
        y = tl.where(live, y, 0.0)
    tl.store(out + i_tok * (HV * V) + oh * V + ov, y.to(out.dtype.element_ty), mask=m)


def _norm_launch(o, z, weight, eps: float, rows):
    B, T, HV, V = o.shape
    out = empty((B, T, HV * V), dtype=z.dtype, device=z.device)
    BV = next_pow2(V)
    BH = max(1, min(next_pow2(HV), 256 // BV))
    with on_device(o.device):
        gdn_gated_norm_kernel[(B * T, cdiv(HV, BH))](
            o, z, weight, rows if rows is not None else weight, out, T, float(eps),
            *o.stride(), *z.stride(),
            HV=HV, V=V, BH=BH, BV=BV, HAS_ROWS=rows is not None, num_warps=max(1, min(4, BH * BV // 128)),
        )
    return out


@torch.library.custom_op("gqla_triton::gdn_gated_norm", mutates_args=())
def _norm_op(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
             rows: torch.Tensor | None) -> torch.Tensor:
    # a direct torch.ops call reaches here unchecked: the public function's checks (kept per call)
    key = call_key((o, z, weight, rows), ("norm", eps))
    if _CHECKED.get(key) is None:
        _check_norm_call(o, z, weight, eps, rows, no_tokens=True)
        _CHECKED.put(key, True)
    weight, rows = contiguous(weight, rows)
    return _norm_launch(o, z, weight, eps, rows)


@_norm_op.register_fake
def _(o, z, weight, eps, rows):
    B, T, HV, V = o.shape
    return z.new_empty(B, T, HV * V)


forward_only(_norm_op, "gdn_gated_norm")


def _check_norm(o, z, weight, eps, rows, ref, no_tokens: bool = False):
    """Validation shared by the kernel and the reference (``no_tokens``: T = 0 taken too, as the custom op takes
    it)."""
    fdt = FLOAT_DTYPES + ((torch.float64,) if ref else ())
    check_tensor("o", o, ndim=4, dtypes=fdt)
    B, T, HV, V = o.shape
    if o.numel() == 0 and not (no_tokens and T == 0 and B * HV * V > 0):
        raise ValueError(f"o: expected a non-empty [B, T, HV, V], got {list(o.shape)}")
    check_same_device(o=o, z=z, weight=weight, rows=rows)
    check_tensor("z", z, shape=(B, T, HV, V), dtypes=fdt)
    check_tensor("weight", weight, shape=(V,), dtypes=fdt)
    if rows is not None:
        check_tensor("rows", rows, shape=(B,), dtypes=(torch.int32,))
    check_eps("eps", eps)


def _check_norm_call(o, z, weight, eps, rows, no_tokens: bool = False) -> None:
    """Every check of ``gdn_gated_norm``'s arguments (the public function's and its custom op's)."""
    _check_norm(o, z, weight, eps, rows, ref=False, no_tokens=no_tokens)
    for dt in (o.dtype, z.dtype, weight.dtype):
        check_kernel_device(o.device, _NORM_REF, dt)


def gdn_gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm(o)·weight·silu(z)`` per value head (over V, in fp32), flattened over the heads, in one kernel.

    ``o``, ``z``: ``[B, T, HV, V]`` bf16 / fp16 / fp32, any strides (z typically a view into the fused projection
    output); ``weight [V]``; ``rows [B]`` int32 or None: sequences with ``rows[b] < 0`` output exactly 0 (their
    o and z are not read). Returns ``[B, T, HV·V]`` contiguous in z's dtype. Forward only: with inputs that require
    grad, a backward through the output raises."""
    _check_norm_call(o, z, weight, eps, rows)
    step = _norm_op if requires_grad(o, z, weight) else route(_norm_op, _norm_launch)
    return step(o, z, weight.contiguous(), float(eps), rows.contiguous() if rows is not None else None)


def gdn_gated_norm_ref(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """``gdn_gated_norm`` through ``norm.gated_rms_norm`` (any device and dtype, float64 included)."""
    _check_norm(o, z, weight, eps, rows, ref=True)
    B, T, HV, V = o.shape
    y = gated_rms_norm(o, z, weight, eps)
    if rows is not None:
        y = torch.where((rows >= 0)[:, None, None, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.reshape(B, T, HV * V)
