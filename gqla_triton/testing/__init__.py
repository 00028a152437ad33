"""Float64 oracles and pure-torch attention shared by the tests, the layers' ``impl="reference"`` paths and the
conversion code. Everything here is einsum / torch only and runs on any device."""

from .attention import attend, grouped_cache_attention, key_weights, latent_cache_attention
from .gqla import gqla_reference

__all__ = ["attend", "key_weights", "latent_cache_attention", "grouped_cache_attention", "gqla_reference"]
