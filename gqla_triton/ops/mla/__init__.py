"""GQLA absorb path / DeepSeek MLA decode: ``mla_decode`` (dense + sparse, bf16 / fp16 / fp32 caches or FlashMLA's
FP8 latent layout), its float64 reference, the FP8 layout's quantiser, and FlashMLA's decode interface over it
(``compat.py``)."""

from .api import mla_decode
from .compat import FlashMLASchedMeta, flash_mla_with_kvcache, get_mla_metadata
from .fp8 import dequantize_latent_fp8, quantize_latent_fp8
from .reference import mla_decode_ref

__all__ = ["FlashMLASchedMeta", "dequantize_latent_fp8", "flash_mla_with_kvcache", "get_mla_metadata", "mla_decode",
           "mla_decode_ref", "quantize_latent_fp8"]
