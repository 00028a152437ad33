"""GQLA absorb path / DeepSeek MLA decode: ``mla_decode`` (dense + sparse) and its float64 reference."""

from .api import mla_decode
from .reference import mla_decode_ref

__all__ = ["mla_decode", "mla_decode_ref"]
