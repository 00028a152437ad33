"""GVA sums: the value heads of one q/k head add their dq / dk terms into one total (``grad`` and ``wy_bwd``
stages), through ``part`` (fp32) and counters ``cnt``. With at most two value heads per q/k head the terms pass
along as one running sum (``_head_arrive``: a + b rounds as b + a, so the result is bitwise fixed); with more
(``SLOTS``), each head stores its term in a slot of its own and the last to arrive adds the G slots in head order
(``_slot_arrive``, ``_slot_sum``), so the total does not depend on the arrival order either."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gva_program(H, HV, GSUM: tl.constexpr):
    """(i_t, i_bh, tile) of a chunk program on the (chunks, B·HV) grid; tile numbers (chunk, batch row, q/k head).
    With GSUM the launch order puts the HV/H value heads of one tile next to each other: they run together, share
    the q / k tiles in L2 and pass their running sum (``_head_arrive``) while it is in L2."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    G = HV // H
    if GSUM:
        lin = i_t + tl.num_programs(0) * i_bh
        rest = lin // G
        i_t = rest % tl.num_programs(0)
        i_bh = (rest // tl.num_programs(0)) * G + lin % G
    return i_t, i_bh, (i_t * tl.num_programs(1) + i_bh) // G


@triton.jit
def _head_arrive(cnt, slot):
    """GVA sums over the G value heads of one q/k head, for one tile (counter ``slot``; ``cnt`` int32, zeroed,
    holds per slot [arrivals, sums passed on]): in the order the heads arrive here (rank n), each adds the fp32
    running sum of the earlier ones and passes the new sum on (``_head_pass`` or ``_head_add``, then
    ``_head_publish``); the last stores the total. Returns the rank n. Before reading the sum, rank n waits
    (``_head_wait``) for the heads that arrived earlier, which are resident and wait only for earlier ones, so this
    cannot deadlock. Deterministic for G <= 2 (a + b is b + a); beyond that the order of the additions follows
    arrival."""
    return tl.atomic_add(cnt + 2 * slot, 1, sem="relaxed")


@triton.jit
def _head_wait(cnt, slot, n):
    """Returns when ranks 0 .. n-1 of ``slot`` have passed their sums on."""
    if n > 0:
        done = tl.atomic_add(cnt + 2 * slot + 1, 0, sem="acquire")
        while done < n:
            done = tl.atomic_add(cnt + 2 * slot + 1, 0, sem="acquire")


@triton.jit
def _head_pass(acc, out, part, o, mask, n, G):
    """Rank n's piece of the running sum (``part``, out's layout, read past L1): branch-free masked loads and
    stores, so that a loop around it stays software-pipelined. The last rank stores the total in out's dtype."""
    nt = o * 0 + n  # the rank as a tile (the interpreter rejects masks combined with the scalar's comparison)
    acc += tl.load(part + o, mask=mask & (nt > 0), other=0.0, cache_modifier=".cg")
    tl.store(part + o, acc, mask=mask & (nt < G - 1))
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=mask & (nt == G - 1))


@triton.jit
def _head_add(acc, out, part, o, mask, cnt, slot, n, G):
    """Rank n's ``_head_pass``, ``_head_publish`` of one tile outside a loop, with branches instead of masks
    (after ``_head_wait``)."""
    if n > 0:
        acc += tl.load(part + o, mask=mask, other=0.0, cache_modifier=".cg")
    if n < G - 1:
        tl.store(part + o, acc, mask=mask)
        _head_publish(cnt, slot, n, G)
    else:
        tl.store(out + o, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _head_publish(cnt, slot, n, G):
    """After every ``_head_pass`` of rank n: the sum is passed on (CTA barrier, then a gpu-scope release)."""
    if n < G - 1:
        tl.debug_barrier()  # every thread's part of the sum is stored before the release
        tl.atomic_xchg(cnt + 2 * slot + 1, n + 1, sem="release")


@triton.jit
def _slot_arrive(cnt, slot):
    """SLOTS: after every thread has stored this head's fp32 term in its own slot of ``part`` (``[rows, HV, K]``),
    a CTA barrier, then a gpu-scope acq_rel arrival at counter ``slot`` (``cnt`` int32, zeroed). Returns the rank
    in arrival order; rank G - 1 sees every slot (``_slot_sum``). No rank waits for another: no deadlock."""
    tl.debug_barrier()
    return tl.atomic_add(cnt + 2 * slot, 1, sem="acq_rel")


@triton.jit
def _slot_sum(out, o, part, p0, mask, G, K):
    """SLOTS, by the last rank: the G slots from offset ``p0`` (head 0 of the q/k head; slot j at ``p0 + j·K``)
    added in head order, stored in out's dtype at offsets ``o``."""
    acc = tl.load(part + p0, mask=mask, other=0.0, cache_modifier=".cg")
    for j in range(1, G):
        acc += tl.load(part + p0 + j * K, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=mask)
