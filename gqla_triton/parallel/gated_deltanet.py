"""Tensor-parallel ``GatedDeltaNet`` along its heads.

Rank ``p`` of ``tp`` holds q/k heads ``[p·H/tp, (p+1)·H/tp)`` and value heads ``[p·HV/tp, (p+1)·HV/tp)``: value
head ``i`` reads q/k head ``i // (HV/H)``, so the two ranges stay paired. Column-parallel: the fused ``in_proj``
(each of its blocks ``[q | k | v | z | b | a]`` sharded by heads: the rank's q/k heads of q and k, its value heads
of v, z, b and a, the rank's blocks joined in the same order), ``A_log``, ``dt_bias`` (its value heads) and the
depthwise conv (its q, k and v channels); replicated: the gated RMSNorm weight (shared by the heads);
row-parallel: ``o_proj`` (the columns of its value heads), whose partial outputs one all-reduce sums. Each rank's
``GatedDeltaNetCache`` holds its conv channels and its value heads' recurrent states (``HV/tp`` per slot).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..layers._state import check_state_dict
from ..layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetCache
from ..ops._common.validation import check_float_dtype, check_rank
from ._common import (
    TensorParallel,
    build,
    check_config,
    check_divides,
    config_of,
    load_into,
    refuse,
    resolve_device,
    shard_state_dict,
    source_dtype,
)

__all__ = ["TPGatedDeltaNet", "shard_gated_deltanet_state_dict"]

_CONFIG = ("hidden_size", "num_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_size", "norm_eps",
           "layer_idx", "impl", "save_states")
_REQUIRED = ("hidden_size", "num_heads", "num_v_heads", "head_k_dim", "head_v_dim")  # those without a default


def _config_of(layer: GatedDeltaNet) -> dict:
    return config_of(layer, _CONFIG)


def _check_config(config) -> dict:
    return check_config(config, _CONFIG, "GatedDeltaNet", _REQUIRED)


def _meta_layers(config: dict, tp_size: int, from_group: bool, dtype=None) -> tuple[GatedDeltaNet, GatedDeltaNet]:
    full = GatedDeltaNet(**config, device="meta", dtype=dtype)
    check_divides(tp_size, full.num_heads, "num_heads", from_group, " (the value heads split as the q/k heads)")
    cfg = _config_of(full)
    local = GatedDeltaNet(**{**cfg, "num_heads": full.num_heads // tp_size,
                             "num_v_heads": full.num_v_heads // tp_size}, device="meta", dtype=dtype)
    return full, local


def _blocks(w: torch.Tensor, full_sizes, local_sizes, tp_rank: int) -> torch.Tensor:
    """Rows of ``w`` in blocks of ``full_sizes``: the rank's ``local_sizes`` share of each block, joined."""
    parts, start = [], 0
    for n, m in zip(full_sizes, local_sizes, strict=True):
        parts.append(w.narrow(0, start + tp_rank * m, m))
        start += n
    return torch.cat(parts, 0)


def _own_keys(state_dict, full: GatedDeltaNet):
    """A copy of ``state_dict`` in the layer's own keys: the layouts ``GatedDeltaNet.load_state_dict`` also takes
    (fla's, the separate input projections) joined as it joins them (``GatedDeltaNet._own_keys``); a conv bias is
    refused by name. A non-mapping is returned as it is (``shard_state_dict`` names it)."""
    if not isinstance(state_dict, Mapping):
        return state_dict
    check_state_dict(full, state_dict, "", full._REFUSED)
    own = dict(state_dict)
    full._own_keys(own)
    return own


def _shard(state_dict, full: GatedDeltaNet, local: GatedDeltaNet, tp_rank: int) -> dict:
    def conv(w: torch.Tensor) -> torch.Tensor:  # channels [q; k; v]: the rank's block of each
        return _blocks(w, full.in_proj_sizes[:3], local.in_proj_sizes[:3], tp_rank)

    def in_proj(w: torch.Tensor) -> torch.Tensor:  # rows [q | k | v | z | b | a]: the rank's heads of each
        return _blocks(w, full.in_proj_sizes, local.in_proj_sizes, tp_rank)

    return shard_state_dict(state_dict, full, local, tp_rank, {"conv1d.weight": conv, "in_proj.weight": in_proj})


def shard_gated_deltanet_state_dict(state_dict: Mapping[str, torch.Tensor], config: Mapping, tp_rank: int,
                                    tp_size: int) -> dict[str, torch.Tensor]:
    """The state dict of rank ``tp_rank``'s shard of a full ``GatedDeltaNet`` (``config``: its constructor
    arguments; ``state_dict``: its weights, in any layout its ``load_state_dict`` takes). Views of ``state_dict``
    except ``in_proj.weight`` and the conv weight (the rank's part of each of their blocks, joined). No
    ``torch.distributed`` call."""
    check_rank(tp_rank, tp_size)
    full, local = _meta_layers(_check_config(config), tp_size, False)
    return _shard(_own_keys(state_dict, full), full, local, tp_rank)


class TPGatedDeltaNet(TensorParallel):
    """This rank's shard of a ``GatedDeltaNet`` in a tensor-parallel group (see the module docstring).

    Build it with ``from_layer`` or ``from_state_dict`` in every rank of ``group``. ``local`` is the shard, a
    ``GatedDeltaNet`` of ``H/tp`` q/k heads and ``HV/tp`` value heads. Inference only.
    """

    @classmethod
    def from_layer(cls, layer: GatedDeltaNet, *, group=None, device=None, dtype=None) -> TPGatedDeltaNet:
        """Shard of the full ``layer`` on ``device`` (default the layer's) in ``dtype`` (default the layer's)."""
        if not isinstance(layer, GatedDeltaNet):  # refused on every rank of the group
            refuse(group, TypeError(f"layer: expected a GatedDeltaNet, got {type(layer).__name__}"))
        w = layer.in_proj.weight
        out = cls.from_state_dict(layer.state_dict(), _config_of(layer), group=group,
                                  device=device if device is not None else w.device,
                                  dtype=dtype if dtype is not None else w.dtype)
        out.local.max_decode_tokens = layer.max_decode_tokens
        return out

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config: Mapping, *, group=None, device=None,
                        dtype=None) -> TPGatedDeltaNet:
        """Shard of ``GatedDeltaNet(**config)`` with the weights ``state_dict`` (any layout the layer's
        ``load_state_dict`` takes: fla's keys, the separate input projections); only the rank's slices are copied to
        ``device`` (default the CPU) in ``dtype`` (default ``state_dict``'s). The size of ``group`` (default: the
        default group) must divide ``num_heads``."""
        def check():
            _check_config(config)
            check_float_dtype(dtype)

        def make(group, rank: int, size: int):
            sd = _own_keys(state_dict, _meta_layers(_check_config(config), size, True)[0])
            dt = dtype or source_dtype(sd, "in_proj.weight")
            full, local = _meta_layers(_check_config(config), size, True, dt)
            shards = _shard(sd, full, local, rank)
            dev = resolve_device(group, device)
            return (load_into(local, shards, dev), _config_of(full), _shard(sd, full, local, (rank + 1) % size))

        return cls(*build(group, check, make))

    def init_cache(self, num_seqs: int, device=None) -> GatedDeltaNetCache:
        """The rank's cache: ``num_seqs`` slots of its conv channels and its ``HV/tp`` value heads' states."""
        return self.local.init_cache(num_seqs, device)

    def forward(self, hidden_states: torch.Tensor, cache: GatedDeltaNetCache | None = None,
                cu_seqlens: torch.Tensor | None = None, *, slots=None, verify: bool = False) -> torch.Tensor:
        """``hidden_states [B, T, hidden]`` (the same on every rank) -> ``[B, T, hidden]``, the full layer's output
        on every rank; arguments as ``GatedDeltaNet.forward`` (``cache``: this rank's, from ``init_cache``; a
        verify step is committed on it with ``cache.commit``). Every rank must make the same call."""
        self._check_inference(hidden_states)
        out = self.local(hidden_states, cache, cu_seqlens, slots=slots, verify=verify)
        return self._reduce(out)

    def extra_repr(self) -> str:
        return (f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, heads {self.local.num_heads} of "
                f"{self.config['num_heads']}, value heads {self.local.num_v_heads} of {self.config['num_v_heads']}")
