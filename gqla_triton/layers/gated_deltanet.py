"""Gated DeltaNet block (Qwen3-Next style) with a per-sequence conv + recurrent state cache.

``x [B, T, hidden]`` -> q, k ``[.., H·K]``, v, z ``[.., HV·V]``, b, a ``[.., HV]`` (linear projections);
short causal depthwise conv (width ``conv_size``) + SiLU over ``[q; k; v]``; q, k L2-normalised per head
(inside the op); ``g = -exp(A_log)·softplus(a + dt_bias)``, ``beta = sigmoid(b)``; the gated delta rule
(``chunk_gated_delta_rule`` for prefill/training, ``gated_delta_rule_decode`` for decode steps);
gated RMSNorm per value head ``RMSNorm(o)·w·silu(z)``; output projection back to ``hidden``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common.impl import check_impl
from ..ops.gdn import chunk_gated_delta_rule, gated_delta_rule_decode
from ..ops.gdn.reference import recurrent_gated_delta_rule_ref
from .norm import gated_rms_norm

__all__ = ["GatedDeltaNet", "GatedDeltaNetCache"]


class GatedDeltaNetCache:
    """State of one ``GatedDeltaNet`` layer for ``num_seqs`` sequences (one row per sequence).

    ``conv_state [num_seqs, conv_dim, conv_size - 1]`` (last pre-conv inputs, layer dtype) and
    ``recurrent_state [num_seqs, HV, K, V]`` fp32 (the decode op's in-place pool; fp64 for a fp64
    layer). ``slots`` (``[B]`` int32
    or None = ``arange(B)``) maps the sequences of the current batch to rows: distinct, in ``[0, num_seqs)``.
    ``seqlen`` counts tokens fed through the layer (host int): 0 means the next forward is a prefill.
    """

    def __init__(self, num_seqs: int, conv_dim: int, conv_size: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, *, device=None, dtype=torch.float32):
        self.conv_state = torch.zeros(num_seqs, conv_dim, conv_size - 1, device=device, dtype=dtype)
        sdt = torch.float64 if dtype == torch.float64 else torch.float32  # fp64 only for the reference impl
        self.recurrent_state = torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, device=device, dtype=sdt)
        self.slots: torch.Tensor | None = None
        self.seqlen = 0

    @property
    def num_seqs(self) -> int:
        return self.recurrent_state.shape[0]

    def rows(self, n: int, device) -> torch.Tensor:
        if self.slots is None:
            if n > self.num_seqs:
                raise ValueError(f"cache: batch of {n} sequences but the cache holds {self.num_seqs}")
            return torch.arange(n, dtype=torch.int32, device=device)
        if tuple(self.slots.shape) != (n,) or self.slots.dtype != torch.int32:
            raise ValueError(f"cache.slots: expected int32 [{n}], got {self.slots.dtype} {list(self.slots.shape)}")
        return self.slots.to(device)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next Gated DeltaNet layer.

    Args:
        hidden_size: model width. num_heads (H): q/k heads. num_v_heads (HV): value heads, ``HV % H == 0``.
        head_k_dim (K), head_v_dim (V): per-head dims. conv_size: short-conv width (>= 2).
        norm_eps: gated RMSNorm epsilon. layer_idx: position in the model (informational).
        impl: ``"auto"`` / ``"triton"`` (the Triton kernels) or ``"reference"`` (pure torch, any device and dtype).
        save_states: the chunked op keeps its per-chunk states for the backward (faster; about 4x the value
            tensor's size of extra activation memory) instead of recomputing them (``chunk_gated_delta_rule``).

    ``forward(hidden_states [B, T, hidden], cache=None, cu_seqlens=None) -> [B, T, hidden]``:
    without a cache (or with an empty one) runs the chunked op (training/prefill; ``cu_seqlens`` LongTensor
    ``[N+1]`` packs N sequences with ``B == 1``) and, given a cache, stores the final conv/recurrent states in
    it; with a cache already holding these sequences, ``T <= max_decode_tokens`` (16) new tokens per sequence
    run through the decode op (more: the chunked op continues from the cached states).
    """

    max_decode_tokens = 16

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_size: int = 4, norm_eps: float = 1e-6, layer_idx: int | None = None, impl: str = "auto",
                 device=None, dtype=None, *, save_states: bool = True):
        super().__init__()
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads}")
        if conv_size < 2:
            raise ValueError(f"conv_size: expected >= 2, got {conv_size}")
        check_impl(impl, op="GatedDeltaNet", gluon=False)
        fk = dict(device=device, dtype=dtype)
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_size = head_k_dim, head_v_dim, conv_size
        self.norm_eps, self.layer_idx, self.impl = norm_eps, layer_idx, impl
        if not isinstance(save_states, bool):
            raise TypeError(f"save_states: expected a bool, got {type(save_states).__name__}")
        self.save_states = save_states
        self.key_dim = num_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **fk)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **fk)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **fk)
        self.z_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **fk)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **fk)
        self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **fk)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_size, groups=self.conv_dim, bias=False, **fk)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **fk))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **fk))
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim, **fk))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **fk)
        self._init_gates()

    @torch.no_grad()
    def _init_gates(self):
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias, dtype=torch.float32).uniform_(math.log(1e-3), math.log(0.1)))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def init_cache(self, num_seqs: int, device=None) -> GatedDeltaNetCache:
        """An empty cache for ``num_seqs`` sequences on the layer's device and dtype."""
        w = self.q_proj.weight
        return GatedDeltaNetCache(num_seqs, self.conv_dim, self.conv_size, self.num_v_heads, self.head_k_dim,
                                  self.head_v_dim, device=device or w.device, dtype=w.dtype)

    # --------------------------------------------------------------------------------------- pieces
    def _conv(self, x, init, cu_seqlens):
        """Causal depthwise conv over ``x [B, T, C]`` starting from ``init [N, C, W-1]`` (None = zeros).

        Returns ``(y [B, T, C], final [N, C, W-1])``; with ``cu_seqlens`` no sequence sees another's tokens.
        """
        W, C = self.conv_size, x.shape[-1]
        w = self.conv1d.weight
        if cu_seqlens is None:
            B, T = x.shape[:2]
            pad = init.transpose(1, 2).to(x.dtype) if init is not None else x.new_zeros(B, W - 1, C)
            xf = torch.cat([pad, x], 1)
            y = F.conv1d(xf.transpose(1, 2), w, groups=C).transpose(1, 2)
            return y, xf[:, T:].transpose(1, 2)
        # varlen: give every sequence its own W-1 leading slots (zeros or its initial state), conv once
        T = x.shape[1]
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        N = cu.numel() - 1
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), cu.diff(), output_size=T)
        dest = torch.arange(T, device=x.device) + (seq + 1) * (W - 1)
        j = torch.arange(W - 1, device=x.device)
        head = (cu[:-1] + torch.arange(N, device=x.device) * (W - 1))[:, None] + j  # [N, W-1] leading slots
        xp = x.new_zeros(T + N * (W - 1), C)
        if init is not None:
            xp = xp.index_copy(0, head.flatten(), init.transpose(1, 2).reshape(-1, C).to(x.dtype))
        xp = xp.index_copy(0, dest, x[0])
        y = F.conv1d(xp.t()[None], w, groups=C)[0].t()
        tail = (cu[1:] + torch.arange(1, N + 1, device=x.device) * (W - 1))[:, None] - (W - 1) + j
        return y[dest - (W - 1)][None], xp[tail.flatten()].reshape(N, W - 1, C).transpose(1, 2)

    def _rule(self, q, k, v, g, beta, state0, cu_seqlens, want_final):
        if self.impl == "reference":
            o, fin = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state0,
                                                    output_final_state=want_final, use_qk_l2norm=True,
                                                    cu_seqlens=cu_seqlens)
            return o.to(v.dtype), fin
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state0, output_final_state=want_final,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                      save_states=self.save_states, impl=self.impl)

    # --------------------------------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, cache: GatedDeltaNetCache | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got {list(hidden_states.shape)}")
        B, T, _ = hidden_states.shape
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B={B}")
            if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                raise ValueError(f"cu_seqlens: expected a 1-D tensor [N+1], got shape {list(cu_seqlens.shape)}")
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        x = hidden_states
        warm = cache is not None and cache.seqlen > 0  # the cache holds these sequences' states
        decode = warm and cu_seqlens is None and T <= self.max_decode_tokens
        rows = cache.rows(N, x.device) if cache is not None else None
        rows_l = rows.long() if rows is not None else None

        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        conv0 = cache.conv_state[rows_l] if warm else None
        mixed, conv_fin = self._conv(mixed, conv0, cu_seqlens)
        mixed = F.silu(mixed)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        beta = torch.sigmoid(self.b_proj(x).to(cdt))
        g = -torch.exp(self.A_log.to(cdt)) * F.softplus(self.a_proj(x).to(cdt) + self.dt_bias.to(cdt))

        if decode and self.impl != "reference":
            o = gated_delta_rule_decode(q, k, v, g, beta, cache.recurrent_state, rows, use_qk_l2norm_in_kernel=True,
                                        impl=self.impl)
        else:
            state0 = cache.recurrent_state[rows_l] if warm else None
            o, fin = self._rule(q, k, v, g, beta, state0, cu_seqlens, cache is not None)
            if cache is not None:
                cache.recurrent_state.index_copy_(0, rows_l, fin.detach().to(cache.recurrent_state.dtype))
        if cache is not None:
            cache.conv_state.index_copy_(0, rows_l, conv_fin.detach().to(cache.conv_state.dtype))
            cache.seqlen += T

        o = gated_rms_norm(o, self.z_proj(x).reshape(B, T, HV, V), self.norm_weight, self.norm_eps)
        return self.o_proj(o.reshape(B, T, self.value_dim))
