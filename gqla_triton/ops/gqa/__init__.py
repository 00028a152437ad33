"""GQLA grouped path / GQA decode: ``gqa_decode`` (dense + sparse top-k) and its float64 reference."""

from .api import gqa_decode
from .reference import gqa_decode_reference

__all__ = ["gqa_decode", "gqa_decode_reference"]
