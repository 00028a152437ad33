"""GQLAttention: Group-Query Latent Attention with one weight set and two decode paths.

Weights (MLA with group-indexed up-projections; ``γ(i) = i // (h_q/g)`` is the group of query head ``i``)::

    kv_a_proj      hidden -> kv_rank + rope_dim        latent c (then RMSNorm) and the shared rope key
    kv_b_proj      kv_rank -> g·(d_h + d_v)             rows of group j: W_UK[j] (d_h rows), W_UV[j] (d_v rows)
    q_proj         hidden -> h_q·(d_h + d_R)           (or q_a_proj -> RMSNorm -> q_b_proj when q_rank is set)
    o_proj         h_q·d_v -> hidden

Per query head the first ``d_h`` dims are the no-rope part, the last ``d_R`` the rope part.
Prefill / training runs the grouped form through ``F.scaled_dot_product_attention`` (whose causal mask can carry
a token's NaN / inf to the earlier queries of its sequence; docs/design.md). Decode (a cache that
already holds tokens of these sequences, ``s_q = T >= 1`` new tokens) runs

- ``absorb``: ``q_lat = W_UK[γ(i)]ᵀ q_nope`` ++ ``q_rope`` -> ``mla_decode`` over a ``LatentCache``
  -> ``W_UV[γ(i)] õ`` -> ``o_proj``;
- ``grouped``: per-group ``K = W_UK c``, ``V = W_UV c`` in a ``GroupedCache`` -> ``gqa_decode`` -> ``o_proj``.

The cache kind decides the path; ``path`` fixes it ("absorb" / "grouped") or leaves it to
``choose_decode_path`` ("auto", used by ``make_cache``).

A decode step with the kernels (``impl`` other than "reference") runs, besides the projections' GEMMs and the
cache write: one launch for both RMSNorms, the rotated rope key and the rope factors (``gqla_step.norm_rope``),
one for the attention query (absorb: ``absorb_q``, the ``W_UK`` product and the query rope; grouped:
``grouped_q``), the attention op (validated once, before the cache write), and on the absorb path one for the
``W_UV`` product (``absorb_o``). ``impl="reference"`` runs the same step in torch ops (einsums, ``apply_rope``).

A decode step (cache write, attention, projections) runs on the device only: positions come from the cache's
device lengths, and the prefill-or-decode choice from host flags that decode steps never change. So a step can
be captured in a CUDA graph or compiled with ``torch.compile(fullgraph=True)`` after ``cache.reserve`` (see
``layers.cache`` for what happens past the reservation).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common.impl import check_impl
from ..ops._common.validation import (
    FLOAT_DTYPES,
    check_choice,
    check_dense,
    check_device,
    check_flag,
    check_float_dtype,
    check_norm_eps,
    check_positive_int,
    check_positive_real,
    check_rank,
    check_softmax_scale,
    check_tensor,
)
from ..testing.attention import grouped_cache_attention, latent_cache_attention
from ._state import assigning, check_state_dict, drop_when_freed, load_or_restore
from .cache import GroupedCache, LatentCache, latent_compute_dtypes
from .gqla_step import absorb_o, absorb_q, grouped_q, norm_rope
from .norm import RMSNorm
from .rope import apply_rope, cached_inv_freq, check_positions, check_rope_dim, check_rope_inv_freq

__all__ = ["GQLAttention"]

_PATHS = ("auto", "absorb", "grouped")


def _check_grouped_dims(impl: str, d_h: int, d_v: int, d_r: int) -> None:
    """The grouped path's decode kernels (``gqa_decode``) take its head dims and ``impl`` (no "gluon"), else it
    runs only with ``impl="reference"``: refused where the path is chosen, not at the first decode step."""
    if impl == "reference":
        return
    if impl == "gluon":
        raise ValueError("path 'grouped' with impl='gluon': 'gluon' is the absorb path's Hopper kernel and the grouped "
                         "decode (gqa_decode) has none; use impl='auto' or 'triton', or the absorb path")
    from ..ops.gqa.api import check_head_dims

    try:
        check_head_dims(d_h, d_v, d_r, names=("head_dim", "v_head_dim", "rope_dim"), rope=d_r > 0)
    except ValueError as e:
        raise ValueError(f"path 'grouped' with impl={impl!r}: {e} (the grouped decode kernels' dims; the absorb "
                         "path or impl='reference' takes these)") from None


class _ForwardOnlyDecode(torch.autograd.Function):
    """A reference decode step's attention output under autograd. The cache holds the new tokens' rows detached and
    the step reads them back from it, so the gradient through them would be wrong: a backward raises, as through the
    kernels' decode ops (``forward_only``)."""

    @staticmethod
    def forward(ctx, o):
        return o.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("GQLAttention: a decode step against a cache is forward-only (the new tokens' rows are "
                           "read back from the cache): call it under torch.no_grad() / torch.inference_mode(), or "
                           "run the whole sequence without a cache to train")


def check_rope_bits(key: str, v) -> None:
    """A state dict's RoPE frequencies (entry ``key``, ``rope_inv_freq_bits``; None or a non-tensor: left to the
    shape checks): the int64 bits of finite float64 frequencies, as the constructor takes ``rope_inv_freq``."""
    if not isinstance(v, torch.Tensor):
        return
    if v.dtype != torch.int64:
        raise ValueError(f"state_dict: {key}: expected the int64 bits of float64 frequencies, got {v.dtype}")
    if v.device.type != "meta" and not bool(torch.isfinite(v.view(torch.float64)).all()):
        raise ValueError(f"state_dict: {key}: expected the bits of finite frequencies")


class GQLAttention(nn.Module):
    """Group-Query Latent Attention layer (see the module docstring for the weights and both decode paths).

    Args:
        hidden_size: model width.
        num_heads: query heads h_q.
        num_groups: key/value groups g (divides h_q); head ``i`` uses group ``i // (h_q / g)``.
        head_dim: d_h, the no-rope query/key width per head (default 128).
        rope_dim: d_R, the rope width of the query heads and of the one shared rope key (even, may be 0).
        kv_rank: r, the latent width (default 512).
        q_rank: None for a full-rank query projection, else the rank of ``q_a_proj -> RMSNorm -> q_b_proj``.
        v_head_dim: d_v (default d_h).
        rope_theta: rotary base.
        softmax_scale: default ``(d_h + d_R) ** -0.5``.
        path: ``"auto"`` (``choose_decode_path`` picks per batch / length when a cache is made), ``"absorb"``
            (MLA over a ``LatentCache``) or ``"grouped"`` (GQA over a ``GroupedCache``).
        impl: ``"auto"`` | ``"triton"`` | ``"gluon"`` (decode kernels, passed to the ops; ``"gluon"`` is the absorb
            path's Hopper kernel: ``gqa_decode`` has none, so the grouped path refuses it where it is chosen, as the
            layer's ``path`` or a cache's) or ``"reference"``
            (pure-torch decode on any device and dtype; it reads the cache on the host, so it is not for
            CUDA graphs or torch.compile). Prefill runs torch SDPA in every case.
        device, dtype: of the parameters.
        kv_norm: keyword-only; False drops the latent RMSNorm (TransGQLA conversions: the source has none).
        norm_eps: keyword-only; epsilon of the RMSNorms.
        rope_inv_freq: keyword-only; ``[rope_dim / 2]`` inverse frequencies of the rope pairs replacing
            ``rope_theta``'s (converted models). Kept in the int64 buffer ``rope_inv_freq_bits`` (the bits of the
            float64 values), so casting the module's dtype leaves the frequencies exact.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_groups: int, head_dim: int = 128, rope_dim: int = 64,
                 kv_rank: int = 512, q_rank: int | None = None, v_head_dim: int | None = None,
                 rope_theta: float = 10000.0, softmax_scale: float | None = None, path: str = "auto",
                 impl: str = "auto", device=None, dtype=None, *, kv_norm: bool = True, norm_eps: float = 1e-6,
                 rope_inv_freq: torch.Tensor | None = None):
        super().__init__()
        device = check_device(device)
        for name, v in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_groups", num_groups),
                        ("head_dim", head_dim), ("kv_rank", kv_rank)):
            check_positive_int(name, v)
        hidden_size, num_heads, num_groups, head_dim, kv_rank = (int(v) for v in (hidden_size, num_heads, num_groups,
                                                                                  head_dim, kv_rank))
        if num_heads % num_groups:
            raise ValueError(f"num_heads: {num_heads} is not a multiple of num_groups {num_groups}")
        rope_dim = check_rope_dim("rope_dim", rope_dim)
        if q_rank is not None:
            q_rank = check_positive_int("q_rank", q_rank)
        if v_head_dim is not None:
            v_head_dim = check_positive_int("v_head_dim", v_head_dim)
        rope_theta = check_positive_real("rope_theta", rope_theta)
        norm_eps = check_norm_eps("norm_eps", norm_eps)
        kv_norm = check_flag("kv_norm", kv_norm)
        check_choice("path", path, _PATHS)
        check_impl(impl, op="GQLAttention", gluon=True)
        check_float_dtype(dtype)
        if path == "grouped":
            _check_grouped_dims(impl, head_dim, head_dim if v_head_dim is None else v_head_dim, rope_dim)
        if rope_inv_freq is not None:
            rope_inv_freq = check_rope_inv_freq(rope_inv_freq, rope_dim // 2)
        fk = dict(device=device, dtype=dtype)
        self.hidden_size, self.num_heads, self.num_groups = hidden_size, num_heads, num_groups
        self.head_dim, self.rope_dim, self.kv_rank, self.q_rank = head_dim, rope_dim, kv_rank, q_rank
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.rope_theta = rope_theta
        self.softmax_scale = check_softmax_scale(softmax_scale, (head_dim + rope_dim) ** -0.5)
        self.path, self.impl, self.kv_norm, self.norm_eps = path, impl, kv_norm, norm_eps
        qd = num_heads * (head_dim + rope_dim)
        if q_rank is None:
            self.q_proj = nn.Linear(hidden_size, qd, bias=False, **fk)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_rank, bias=False, **fk)
            self.q_a_layernorm = RMSNorm(q_rank, norm_eps, **fk)
            self.q_b_proj = nn.Linear(q_rank, qd, bias=False, **fk)
        self.kv_a_proj = nn.Linear(hidden_size, kv_rank + rope_dim, bias=False, **fk)
        self.kv_a_layernorm = RMSNorm(kv_rank, norm_eps, **fk) if kv_norm else nn.Identity()
        self.kv_b_proj = nn.Linear(kv_rank, num_groups * (head_dim + self.v_head_dim), bias=False, **fk)
        self.o_proj = nn.Linear(num_heads * self.v_head_dim, hidden_size, bias=False, **fk)
        self._absorbed: dict = {}
        self._rope_inv_freq_init = rope_inv_freq  # float64 on the CPU, or None: what reset_parameters writes back
        # a copy: a buffer aliasing the float64 tensor as int64 could not be saved with torch.save
        bits = None if rope_inv_freq is None else rope_inv_freq.contiguous().view(torch.int64).to(device, copy=True)
        self.register_buffer("rope_inv_freq_bits", bits)

    def __getstate__(self) -> dict:
        # the absorbed weights name their source weakly (not picklable): a copy computes its own
        state = super().__getstate__()
        state["_absorbed"] = {}
        return state

    def _apply(self, fn, recurse=True):
        # a cast of every tensor (``Module.type``) would convert the frequencies' bits as integers: they keep
        # their bits and follow the tensors' device only
        bits = self._buffers.get("rope_inv_freq_bits")
        out = super()._apply(fn, recurse)
        new = self._buffers.get("rope_inv_freq_bits")
        if bits is not None and new is not None and new.dtype != torch.int64:
            self._buffers["rope_inv_freq_bits"] = bits.to(new.device)
        return out

    def reset_parameters(self) -> None:
        """The layer's own state as the constructor makes it: the RoPE frequencies it was built with
        (``rope_inv_freq_bits``), e.g. after ``to_empty`` of a layer built on meta. The projections and norms are
        submodules with a ``reset_parameters`` of their own."""
        bits = self.rope_inv_freq_bits
        if bits is not None:
            with torch.no_grad():
                bits.copy_(self._rope_inv_freq_init.view(torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Every entry's shape is checked before any is copied (``_state.check_state_dict``), also inside a model's
        load; RoPE frequencies (``rope_inv_freq_bits``, int64) are refused by a layer built without
        ``rope_inv_freq`` even when not ``strict``: it would keep ``rope_theta``'s."""
        key = prefix + "rope_inv_freq_bits"
        check_rope_bits(key, state_dict.get(key))
        refused = () if self.rope_inv_freq_bits is not None else (
            ("rope_inv_freq_bits", "RoPE frequencies for a layer built without rope_inv_freq (it uses rope_theta's): "
                                   "build it with rope_inv_freq"),)
        check_state_dict(self, state_dict, prefix, refused, assign=assigning(args[0] if args else None))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a load that fails leaves every parameter and buffer of the layer as it was
        (the same objects, their values; ``_state.load_or_restore``) and the state dict's tensors untouched."""
        return load_or_restore(self, super().load_state_dict, state_dict, strict=strict, assign=assign)

    @property
    def rope_inv_freq(self) -> torch.Tensor | None:
        """Float64 ``[rope_dim / 2]`` inverse frequencies, or None (``rope_theta``'s)."""
        bits = self.rope_inv_freq_bits
        return None if bits is None else bits.view(torch.float64)

    def _rope_freqs(self, device: torch.device) -> torch.Tensor:
        """Float64 ``[rope_dim / 2]`` inverse frequencies on ``device`` for the kernels: ``rope_inv_freq`` or
        ``rope_theta``'s (made once per device, ``rope.cached_inv_freq``)."""
        inv = self.rope_inv_freq
        if inv is None:
            return cached_inv_freq(self.rope_dim, self.rope_theta, device)
        return inv if inv.device == device else inv.to(device)

    # ---- shapes / path choice -------------------------------------------------------------------------
    @property
    def layer_shape(self) -> dict:
        return dict(num_heads=self.num_heads, num_groups=self.num_groups, head_dim=self.head_dim,
                    v_head_dim=self.v_head_dim, rope_dim=self.rope_dim, kv_rank=self.kv_rank)

    def choose_path(self, *, batch: int = 1, seqlen: int = 8192, s_q: int = 1, device=None, gpu: str | None = None):
        """``choose_decode_path`` for this layer's shape (``path`` other than "auto" is an override)."""
        from .. import dispatch, roofline
        from ..decode_path import choose_decode_path

        if gpu is not None:
            if not isinstance(gpu, str):
                raise TypeError(f"gpu: expected None or a GPU name (str), got {type(gpu).__name__}")
            roofline.gpu_spec(gpu, name="gpu")  # an unknown name is refused as this argument
            info = gpu
        else:
            dev = check_device(device) or self.kv_b_proj.weight.device
            info = dispatch.device_info(dev) if (dev.type == "cuda" or dispatch.is_interpreter()) else "default"
        override = None if self.path == "auto" else self.path
        return choose_decode_path(self.layer_shape, s_q, info, batch=batch, seqlen=seqlen, override=override)

    def check_hidden(self, hidden_states) -> tuple[int, int]:
        """``forward``'s checks of ``hidden_states`` (a dense ``[B, T, hidden_size]`` tensor of the layer's dtype
        unless autocast is on, B, T >= 1); returns (B, T)."""
        check_dense("hidden_states", hidden_states)
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected shape [B, T, {self.hidden_size}], "
                             f"got {list(hidden_states.shape)}")
        if not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states: expected a floating dtype, got {hidden_states.dtype}")
        w_dtype, w_dev = self.o_proj.weight.dtype, self.o_proj.weight.device
        if hidden_states.device != w_dev:
            raise ValueError(f"hidden_states: expected a tensor on the layer's device {w_dev}, got one on "
                             f"{hidden_states.device}")
        if hidden_states.dtype != w_dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(f"hidden_states: expected the layer's dtype {w_dtype}, got {hidden_states.dtype}")
        B, T, _ = hidden_states.shape
        if B == 0 or T == 0:
            raise ValueError(f"hidden_states: expected B, T >= 1, got shape {list(hidden_states.shape)}")
        return B, T

    def make_cache(self, max_batch: int, max_seqlen: int, *, path: str | None = None, page_size: int = 64,
                   num_pages: int | None = None, dtype=None, device=None, s_q: int = 1, auto_reserve: bool = True,
                   k_scale=None):
        """Empty ``LatentCache`` (absorb) or ``GroupedCache`` (grouped) for this layer; "auto" asks dispatch (and
        takes the absorb path where the grouped kernels do not take the head dims, see ``gqa_decode``, or the cache
        is 8-bit, unless ``GQLA_TRITON_DECODE_PATH`` forces the grouped one: a ``ValueError``).
        ``dtype=torch.float8_e4m3fn``: the FP8 latent cache (absorb path only); with ``k_scale`` the float8 cache
        scaled per tensor (``LatentCache``). ``s_q``: query tokens per decode step (a positive int; it informs the
        "auto" choice). ``auto_reserve``: see ``PagedCache``."""
        path = self.path if path is None else path
        check_choice("path", path, _PATHS)
        if self.path != "auto" and path != self.path:  # forward would refuse the cache (_check_cache)
            raise ValueError(f"path: this layer decodes on path={self.path!r}, so its caches are too; got {path!r} "
                             "(a layer made with path='auto' takes either)")
        check_positive_int("max_batch", max_batch)
        check_positive_int("max_seqlen", max_seqlen)
        check_positive_int("s_q", s_q)
        w = self.kv_b_proj.weight
        device = check_device(device, storage=True) or w.device
        dtype = w.dtype if dtype is None else dtype
        if path == "auto":
            choice = self.choose_path(batch=max_batch, seqlen=max_seqlen, s_q=s_q, device=device)
            path = choice.path
            why = None
            if path == "grouped" and (k_scale is not None or (isinstance(dtype, torch.dtype) and dtype.itemsize == 1)):
                why = f"the grouped cache has no 8-bit layout, dtype {dtype}"
            elif path == "grouped":
                try:
                    _check_grouped_dims(self.impl, self.head_dim, self.v_head_dim, self.rope_dim)
                except ValueError as e:
                    why = str(e)
            if why is not None:
                if choice.reason == "override":  # GQLA_TRITON_DECODE_PATH forces it: no silent other path
                    raise ValueError(f"GQLA_TRITON_DECODE_PATH=grouped forces a path that cannot hold this layer's "
                                     f"cache ({why}); unset it, or make the cache with path='absorb'")
                path = "absorb"  # the one path that takes these dims and this cache
        if path == "absorb":
            # an 8-bit latent cache computes in the layer's dtype where it serves it
            compute = (w.dtype if dtype == torch.float8_e4m3fn
                       and w.dtype in latent_compute_dtypes(dtype, k_scale is not None) else None)
            return LatentCache(max_batch, max_seqlen, self.kv_rank, self.rope_dim, page_size=page_size,
                               num_pages=num_pages, dtype=dtype, device=device, auto_reserve=auto_reserve,
                               compute_dtype=compute, k_scale=k_scale)
        if k_scale is not None:
            raise ValueError("k_scale: scales the absorb path's float8 latent cache (path='absorb'); the grouped "
                             "cache has no 8-bit layout")
        _check_grouped_dims(self.impl, self.head_dim, self.v_head_dim, self.rope_dim)
        return GroupedCache(max_batch, max_seqlen, self.num_groups, self.head_dim, self.rope_dim, self.v_head_dim,
                            page_size=page_size, num_pages=num_pages, dtype=dtype, device=device,
                            auto_reserve=auto_reserve)

    # ---- weights --------------------------------------------------------------------------------------
    def w_uk_uv(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [g, d_h, r]`` and ``W_UV [g, d_v, r]`` (views of ``kv_b_proj.weight``, differentiable)."""
        check_float_dtype(dtype)
        w = self.kv_b_proj.weight
        if dtype is not None:
            w = w.to(dtype)
        w = w.view(self.num_groups, self.head_dim + self.v_head_dim, self.kv_rank)
        return w[:, : self.head_dim], w[:, self.head_dim:]

    def absorbed_weights(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorb-path weights ``W_UK [g, d_h, r]``, ``W_UV [g, d_v, r]`` contiguous in ``dtype``, computed once
        and reused until ``kv_b_proj.weight`` changes (tracked by its version counter, storage and address; also
        across ``weight.data = ...``; an entry is dropped when its weight's storage is freed, e.g. by
        ``layer.to(...)``; an in-place write through ``weight.data``, which has a version counter of its
        own, is not seen: the layer's own decode steps read ``w_uk_uv`` instead).
        Under autograd with a trainable weight they are recomputed (and differentiable); under torch.compile
        they are the views of ``w_uk_uv`` (the compiled graph reads the weight directly). A weight made under
        ``torch.inference_mode()`` keeps no version counter: they are computed on every call. Kept weights are
        normal tensors, also when made inside inference mode."""
        check_float_dtype(dtype)
        w = self.kv_b_proj.weight
        dtype = dtype or w.dtype
        if (torch.is_grad_enabled() and w.requires_grad) or torch.compiler.is_compiling():
            return self.w_uk_uv(dtype)
        if w.is_inference():
            uk, uv = self.w_uk_uv(dtype)
            return uk.contiguous(), uv.contiguous()
        key = (w._version, w.data_ptr(), w.stride(), w.device, dtype)
        storage = w.untyped_storage()
        hit = self._absorbed.get(dtype)
        if hit is None or hit[0] != key or hit[3]() is not storage:
            # the entry names the weight's storage weakly (``weight.data = ...`` keeps the version counter, and a new
            # storage may take a freed one's address): it is dropped when that storage is freed (``layer.to(...)``)
            # copies, never views (a one-group W_UK is a contiguous view of the weight): the entry holds no weight;
            # normal tensors also when made inside inference mode (autograd may read the entry outside it)
            with torch.inference_mode(False), torch.no_grad():
                uk, uv = (t.clone(memory_format=torch.contiguous_format) for t in self.w_uk_uv(dtype))
            hit = (key, uk, uv, weakref.ref(storage, drop_when_freed(self, "_absorbed", dtype, 3)))
            self._absorbed[dtype] = hit
        return hit[1], hit[2]

    # ---- projections ----------------------------------------------------------------------------------
    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        B, T, _ = x.shape
        h, dh, dR, r = self.num_heads, self.head_dim, self.rope_dim, self.kv_rank
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, h, dh + dR)
        kv = self.kv_a_proj(x)
        c = self.kv_a_layernorm(kv[..., :r])
        # one rotation for the h query rope parts and the shared rope key (same positions)
        roped = apply_rope(torch.cat([q[..., dh:], kv[..., None, r:]], 2), positions, self.rope_theta,
                           inv_freq=self.rope_inv_freq)
        return q[..., :dh], roped[:, :, :h], c, roped[:, :, h]

    def _expand(self, c: torch.Tensor):
        B, T, _ = c.shape
        kv = self.kv_b_proj(c).view(B, T, self.num_groups, self.head_dim + self.v_head_dim)
        return kv[..., : self.head_dim], kv[..., self.head_dim:]

    def _check_positions(self, positions, B: int, T: int, device) -> torch.Tensor:
        check_tensor("positions", positions)
        check_positions(positions, (None,) * positions.dim())  # an integer tensor, not uint64; the shapes below
        if positions.dim() == 1 and positions.shape[0] == T:
            positions = positions[None].expand(B, T)
        if list(positions.shape) != [B, T]:
            raise ValueError(f"positions: expected shape [{B}, {T}] or [{T}], got {list(positions.shape)}")
        if positions.device.type == "meta":
            raise ValueError(f"positions: expected a tensor on the CPU or on {device}, got one on meta (no values)")
        return positions.to(device)

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor | None = None, cache=None, *,
                seq_ids=None, indices: torch.Tensor | None = None,
                topk_length: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [B, T, hidden]`` -> ``[B, T, hidden]``.

        ``cache`` (``LatentCache`` / ``GroupedCache``, on the device of ``hidden_states``) receives the new
        tokens of slots ``seq_ids``: a host sequence of ``B`` distinct ints (validated on the host; its device
        index is made once per tuple and cached), default ``0 .. B-1``. When no slot holds tokens yet
        (host flags, ``cache.holds_tokens``), or without a cache, attention is causal prefill over the T
        tokens (SDPA, differentiable); otherwise the T new tokens decode against the cache (MTP when T > 1).
        ``positions [B, T]`` or ``[T]`` (int) rotate the rope parts; default: each slot's cached length
        (``cache_seqlens``, read on the device) + 0..T-1, or 0..T-1 for prefill.

        A decode step makes no host sync and no host-to-device copy, so it can be captured in a CUDA graph or
        compiled with ``torch.compile(fullgraph=True)``: reserve the cache pages before (``cache.reserve``).
        Every check runs before the cache is written: a call that raises leaves the cache unchanged.
        Sparse decode: ``indices [B, T, topk]`` int32 logical positions (shared by all heads and groups; -1 and
        out-of-range entries ignored, duplicates count twice as the kernels do), ``topk_length [B]`` int32.
        """
        B, T = self.check_hidden(hidden_states)
        dev = hidden_states.device
        ids, decode = None, False
        if cache is not None:
            self._check_cache(cache)
            if dev != cache.device:
                raise ValueError(f"hidden_states: expected a tensor on the cache's device {cache.device}, got one "
                                 f"on {dev}")
            ids = cache._slots(seq_ids, B)
            holds = cache._holds
            decode = any(holds[s] for s in ids)
        elif seq_ids is not None:
            raise ValueError("seq_ids: given without a cache")
        for name, t in (("indices", indices), ("topk_length", topk_length)):
            if t is not None:
                check_dense(name, t)
        if indices is not None:
            if not decode:
                raise ValueError("indices: sparse attention is a decode option (needs a cache holding tokens)")
            if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or list(indices.shape[:2]) != [B, T]:
                raise ValueError(f"indices: expected shape [{B}, {T}, topk], got "
                                 f"{list(indices.shape) if isinstance(indices, torch.Tensor) else indices}")
            if indices.dtype != torch.int32:
                raise TypeError(f"indices: expected int32, got {indices.dtype}")
        elif topk_length is not None:
            raise ValueError("topk_length: given without indices")
        if decode:
            cache._check_reads(indices=indices, topk_length=topk_length)
        idx = cache._index_of(ids) if decode and seq_ids is not None else None
        add_t = False  # pos[b, t] + t: the default decode positions, read in the kernels from the cached lengths
        if positions is not None:
            pos = self._check_positions(positions, B, T, dev)
        elif decode:
            past = cache.cache_seqlens[:B] if idx is None else cache.cache_seqlens.index_select(0, idx)
            pos, add_t = past[:, None].expand(B, T), True
        else:
            pos = torch.arange(T, device=dev)[None].expand(B, T)
        if decode and self.impl != "reference":
            wdt = self.kv_a_proj.weight.dtype
            if wdt not in FLOAT_DTYPES:  # (before the step writes the cache)
                raise TypeError(f"GQLAttention: a {wdt} layer decodes with impl='reference' only (the decode kernels "
                                f"take bfloat16 / float16 / float32; this layer has impl={self.impl!r})")
            cdt = cache.compute_dtype if isinstance(cache, LatentCache) else cache.dtype
            if cdt not in FLOAT_DTYPES:
                raise TypeError(f"cache: a {cdt} cache decodes with impl='reference' only (the decode kernels take "
                                f"bfloat16 / float16 / float32; this layer has impl={self.impl!r})")
            o = self._decode_step(hidden_states, pos, add_t, cache, ids, idx, indices, topk_length)
            return self.o_proj(o.reshape(B, T, self.num_heads * self.v_head_dim).to(hidden_states.dtype))
        if add_t:
            pos = pos + torch.arange(T, device=dev)
        q_nope, q_rope, c, k_rope = self._project(hidden_states, pos)
        if not decode:
            k_nope, v = self._expand(c)
            if isinstance(cache, LatentCache):
                cache._append(ids, c, k_rope)
            elif cache is not None:
                cache._append(ids, k_nope, v, k_rope)
            o = self._prefill(q_nope, q_rope, k_nope, k_rope, v)
        else:
            decode_ref = self._decode_absorb if isinstance(cache, LatentCache) else self._decode_grouped
            o = decode_ref(q_nope, q_rope, c, k_rope, cache, ids, idx, indices, topk_length)
            if torch.is_grad_enabled() and o.requires_grad:  # as the kernels' decode ops: no silent wrong gradient
                o = _ForwardOnlyDecode.apply(o)
        return self.o_proj(o.reshape(B, T, self.num_heads * self.v_head_dim).to(hidden_states.dtype))

    def _check_cache(self, cache) -> None:
        if isinstance(cache, LatentCache):
            if self.path == "grouped":
                raise ValueError("cache: a LatentCache needs path 'absorb' or 'auto' (this layer has path='grouped')")
            if cache.kv_rank != self.kv_rank or cache.rope_dim != self.rope_dim:
                raise ValueError(f"cache: LatentCache kv_rank/rope_dim {cache.kv_rank}/{cache.rope_dim} != layer's "
                                 f"{self.kv_rank}/{self.rope_dim}")
        elif isinstance(cache, GroupedCache):
            if self.path == "absorb":
                raise ValueError("cache: a GroupedCache needs path 'grouped' or 'auto' (this layer has path='absorb')")
            if (cache.num_groups, cache.head_dim, cache.v_head_dim, cache.rope_dim) != (
                    self.num_groups, self.head_dim, self.v_head_dim, self.rope_dim):
                raise ValueError("cache: GroupedCache shape (g, d_h, d_v, d_R) "
                                 f"{(cache.num_groups, cache.head_dim, cache.v_head_dim, cache.rope_dim)} != layer's "
                                 f"{(self.num_groups, self.head_dim, self.v_head_dim, self.rope_dim)}")
        else:
            raise TypeError(f"cache: expected a LatentCache or GroupedCache, got {type(cache).__name__}")

    def _prefill(self, q_nope, q_rope, k_nope, k_rope, v) -> torch.Tensor:
        """Causal grouped attention with SDPA: [B, T, h, d_v]."""
        B, T, h, _ = q_nope.shape
        rep = h // self.num_groups
        q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(B, T, self.num_groups, self.rope_dim)], -1)
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        vv = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=self.softmax_scale)
        return o.transpose(1, 2)

    def _decode_step(self, x, pos, add_t: bool, cache, ids, idx, indices, topk_length) -> torch.Tensor:
        """A decode step with the kernels (either path): ``x [B, T, hidden]`` -> ``[B, T, h, d_v]`` (o_proj's
        input). The attention op is validated once, before the cache is written, then run unvalidated."""
        from ..ops.gqa import api as gqa
        from ..ops.mla import api as mla

        B, T, _ = x.shape
        h, dh, dR, r = self.num_heads, self.head_dim, self.rope_dim, self.kv_rank
        absorb = isinstance(cache, LatentCache)
        inv = self._rope_freqs(x.device)
        qn = self.q_a_layernorm if self.q_rank is not None else None
        kvn = self.kv_a_layernorm if self.kv_norm else None
        qa = self.q_a_proj(x) if qn is not None else None
        kv = self.kv_a_proj(x)
        # the cache row [RMSNorm(c) | rope(k_rope)]: the cache's dtype (absorb) or c's (grouped: kv_b_proj's input)
        qa, row, cos_sin = norm_rope(qa, None if qn is None else qn.weight, kv, None if kvn is None else kvn.weight,
                                     pos, inv, add_t=add_t, kv_rank=r, qa_eps=0.0 if qn is None else qn.eps,
                                     kv_eps=0.0 if kvn is None else kvn.eps,
                                     out_dtype=cache.compute_dtype if absorb else kv.dtype)
        q = (self.q_proj(x) if self.q_rank is None else self.q_b_proj(qa)).view(B, T, h, dh + dR)
        c, k_rope = row[..., :r], row[..., r:]
        bt, sl = cache.block_table[:B], cache.cache_seqlens[:B]
        if absorb:
            w_uk, w_uv = self.w_uk_uv()
            q = absorb_q(q, w_uk, cos_sin, head_dim=dh, out_dtype=cache.compute_dtype)
            key, scale, impl, causal, splits, _ = mla._checked(q, cache.kv, bt, sl, r, self.softmax_scale, True,
                                                               indices, topk_length, 0, self.impl, None,
                                                               cache.k_descale)
            if impl == "gluon":
                mla._use_gluon(impl, q, cache.kv, r, indices is not None, cache.k_descale is not None)
            fn = mla._runner(key, q, cache.kv, bt, r, indices, splits, impl, None, cache.k_descale, None)
            cache._append(ids, c, k_rope, idx)
            if idx is not None:
                bt, sl = cache._rows(idx, B)
            out, _ = fn(q, cache.kv, bt, sl, r, scale, causal, indices, topk_length, splits, impl, None,
                        cache.k_descale)
            return absorb_o(out, w_uv)
        k_nope, v = self._expand(c)
        q = grouped_q(q, cos_sin, head_dim=dh, out_dtype=cache.dtype)
        kr = cache.k_rope if dR > 0 else None
        key, scale, impl, causal, splits = gqa._checked(q, cache.k, cache.v, bt, sl, kr, self.softmax_scale, True,
                                                        indices, topk_length, 0, self.impl)
        fn = gqa._runner(key, q, cache.k, cache.v, bt, kr, indices, splits, impl)
        cache._append(ids, k_nope, v, k_rope, idx)
        if idx is not None:
            bt, sl = cache._rows(idx, B)
        out, _ = fn(q, cache.k, cache.v, bt, sl, kr, scale, causal, indices, topk_length, splits, impl)
        return out

    def _decode_absorb(self, q_nope, q_rope, c, k_rope, cache: LatentCache, ids, idx, indices,
                       topk_length) -> torch.Tensor:
        """The absorb step in torch ops (``impl="reference"``): einsums with ``W_UK`` / ``W_UV`` around
        ``latent_cache_attention``."""
        from ..ops.mla import api as mla

        B, T, h, dh = q_nope.shape
        g, r = self.num_groups, self.kv_rank
        w_uk, w_uv = self.w_uk_uv(q_nope.dtype)  # read each step: no cache to miss a write through weight.data
        q_lat = torch.einsum("btgjd,gdr->btgjr", q_nope.reshape(B, T, g, h // g, dh), w_uk).reshape(B, T, h, r)
        q = torch.cat([q_lat, q_rope], -1).to(cache.compute_dtype).contiguous()
        # every check of the attention op (on the tables' shapes) before the cache is written
        mla._validate(q, cache.kv, cache.block_table[:B], cache.cache_seqlens[:B], r, self.softmax_scale, True,
                      indices, topk_length, 0, self.impl, None, cache.k_descale)
        cache._append(ids, c, k_rope, idx)
        out = latent_cache_attention(q, cache, ids, r, self.softmax_scale, indices, topk_length)
        out = out.to(w_uv.dtype).reshape(B, T, g, h // g, r)
        return torch.einsum("btgjr,gvr->btgjv", out, w_uv).reshape(B, T, h, self.v_head_dim)

    def _decode_grouped(self, q_nope, q_rope, c, k_rope, cache: GroupedCache, ids, idx, indices,
                        topk_length) -> torch.Tensor:
        """The grouped step in torch ops (``impl="reference"``): ``kv_b_proj`` and ``grouped_cache_attention``."""
        from ..ops.gqa import api as gqa

        B = q_nope.shape[0]
        k_nope, v = self._expand(c)
        q = torch.cat([q_nope, q_rope], -1).to(cache.dtype).contiguous()
        kr = cache.k_rope if self.rope_dim > 0 else None
        gqa._validate(q, cache.k, cache.v, cache.block_table[:B], cache.cache_seqlens[:B], kr, self.softmax_scale,
                      True, indices, topk_length, 0, self.impl)
        cache._append(ids, k_nope, v, k_rope, idx)
        return grouped_cache_attention(q, cache, ids, self.head_dim, self.softmax_scale, indices, topk_length)

    # ---- tensor parallel ------------------------------------------------------------------------------
    def shard(self, tp_rank: int, tp_size: int) -> GQLAttention:
        """Tensor-parallel shard holding groups ``[rank·g/tp, (rank+1)·g/tp)`` and their query heads.

        q (or q_b) and kv_b rows are column-parallel, o_proj columns row-parallel; kv_a_proj, q_a_proj and the
        norms are replicated. Summing the shards' outputs gives the full layer's output.
        """
        check_rank(tp_rank, tp_size)
        if self.num_groups % tp_size:
            raise ValueError(f"tp_size: expected a positive divisor of num_groups {self.num_groups}, got {tp_size!r}")
        tp_rank, tp_size = int(tp_rank), int(tp_size)
        g, h = self.num_groups // tp_size, self.num_heads // tp_size
        w = self.kv_b_proj.weight
        out = GQLAttention(self.hidden_size, h, g, self.head_dim, self.rope_dim, self.kv_rank, self.q_rank,
                           self.v_head_dim, self.rope_theta, self.softmax_scale, self.path, self.impl,
                           device=w.device, dtype=w.dtype, kv_norm=self.kv_norm, norm_eps=self.norm_eps,
                           rope_inv_freq=self.rope_inv_freq)
        qd, kvd, vd = self.head_dim + self.rope_dim, self.head_dim + self.v_head_dim, self.v_head_dim
        hs = slice(tp_rank * h, (tp_rank + 1) * h)
        gs = slice(tp_rank * g, (tp_rank + 1) * g)
        with torch.no_grad():
            if self.q_rank is None:
                out.q_proj.weight.copy_(self.q_proj.weight.view(self.num_heads, qd, -1)[hs].reshape(h * qd, -1))
            else:
                out.q_a_proj.weight.copy_(self.q_a_proj.weight)
                out.q_a_layernorm.weight.copy_(self.q_a_layernorm.weight)
                out.q_b_proj.weight.copy_(self.q_b_proj.weight.view(self.num_heads, qd, -1)[hs].reshape(h * qd, -1))
            out.kv_a_proj.weight.copy_(self.kv_a_proj.weight)
            if self.kv_norm:
                out.kv_a_layernorm.weight.copy_(self.kv_a_layernorm.weight)
            out.kv_b_proj.weight.copy_(w.view(self.num_groups, kvd, -1)[gs].reshape(g * kvd, -1))
            ow = self.o_proj.weight.view(self.hidden_size, self.num_heads, vd)[:, hs]
            out.o_proj.weight.copy_(ow.reshape(self.hidden_size, h * vd))
        return out

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, h_q={self.num_heads}, g={self.num_groups}, d_h={self.head_dim}, "
                f"d_v={self.v_head_dim}, d_R={self.rope_dim}, r={self.kv_rank}, q_rank={self.q_rank}, "
                f"path={self.path!r}, impl={self.impl!r}")
