"""Pieces shared by the ops: input validation, paging math, split-KV planning and combine."""

from .combine import combine_splits, finish_rows, scale_scores, score_mode, softmax_step, split_lse_unit, store_rows
from .host import cdiv, next_pow2
from .paging import (
    gather_pages,
    key_capacity,
    logical_to_physical,
    page_rows,
    sparse_positions,
    sparse_rows,
    split_bounds,
)
from .split import plan_splits
from .validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_decode_inputs,
    check_kernel_device,
    check_multiple,
    check_same_device,
    check_same_dtype,
    check_softmax_scale,
    check_tensor,
)

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_decode_inputs",
    "check_kernel_device",
    "check_multiple",
    "check_same_device",
    "check_same_dtype",
    "check_softmax_scale",
    "check_tensor",
    "cdiv",
    "combine_splits",
    "finish_rows",
    "scale_scores",
    "score_mode",
    "gather_pages",
    "key_capacity",
    "logical_to_physical",
    "next_pow2",
    "page_rows",
    "plan_splits",
    "softmax_step",
    "split_lse_unit",
    "sparse_positions",
    "sparse_rows",
    "split_bounds",
    "store_rows",
]
