"""gqla_triton: Triton kernels and layers for hybrid-LLM attention.

Ops: ``chunk_gated_delta_rule``, ``gated_delta_rule_decode`` (Gated DeltaNet), ``mla_decode`` (GQLA absorb
path / DeepSeek MLA), ``mla_sparse_prefill`` (DeepSeek sparse attention prefill), ``gqa_decode`` (GQLA grouped
path / GQA). Layers: ``GatedDeltaNet``, ``GQLAttention`` with ``LatentCache`` / ``GroupedCache``. Importing does
no device work; kernels compile on first call.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_EXPORTS = {
    "chunk_gated_delta_rule": "gqla_triton.ops.gdn",
    "chunk_gated_delta_rule_fwd": "gqla_triton.ops.gdn",
    "chunk_gated_delta_rule_bwd": "gqla_triton.ops.gdn",
    "recurrent_gated_delta_rule": "gqla_triton.ops.gdn",
    "gated_delta_rule_decode": "gqla_triton.ops.gdn",
    "fused_recurrent_gated_delta_rule": "gqla_triton.ops.gdn",
    "mla_decode": "gqla_triton.ops.mla",
    "mla_sparse_prefill": "gqla_triton.ops.mla",
    "quantize_latent_fp8": "gqla_triton.ops.mla",
    "dequantize_latent_fp8": "gqla_triton.ops.mla",
    "flash_mla_with_kvcache": "gqla_triton.ops.mla",
    "flash_mla_sparse_fwd": "gqla_triton.ops.mla",
    "get_mla_metadata": "gqla_triton.ops.mla",
    "get_mla_decoding_metadata": "gqla_triton.ops.mla",
    "FlashMLASchedMeta": "gqla_triton.ops.mla",
    "gqa_decode": "gqla_triton.ops.gqa",
    "GatedDeltaNet": "gqla_triton.layers.gated_deltanet",
    "GQLAttention": "gqla_triton.layers.gqla",
    "LatentCache": "gqla_triton.layers.cache",
    "GroupedCache": "gqla_triton.layers.cache",
    "trans_gqla": "gqla_triton.convert.trans_gqla",
    "convert_llama": "gqla_triton.convert.hf",
    "load_gqla": "gqla_triton.convert.loaders",
    "mla_to_gqla": "gqla_triton.convert.loaders",
    "RMSNorm": "gqla_triton.layers.norm",
    "choose_decode_path": "gqla_triton.decode_path",
    "DecodePathChoice": "gqla_triton.decode_path",
    "select_config": "gqla_triton.dispatch",
    "config_override": "gqla_triton.dispatch",
    "device_info": "gqla_triton.dispatch",
}
_MODULES = ("dispatch", "decode_path", "roofline", "layers", "ops", "library", "convert", "parallel", "testing")

__all__ = sorted(_EXPORTS) + list(_MODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        return importlib.import_module(f"gqla_triton.{name}")
    raise AttributeError(f"module 'gqla_triton' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
