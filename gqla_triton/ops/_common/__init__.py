"""Pieces shared by the ops: input validation, paging math, split-KV planning and combine."""

from .combine import combine_splits, finish_rows, softmax_step, store_rows
from .host import cdiv, next_pow2
from .paging import (
    choose_num_splits,
    gather_pages,
    logical_to_physical,
    sparse_positions,
    sparse_rows,
    split_bounds,
)
from .validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_decode_inputs,
    check_kernel_device,
    check_multiple,
    check_same_device,
    check_same_dtype,
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
    "check_tensor",
    "cdiv",
    "choose_num_splits",
    "combine_splits",
    "finish_rows",
    "gather_pages",
    "logical_to_physical",
    "next_pow2",
    "softmax_step",
    "sparse_positions",
    "sparse_rows",
    "split_bounds",
    "store_rows",
]
