"""Gated DeltaNet ops: chunked prefill / training (``api``: ``chunk_gated_delta_rule``; ``flash_qla``: FlashQLA's
forward and backward entry points over it), the recurrent decode step (``decode``: ``gated_delta_rule_decode``),
fla's recurrent form over it (``recurrent``: ``fused_recurrent_gated_delta_rule``) and their torch references
(``reference``)."""

from .api import chunk_gated_delta_rule
from .decode import gated_delta_rule_decode
from .flash_qla import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd, recurrent_gated_delta_rule
from .recurrent import fused_recurrent_gated_delta_rule
from .reference import chunk_gated_delta_rule_ref, l2norm_ref, recurrent_gated_delta_rule_ref

# fla's short names of the same functions (``fla.ops.gated_delta_rule``)
chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gdn",
    "chunk_gated_delta_rule_bwd",
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_ref",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gdn",
    "gated_delta_rule_decode",
    "l2norm_ref",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
]
