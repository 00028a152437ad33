"""Gated DeltaNet ops: chunked prefill / training (``api``: ``chunk_gated_delta_rule``), the recurrent decode step
(``decode``: ``gated_delta_rule_decode``) and their torch references (``reference``)."""

from .api import chunk_gated_delta_rule
from .decode import gated_delta_rule_decode
from .reference import chunk_gated_delta_rule_ref, l2norm_ref, recurrent_gated_delta_rule_ref

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "gated_delta_rule_decode",
    "l2norm_ref",
    "recurrent_gated_delta_rule_ref",
]
