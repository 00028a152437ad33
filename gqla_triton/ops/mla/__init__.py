"""GQLA absorb path / DeepSeek MLA: ``mla_decode`` (dense + sparse, bf16 / fp16 / fp32 caches or FlashMLA's quantised
latent layouts), ``mla_sparse_prefill`` (per-token top-k rows, with max_logits), their float64 references, the
layouts' quantiser, and FlashMLA's interface over them (``compat.py``)."""

from .api import SparsePrefillOutput, mla_decode, mla_sparse_prefill
from .compat import (
    FlashMLASchedMeta,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_decoding_metadata,
    get_mla_metadata,
)
from .fp8 import dequantize_latent_fp8, quantize_latent_fp8
from .reference import mla_decode_ref, mla_sparse_prefill_ref

__all__ = ["FlashMLASchedMeta", "SparsePrefillOutput", "dequantize_latent_fp8", "flash_mla_sparse_fwd",
           "flash_mla_with_kvcache", "get_mla_decoding_metadata", "get_mla_metadata", "mla_decode", "mla_decode_ref",
           "mla_sparse_prefill", "mla_sparse_prefill_ref", "quantize_latent_fp8"]
