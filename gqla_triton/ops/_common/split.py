"""Split-KV planning: how many key ranges each (sequence, row tile) is cut into, from shapes only.

No device value is read (no host sync, CUDA-graph safe): the key count that bounds a sequence is the capacity
of its block table (dense) or its index row (sparse), ``paging.key_capacity``. Splits combine through
``combine.combine_splits``; ``paging.split_bounds`` gives each split's key range on the device.
"""

from __future__ import annotations

import functools

__all__ = ["MAX_SPLITS", "MIN_TILES_PER_SPLIT", "SPLIT_COST", "plan_splits"]

MAX_SPLITS = 64  # upper bound of any split count
MIN_TILES_PER_SPLIT = 4  # a split covers at least this many key tiles of the kernel
SPLIT_COST = 0.02  # combine cost per partial tile, in units of one unsplit program (wave-cost rule)


@functools.lru_cache(maxsize=4096)  # a pure function of its integers, asked once per decode call
def plan_splits(programs: int, max_keys: int, sm_count: int, *, block_n: int, waves: int | None = None,
                split_cost: float = SPLIT_COST) -> int:
    """Split-KV count for ``programs`` unsplit programs (sequences x row tiles) over at most ``max_keys`` keys.

    The count lies in ``[1, min(MAX_SPLITS, max_keys // (MIN_TILES_PER_SPLIT · block_n))]`` (at least 1).
    ``waves`` set: the largest count that gives at most ``waves`` programs per SM (1 where the unsplit programs
    already exceed that): programs of a memory-bound kernel that fit side by side on an SM keep more loads in
    flight, while each split beyond that only adds a partial to combine. ``waves`` None: the count that
    minimises the wave-quantised time of the split kernel, ``ceil(programs·S / sm_count) / S`` (in units of
    one unsplit program), plus the combine's ``split_cost · programs·S / sm_count`` when S > 1 (default
    ``SPLIT_COST``; a config table can set its own per GPU); the smallest such S on ties.
    """
    cap = max(1, min(MAX_SPLITS, max_keys // (MIN_TILES_PER_SPLIT * block_n)))
    if waves is not None:
        return max(1, min(waves * sm_count // max(1, programs), cap))
    slots = max(1, sm_count)
    best, best_cost = 1, float("inf")
    for S in range(1, cap + 1):
        cost = -(-programs * S // slots) / S + (split_cost * programs * S / slots if S > 1 else 0.0)
        if cost < best_cost - 1e-9:
            best, best_cost = S, cost
    return best
