"""Model conversions: ``trans_gqla`` (pretrained GQA attention -> ``GQLAttention``)."""

from __future__ import annotations

from .trans_gqla import gqa_attention_reference, trans_gqla

__all__ = ["trans_gqla", "gqa_attention_reference"]
