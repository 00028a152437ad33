"""GQLA absorb path / DeepSeek MLA decode: ``mla_decode`` (dense + sparse, bf16 / fp16 / fp32 caches or FlashMLA's
FP8 latent layout), its float64 reference and the FP8 layout's quantiser."""

from .api import mla_decode
from .fp8 import dequantize_latent_fp8, quantize_latent_fp8
from .reference import mla_decode_ref

__all__ = ["mla_decode", "mla_decode_ref", "quantize_latent_fp8", "dequantize_latent_fp8"]
