"""GQLA grouped path / GQA decode: ``gqa_decode`` (dense + sparse top-k) and its float64 reference."""

from .decode import gqa_decode, gqa_decode_fwd
from .reference import gqa_decode_reference

__all__ = ["gqa_decode", "gqa_decode_fwd", "gqa_decode_reference"]
