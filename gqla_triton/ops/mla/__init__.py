"""GQLA absorb path / DeepSeek MLA decode: ``mla_decode`` (dense + sparse) and its float64 reference."""

from .decode import mla_decode, mla_decode_fwd
from .reference import mla_decode_ref

__all__ = ["mla_decode", "mla_decode_fwd", "mla_decode_ref"]
