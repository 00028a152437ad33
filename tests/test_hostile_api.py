"""Hostile arguments of the public API that reach torch / Python internals unless checked: each is refused by a
TypeError / ValueError naming the argument, or runs as its documented definition."""

import pytest
import torch
from harness import P

import gqla_triton as gq
from gqla_triton.layers.cache import GroupedCache, LatentCache


def test_fused_recurrent_flag_tensor_is_refused_by_name():
    q = torch.randn(1, 3, 1, 16, device=P.device)
    v = torch.randn(1, 3, 1, 16, device=P.device)
    for g in (None, torch.zeros(1, 3, 1, device=P.device)):  # without g the flag would be read as a truth value
        with pytest.raises(TypeError, match="^use_gate_in_kernel: expected a bool"):
            gq.fused_recurrent_gated_delta_rule(q, q, v, g, use_gate_in_kernel=torch.tensor([1, 0]))


def test_latent_cache_appends_mixed_float8_inputs():
    """``c_kv`` float8_e5m2 with an fp32 ``k_rope``: torch.cat promotes no float8 dtype; the values are widened as
    it widens the others (exactly), so the rows equal those of the widened inputs."""
    c_kv = torch.randn(1, 3, 32, device=P.device).to(torch.float8_e5m2)
    k_rope = torch.randn(1, 3, 16, device=P.device)
    got, want = (LatentCache(1, 32, 32, 16, page_size=16, dtype=torch.float32, device=P.device) for _ in range(2))
    got.append([0], c_kv, k_rope)
    want.append([0], c_kv.float(), k_rope)
    assert all(torch.equal(a, b) for a, b in zip(got.gather(0), want.gather(0), strict=True))


def test_grouped_cache_from_latent_refuses_a_non_layer():
    lat = LatentCache(1, 32, 32, 16, page_size=16, dtype=torch.float32, device=P.device)
    for layer in (None, object()):
        with pytest.raises(TypeError, match="^layer: expected the GQLAttention"):
            GroupedCache.from_latent(lat, layer)
