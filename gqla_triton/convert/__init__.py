"""Model conversions: ``trans_gqla`` (pretrained GQA attention -> ``GQLAttention``) and ``convert_llama``
(a ``transformers`` Llama-family model -> the same model with GQLA attention; needs the ``[hf]`` extra),
``load_gqla`` / ``mla_to_gqla`` (DeepSeek-layout checkpoints: the paper's GQLA layout, MLA -> GQLA)."""

from __future__ import annotations

from .hf import GQLAHFAttention, convert_llama, set_decode_path
from .loaders import interleaved_to_half, load_gqla, mla_to_gqla
from .trans_gqla import gqa_attention_reference, trans_gqla

__all__ = ["trans_gqla", "gqa_attention_reference", "convert_llama", "GQLAHFAttention", "set_decode_path",
           "load_gqla", "mla_to_gqla", "interleaved_to_half"]
