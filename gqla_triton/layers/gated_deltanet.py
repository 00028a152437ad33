"""Gated DeltaNet block (Qwen3-Next style) with a per-sequence conv + recurrent state cache.

``x [B, T, hidden]`` -> q, k ``[.., H·K]``, v, z ``[.., HV·V]``, b, a ``[.., HV]`` (one fused linear projection,
``in_proj``); short causal depthwise conv (width ``conv_size``) + SiLU over ``[q; k; v]``; q, k L2-normalised per head
(inside the op); ``g = -exp(A_log)·softplus(a + dt_bias)``, ``beta = sigmoid(b)``; the gated delta rule
(``chunk_gated_delta_rule`` for prefill/training, ``gated_delta_rule_decode`` for decode steps);
gated RMSNorm per value head ``RMSNorm(o)·w·silu(z)``; output projection back to ``hidden``.

Serving: ``GatedDeltaNetCache`` holds one row per sequence slot. A decode step reads and writes the rows of its
slots with device ops only (no host sync, no host-to-device copy, no branch on device values), so it can be
captured in a CUDA graph or compiled with ``torch.compile(fullgraph=True)``. A verify step (``verify=True``)
decodes draft tokens without committing them; ``GatedDeltaNetCache.commit(accepted)`` then advances every
sequence by its accepted tokens. Without ``cu_seqlens`` a decode step of the kernel impls is five launches:
``in_proj``, ``gdn_decode_prep`` (conv, gates, conv rows and lengths), ``gated_delta_rule_decode``,
``gdn_gated_norm`` and ``o_proj`` (``gdn_step.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common.impl import check_impl
from ..ops._common.validation import (
    FLOAT_DTYPES,
    check_dense,
    check_device,
    check_disjoint,
    check_float_dtype,
    check_inference_mode,
    check_int_in,
    check_kernel_device,
    check_norm_eps,
    check_optional_int,
    check_positive_int,
    check_tensor,
)
from ..ops.gdn import chunk_gated_delta_rule, gated_delta_rule_decode
from ..ops.gdn import plan as gdn_plan
from ..ops.gdn.decode import check_launch, sequence_count
from ..ops.gdn.reference import recurrent_gated_delta_rule_ref
from ._state import assigning, check_state_dict, entry_problem, load_or_restore
from .gdn_step import add_token_counts, gdn_decode_prep, gdn_gated_norm
from .norm import gated_rms_norm

__all__ = ["GatedDeltaNet", "GatedDeltaNetCache"]

_REF = "gqla_triton.layers.GatedDeltaNet"


def _check_kernel_dtype(impl: str, dtype: torch.dtype, name: str) -> None:
    """The Triton kernels take bfloat16 / float16 / float32 only; float64 is for impl='reference'."""
    if impl != "reference" and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: impl={impl!r} runs the Triton kernels, which take bfloat16, float16 or float32; got "
                        f"{str(dtype).replace('torch.', '')} (impl='reference' takes any float dtype)")


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The cache rows of one call's sequences.

    ``ids``: the host slot ids (None for a device slot tensor). ``slots [n] int32``: the host ids on the device, or
    the device slot tensor as given (never read on the host; entries outside ``[0, num_seqs)`` are skipped).
    ``op [n] int32``: pool rows for the ops, negative = skipped. ``write [n] int64``: rows of the scratch-extended
    buffers (a skipped sequence maps to the scratch row ``num_seqs``). ``live [n] bool``: which sequences are live
    (None: all, host slots). For a device slot tensor ``op``, ``write`` and ``live`` are None until ``resolved``
    makes them (device ops), on the paths that read them; the fused decode step reads ``slots`` itself.
    """

    ids: tuple[int, ...] | None
    slots: torch.Tensor
    op: torch.Tensor | None
    write: torch.Tensor | None
    live: torch.Tensor | None

    def resolved(self, num_seqs: int) -> _Batch:
        if self.op is not None:
            return self
        s = self.slots
        live = (s >= 0) & (s < num_seqs)
        return _Batch(None, s, torch.where(live, s, -1), torch.where(live, s, num_seqs).long(), live)


@dataclasses.dataclass(frozen=True)
class _Draft:
    """A verify step awaiting ``commit``: the pool rows ``op [n]`` int32 of its sequences (negative = skipped) and
    their rows ``write [n]`` int64 of the scratch-extended buffers (None: made from ``op``), the draft tokens'
    pre-conv inputs ``xf [tokens, conv_dim]`` (``tokens`` of them per sequence without ``cu_seqlens``, in all with
    it), the inputs of the recurrence (q, k, v, g, beta as the decode op took them), ``cu_seqlens`` (packed drafts)
    and the decode op's impl."""

    op: torch.Tensor
    write: torch.Tensor | None
    xf: torch.Tensor
    qkvgb: tuple[torch.Tensor, ...]
    tokens: int
    cu_seqlens: torch.Tensor | None
    impl: str


def _packed_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bos [N], eos [N])`` int64 of packed sequences, clamped as the decode kernel clamps them
    (``_clamped_bounds``; device ops, no value is read on the host)."""
    cu = _clamped_bounds(cu_seqlens, T)
    return cu[:-1], cu[1:]


def _windows(old: torch.Tensor, xf: torch.Tensor, seq: torch.Tensor, bos: torch.Tensor,
             pos: torch.Tensor) -> torch.Tensor:
    """Entries of the virtual per-sequence streams ``[old[n] (W-1 entries), xf[bos[n]], xf[bos[n] + 1], ...]``.

    ``old [N, W-1, C]``, ``xf [L, C]``; ``seq [R]`` (sequence of each query row), ``bos [R]`` (its first token in
    ``xf``), ``pos [R, M]`` (virtual positions). Returns ``[R, M, C]``. Every index is clamped into the
    concatenated buffer, so no position can read outside it."""
    N, W1, C = old.shape
    ext = torch.cat([old.reshape(N * W1, C), xf], 0)
    idx = torch.where(pos < W1, seq[:, None] * W1 + pos, N * W1 + bos[:, None] + pos - W1)
    return ext[idx.clamp(0, ext.shape[0] - 1)]


def _clamped_bounds(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``cu_seqlens [N+1]`` as the chunked op's device plan takes it (``ops/gdn/plan.py``): each bound clamped to
    ``[0, T]``, then their running maximum (int64, device ops; a well-formed cu_seqlens is unchanged). Sequence n owns
    tokens ``[cu[n], cu[n+1])``; tokens outside ``[cu[0], cu[N])`` are padding."""
    return torch.cummax(cu_seqlens.long().clamp(0, T), 0).values


def _depthwise_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Valid depthwise conv along time: ``x [B, L, C]``, ``w [C, 1, W]`` -> ``[B, L - W + 1, C]`` in x's dtype. On the
    CPU as W shifted multiply-adds in at least float32 (torch's CPU depthwise conv1d is orders of magnitude
    slower at these shapes), elsewhere ``F.conv1d``."""
    if x.device.type != "cpu":
        return F.conv1d(x.transpose(1, 2), w, groups=x.shape[-1]).transpose(1, 2)
    W = w.shape[-1]
    L = x.shape[1] - W + 1
    cdt = torch.promote_types(x.dtype, torch.float32)
    wc = w[:, 0].t().to(cdt)  # [W, C]
    y = x[:, 0:L].to(cdt) * wc[0]
    for j in range(1, W):
        y = y + x[:, j:j + L].to(cdt) * wc[j]
    return y.to(x.dtype)

def _hf_tensor(state_dict, prefix: str, key: str, layer: str = "a Qwen3-Next linear-attention layer") -> torch.Tensor:
    """``state_dict[prefix + key]``, checked to be a floating-point tensor (``layer`` names whose weight it is)."""
    name = prefix + key
    if name not in state_dict:
        raise ValueError(f"state_dict: missing {name!r} ({layer}'s weight)")
    t = state_dict[name]
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"state_dict: {name} must be a floating-point tensor, got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
        raise ValueError(f"state_dict: {name} must be a dense tensor holding values, got a "
                         f"{'nested' if t.is_nested else t.layout} tensor on {t.device}")
    if t.element_size() < 2:
        raise TypeError(f"state_dict: {name} is {t.dtype}: float8 weights need their scales; dequantise them first")
    if not torch.isfinite(t.detach()).all():
        raise ValueError(f"state_dict: {name} has non-finite values")
    return t.detach()


def _layer_weights(state_dict, prefix: str, want: dict[str, tuple[int, ...]], layer: str) -> dict[str, torch.Tensor]:
    """The tensors ``want`` names (key after ``prefix`` -> shape) of ``layer``'s weights in ``state_dict``, each
    checked (``_hf_tensor``, then its shape); a key under ``prefix`` that ``want`` does not name is a ``ValueError``."""
    if not hasattr(state_dict, "keys"):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    extra = sorted(key for key in state_dict.keys()
                   if isinstance(key, str) and key.startswith(prefix) and key[len(prefix):] not in want)
    if extra:
        raise ValueError(f"state_dict: unexpected keys {extra} ({layer} has {[prefix + key for key in want]})")
    t = {}
    for key, shape in want.items():
        t[key] = _hf_tensor(state_dict, prefix, key, layer)
        if tuple(t[key].shape) != shape:
            raise ValueError(f"state_dict: {prefix + key} has shape {list(t[key].shape)}, the layer's sizes give "
                             f"{list(shape)}")
    return t


def _joined(state_dict, keys: list[str], slices, assign: bool) -> torch.Tensor:
    """The entries ``keys`` of ``state_dict`` (removed from it) joined along dim 0, each checked first as the slice
    of the parameter it fills (``entry_problem``; a ``ValueError`` naming the key, the state dict unchanged)."""
    for k, t in zip(keys, slices, strict=True):
        why = entry_problem(state_dict[k], t, assign=assign)
        if why is not None:
            raise ValueError(f"state_dict: {k}: {why}")
    return torch.cat([state_dict.pop(k) for k in keys], 0)


def _copy_all(module: nn.Module, pairs) -> None:
    """Copy each ``(parameter, source)`` pair's source into its parameter of ``module``; every source is put in its
    parameter's form before the first copy, so a call that fails changes no parameter. A finite source that the
    parameter's dtype cannot hold (it would load as inf) is a ``ValueError`` naming the parameter, and so is a
    parameter on the meta device (it holds no values)."""
    names = {id(p): n for n, p in module.named_parameters()}
    for p, _ in pairs:
        if p.device.type == "meta":
            raise ValueError(f"{names.get(id(p), 'a parameter')}: the layer is on the meta device (its parameters hold "
                             "no values); to_empty(device=...) it before loading weights")
    ready = [src.reshape(p.shape).to(device=p.device, dtype=p.dtype, copy=True) for p, src in pairs]
    for (p, _), src in zip(pairs, ready, strict=True):
        if not bool(torch.isfinite(src).all()):  # the sources are checked finite: the cast overflowed
            raise ValueError(f"state_dict: the weights of {names.get(id(p), 'a parameter')} pass {p.dtype}'s range "
                             "(they would load as inf); make the layer in a wider dtype")
    with torch.no_grad():
        for (p, _), src in zip(pairs, ready, strict=True):
            p.copy_(src)


class GatedDeltaNetCache:
    """State of one ``GatedDeltaNet`` layer for ``num_seqs`` sequence slots (one row per slot).

    Tensors (device):
        conv_state ``[num_seqs, conv_dim, conv_size - 1]``: the last pre-conv inputs of each slot, layer dtype.
        recurrent_state ``[num_seqs, HV, K, V]`` fp32 (fp64 for a fp64 layer): the decode op's in-place pool.
        seqlens ``[num_seqs]`` int32: tokens fed through the layer per slot (saturating at 2^31 − 1).
    Host: one flag per slot, "holds a state" (``holds``), set by a prefill and cleared by ``reset`` / ``free``; it
    decides between prefill and decode for host slot ids and does not change across decode steps.

    ``slots`` (attribute, default None = ``0..n-1``): the slots used by forward calls that pass none.

    A forward's ``slots`` are either a host sequence of ints (checked: ints in ``[0, num_seqs)``, distinct; its
    device index tensors are made once per distinct tuple and reused, 256 tuples kept, the least recently used out
    first, and a tuple that a CUDA graph captured never: a tuple other than ``0..n-1`` is copied to the device on its
    first use, so use it once before capturing a CUDA graph) or a device int32 tensor ``[n]``, which
    always runs a decode step and is never read on the host: a negative entry is padding (that sequence is skipped,
    its output is 0 and no row is touched), an entry ``>= num_seqs`` is skipped alike. Live entries must be distinct
    and name slots that hold a state (or were ``reset``: a zeroed row decodes as a fresh sequence); a decode through a
    device tensor does not change the host flags.

    transformers' linear-attention cache holds per layer a conv state ``[batch, conv_dim, conv_size]`` (one column
    more than the ``conv_size - 1`` a next token reads) and the recurrent state ``[batch, HV, K, V]``, one row per
    batch row: ``load_hf_states`` takes them over into slots, ``hf_states`` gives them back in that layout.
    """

    _INDEX_CACHE = 256  # distinct host slot tuples whose device index tensors are kept

    def __init__(self, num_seqs: int, conv_dim: int, conv_size: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, *, device=None, dtype=torch.float32):
        for name, val, lo in (("num_seqs", num_seqs, 1), ("conv_dim", conv_dim, 1), ("conv_size", conv_size, 2),
                              ("num_v_heads", num_v_heads, 1), ("head_k_dim", head_k_dim, 1),
                              ("head_v_dim", head_v_dim, 1)):
            check_int_in(name, val, lo)
        check_float_dtype(dtype, optional=False)
        device = check_device(device, storage=True)
        # one scratch row past the slots receives the writes of skipped (padding) sequences
        self._conv = torch.zeros(num_seqs + 1, conv_dim, conv_size - 1, device=device, dtype=dtype)
        self.conv_state = self._conv[:num_seqs]
        sdt = torch.float64 if dtype == torch.float64 else torch.float32  # fp64 only for the reference impl
        self.recurrent_state = torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, device=device, dtype=sdt)
        self._lens = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
        self.seqlens = self._lens[:num_seqs]
        self.slots = None
        self._held = [False] * num_seqs
        self._index: collections.OrderedDict[tuple[int, ...], _Batch] = collections.OrderedDict()
        self._pinned: set[tuple[int, ...]] = set()  # tuples a CUDA graph captured: kept beyond _INDEX_CACHE
        self._draft: _Draft | None = None
        self._committed: _Draft | None = None  # a committed draft: its buffers stay alive until the next commit

    def __getstate__(self) -> dict:
        # conv_state and seqlens are views of the rows (which hold a scratch row past the slots); pickle copies each
        # tensor's storage on its own, so __setstate__ makes them again from the rows
        state = self.__dict__.copy()
        del state["conv_state"], state["seqlens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        n = self.recurrent_state.shape[0]
        self.conv_state, self.seqlens = self._conv[:n], self._lens[:n]

    @property
    def num_seqs(self) -> int:
        return self.recurrent_state.shape[0]

    @property
    def device(self) -> torch.device:
        return self.recurrent_state.device

    @property
    def pending(self) -> bool:
        """A verify step awaits ``commit``."""
        return self._draft is not None

    # ------------------------------------------------------------------------------------ host bookkeeping
    def _host_ids(self, slots, n: int | None, *, tensors: bool = False) -> tuple[int, ...]:
        if slots is None:
            if n is None:
                return tuple(range(self.num_seqs))
            if n > self.num_seqs:
                raise ValueError(f"slots: a batch of {n} sequences but the cache holds {self.num_seqs} slots")
            return tuple(range(n))
        if isinstance(slots, (str, bytes)) or not isinstance(slots, (list, tuple, range)):
            want = "a sequence of ints or an int32 tensor" if tensors else "a sequence of host slot ids (ints)"
            raise TypeError(f"slots: expected {want}, got {type(slots).__name__}")
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral):
                raise TypeError(f"slots: expected ints, got {type(s).__name__} {s!r}")
        ids = tuple(int(s) for s in slots)
        if n is not None and len(ids) != n:
            raise ValueError(f"slots: expected {n} slots (one per sequence), got {len(ids)}")
        for s in ids:
            if not 0 <= s < self.num_seqs:
                raise ValueError(f"slots: slot {s} outside [0, {self.num_seqs})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"slots: duplicate slots in {list(ids)}")
        return ids

    def _host_batch(self, ids: tuple[int, ...]) -> _Batch:
        """The index tensors of host slot ids, kept per tuple. ``0..n-1`` is made by a device op (capturable); any
        other tuple by a host-to-device copy on its first use. Tensors made while torch.compile traces or a CUDA
        graph captures are not kept (a captured tensor holds its values only once the graph replays); kept ones that
        a capture reads are pinned (never dropped)."""
        b = self._index.get(ids)
        tracing = torch.compiler.is_compiling()
        if b is not None:
            if not tracing:
                self._index.move_to_end(ids)
                if self._capturing():
                    self._pinned.add(ids)  # the graph reads these tensors at every replay: never drop them
            return b
        capturing = not tracing and self._capturing()
        if ids == tuple(range(len(ids))):
            op = torch.arange(len(ids), dtype=torch.int32, device=self.device)
        elif capturing:  # a host-to-device copy cannot be captured
            raise ValueError(f"slots: {list(ids)} have no device index yet; run one eager call with them before "
                             "capturing a CUDA graph (or pass a device int32 slot tensor)")
        else:
            op = torch.tensor(ids, dtype=torch.int32, device=self.device)
        b = _Batch(ids, op, op, op.long(), None)
        if not tracing and not capturing:
            self._index[ids] = b
            if len(self._index) > self._INDEX_CACHE + len(self._pinned):
                del self._index[next(k for k in self._index if k not in self._pinned)]
        return b

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _batch(self, slots, n: int) -> _Batch:
        """The rows of ``n`` sequences (validated; nothing is changed)."""
        if slots is None:
            slots = self.slots
        if isinstance(slots, torch.Tensor):
            check_tensor("slots", slots, shape=(n,), dtypes=(torch.int32,), device=self.device)
            if slots.device.type == "cpu" and not torch.compiler.is_compiling():  # read only where it costs no sync
                live = slots[(slots >= 0) & (slots < self.num_seqs)]  # the others are padding
                if live.unique().numel() != live.numel():
                    raise ValueError(f"slots: a slot is named by more than one sequence in {slots.tolist()}")
            return _Batch(None, slots, None, None, None)
        return self._host_batch(self._host_ids(slots, n, tensors=True))

    def _check_held(self, slots: torch.Tensor) -> None:
        """A slot tensor's live entries name slots that hold a state (a decode step continues one): checked where
        reading it costs no sync (a CPU tensor); on a device it is the caller's to ensure."""
        if slots.device.type == "cpu" and not torch.compiler.is_compiling():
            free = [s for s in slots[(slots >= 0) & (slots < self.num_seqs)].tolist() if not self._held[s]]
            if free:
                raise ValueError(f"slots: {free} hold no state (prefill them with host slot ids first)")

    def _check_reads(self, **reads: torch.Tensor | None) -> None:
        """The tensors a call reads (None: absent) share no memory with the rows it writes (``ValueError``)."""
        for name, t in (("cache.conv_state", self._conv), ("cache.recurrent_state", self.recurrent_state),
                        ("cache.seqlens", self._lens)):
            check_disjoint(name, t, **reads)

    def holds(self, slots=None) -> list[bool]:
        """Host flags: whether each of ``slots`` (host ids; default all) holds a sequence's state."""
        return [self._held[s] for s in self._host_ids(slots, None)]

    def _check_idle(self, what: str) -> None:
        check_inference_mode(what, self._lens)
        if self._draft is not None:
            raise ValueError(f"{what}: a verify step is pending; call commit(accepted) first (zeros keep every "
                             "sequence as it was before the verify step)")

    def reset(self, slots=None) -> None:
        """Zero the rows of ``slots`` (host ids; default all): states, lengths and flags; the slots are free."""
        ids = self._host_ids(slots, None)
        self._check_idle("reset")
        if not ids:
            return
        w = self._host_batch(ids).write
        with torch.no_grad():
            self._conv.index_fill_(0, w, 0)
            self.recurrent_state.index_fill_(0, w, 0)
            self._lens.index_fill_(0, w, 0)
        for s in ids:
            self._held[s] = False

    def free(self, slots=None) -> None:
        """Release the rows of ``slots`` (host ids; default all) for new sequences: flags cleared, lengths zeroed.
        The states are left in place (a prefill into a free slot starts from zero states regardless)."""
        ids = self._host_ids(slots, None)
        self._check_idle("free")
        if not ids:
            return
        with torch.no_grad():
            self._lens.index_fill_(0, self._host_batch(ids).write, 0)
        for s in ids:
            self._held[s] = False

    # ------------------------------------------------------------------------------------ speculative decoding
    def commit(self, accepted: torch.Tensor) -> None:
        """Finish the pending verify step: every sequence advances by its first ``accepted[n]`` draft tokens.

        ``accepted``: ``[n]`` int32 on the cache's device, one count per sequence of the verify step (clamped to
        ``[0, its draft tokens]``; 0 leaves the sequence as it was). Recurrent states, conv windows and lengths
        become those of a decode step over only the accepted tokens. Device ops only: capturable in a CUDA graph,
        with the verify step or in a graph of its own (the verify step's buffers stay referenced until the next
        commit, so a graph of each stays valid)."""
        check_inference_mode("commit", self._lens)
        d = self._draft
        if d is None:
            raise ValueError("commit: no verify step is pending (run the layer with verify=True first)")
        n = d.op.shape[0]
        check_tensor("accepted", accepted, shape=(n,), dtypes=(torch.int32,), device=self.device)
        with torch.no_grad():
            q, k, v, g, beta = d.qkvgb
            gated_delta_rule_decode(q, k, v, g, beta, self.recurrent_state, d.op, use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=d.cu_seqlens, accepted=accepted, impl=d.impl)
            dev = accepted.device
            seq = torch.arange(n, device=dev)
            if d.cu_seqlens is None:
                bos, a = seq * d.tokens, accepted.long().clamp(0, d.tokens)
            else:
                bos, eos = _packed_bounds(d.cu_seqlens, d.tokens)
                a = torch.minimum(accepted.long().clamp(min=0), eos - bos)
            write = d.write if d.write is not None else torch.where(d.op >= 0, d.op, self.num_seqs).long()
            W1 = self._conv.shape[2]
            old = self._conv[write].transpose(1, 2)
            pos = a[:, None] + torch.arange(W1, device=dev)
            win = _windows(old, d.xf, seq, bos, pos)
            self._conv.index_copy_(0, write, win.transpose(1, 2))
            add_token_counts(self._lens, write, a)
        self._draft, self._committed = None, d

    # ------------------------------------------------------------------------------------ transformers interop
    def load_hf_states(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, *, slots=None,
                       seqlen: int = 0) -> None:
        """Take over the states of a transformers linear-attention cache (Qwen3-Next) into host ``slots``.

        ``conv_state [n, conv_dim, W']`` (``Cache.get_conv_state(layer_idx)``, before transformers 5.24
        ``cache.layers[layer_idx].conv_states[0]``: transformers keeps the last ``W' = conv_size`` pre-conv inputs;
        the last ``conv_size - 1`` of them, all a next token's conv reads, are kept, so ``W' >= conv_size - 1``),
        ``recurrent_state [n, HV, K, V]`` (``get_recurrent_state``, or ``.recurrent_states[0]``), both on the
        cache's device, any float dtype (cast to the rows' dtypes). ``slots``: host slot ids (default ``0..n-1``).
        The slots then hold a state (the next call on them is a decode step or a continued prefill) and their
        ``seqlens`` become ``seqlen`` (transformers' linear cache does not count tokens). Both tensors are checked
        before any row changes.
        """
        for name, t in (("conv_state", conv_state), ("recurrent_state", recurrent_state)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name}: on {t.device}, the cache on {self.device}")
            if t.layout != torch.strided or t.is_nested:
                raise ValueError(f"{name}: expected a dense (strided) tensor, got a "
                                 f"{'nested' if t.is_nested else t.layout} one")
        C, W1 = self._conv.shape[1:]
        if conv_state.dim() != 3 or conv_state.shape[1] != C or conv_state.shape[2] < W1:
            raise ValueError(f"conv_state: expected [n, {C}, >= {W1}] (transformers' [batch, conv_dim, conv_size]), "
                             f"got {list(conv_state.shape)}")
        n = conv_state.shape[0]
        want = (n, *self.recurrent_state.shape[1:])
        if tuple(recurrent_state.shape) != want:
            raise ValueError(f"recurrent_state: expected {list(want)}, got {list(recurrent_state.shape)}")
        check_int_in("seqlen", seqlen, 0)
        if n == 0:
            raise ValueError("conv_state: expected at least one sequence")
        ids = self._host_ids(slots, n)
        self._check_idle("load_hf_states")
        w = self._host_batch(ids).write
        # copies in the rows' form first: the sources may be views of the rows themselves
        conv = conv_state.detach()[..., conv_state.shape[2] - W1:].to(self._conv.dtype, copy=True)
        rec = recurrent_state.detach().to(self.recurrent_state.dtype, copy=True)
        with torch.no_grad():
            self._conv.index_copy_(0, w, conv)
            self.recurrent_state.index_copy_(0, w, rec)
            self._lens.index_fill_(0, w, int(seqlen))
        for s in ids:
            self._held[s] = True

    def hf_states(self, slots=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of host ``slots`` (default all) in a transformers linear-attention cache's layout:
        ``(conv_state [n, conv_dim, conv_size], recurrent_state [n, HV, K, V])``, copies. The conv state's first
        column is zero: transformers keeps ``conv_size`` inputs, of which a next token's conv reads only the last
        ``conv_size - 1`` (the ones held here). A slot that holds no state (``holds``) gives zero states."""
        ids = self._host_ids(slots, None)
        w = self._host_batch(ids).write if ids else torch.zeros(0, dtype=torch.long, device=self.device)
        conv, rec = self._conv[w], self.recurrent_state[w]
        free = [i for i, s in enumerate(ids) if not self._held[s]]
        if free:  # rows a freed slot's last sequence left
            free = torch.tensor(free, dtype=torch.long, device=self.device)
            conv.index_fill_(0, free, 0)
            rec.index_fill_(0, free, 0)
        conv = torch.cat([conv.new_zeros(conv.shape[0], conv.shape[1], 1), conv], 2)
        return conv, rec


class GatedDeltaNet(nn.Module):
    """Qwen3-Next Gated DeltaNet layer.

    Args:
        hidden_size: model width. num_heads (H): q/k heads. num_v_heads (HV): value heads, ``HV % H == 0``.
        head_k_dim (K), head_v_dim (V): per-head dims. conv_size: short-conv width (>= 2).
        norm_eps: gated RMSNorm epsilon. layer_idx: position in the model (informational).
        impl: ``"auto"`` / ``"triton"`` (the Triton kernels: bfloat16, float16 or float32) or ``"reference"`` (pure
            torch, any device and dtype, float64 included; it reads slot rows and ``cu_seqlens`` on the host, so
            its decode and varlen calls are not for CUDA graphs or torch.compile).
        save_states: the chunked op keeps its per-chunk states for the backward (faster; about 4x the value
            tensor's size of extra activation memory) instead of recomputing them (``chunk_gated_delta_rule``).

    Parameters: ``in_proj`` (``nn.Linear(hidden, 2·H·K + 2·HV·V + 2·HV)``, no bias): the six input projections in
    one weight, output columns ``[q (H·K) | k (H·K) | v (HV·V) | z (HV·V) | b (HV) | a (HV)]`` (sizes
    ``in_proj_sizes``; ``split_in_proj`` splits a tensor along them, e.g. ``in_proj.weight`` into the
    per-projection weights, as views); ``conv1d`` (depthwise, channels ``[q; k; v]``), ``A_log``, ``dt_bias``
    ``[HV]``, ``norm_weight [V]``, ``o_proj`` (``nn.Linear(HV·V, hidden)``). ``load_state_dict`` also takes the
    input projections as six separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``z_proj`` / ``b_proj`` / ``a_proj``
    weights.

    ``forward(hidden_states, cache=None, cu_seqlens=None, *, slots=None, verify=False) -> [B, T, hidden]``; see
    ``forward``. ``GatedDeltaNet.from_hf(layer)`` / ``load_hf_state_dict`` take the weights of a transformers
    Qwen3-Next linear-attention layer, ``GatedDeltaNetCache.load_hf_states`` / ``hf_states`` its cache's states.
    """

    max_decode_tokens = 16

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_size: int = 4, norm_eps: float = 1e-6, layer_idx: int | None = None, impl: str = "auto",
                 device=None, dtype=None, *, save_states: bool = True):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_v_heads", num_v_heads),
                        ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("conv_size", conv_size)):
            check_positive_int(name, v)
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads}")
        if conv_size < 2:
            raise ValueError(f"conv_size: expected >= 2, got {conv_size}")
        norm_eps = check_norm_eps("norm_eps", norm_eps)
        layer_idx = check_optional_int("layer_idx", layer_idx, lo=0)
        check_float_dtype(dtype)
        check_impl(impl, op="GatedDeltaNet", gluon=False)
        _check_kernel_dtype(impl, dtype if dtype is not None else torch.get_default_dtype(), "dtype")
        device = check_device(device)
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
        self.in_proj = nn.Linear(hidden_size, sum(self.in_proj_sizes), bias=False, **fk)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_size, groups=self.conv_dim, bias=False, **fk)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **fk))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **fk))
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim, **fk))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **fk)
        self._init_gates()

    _SPLIT_PROJ = ("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Also takes the layouts ``_own_keys`` joins, so ``load_state_dict(fla_layer.state_dict())`` loads it. Every
        entry (and every part joined) is checked before any is copied (``_state.check_state_dict``), also inside a
        model's load."""
        assign = assigning(args[0] if args else None)
        self._own_keys(state_dict, prefix, assign=assign)
        check_state_dict(self, state_dict, prefix, self._REFUSED, assign=assign)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    _REFUSED = tuple((f"{n}_conv1d.bias", "a conv bias (fla's conv_bias=True) has no counterpart here") for n in "qkv")

    def _own_keys(self, state_dict: dict, prefix: str = "", *, assign: bool = False) -> None:
        """Rename and join, in the dict ``state_dict`` itself, the entries under ``prefix`` of the other layouts
        into this layer's keys (each only where this layer's own key is absent): the six input projections as
        separate ``<name>.weight`` entries (q, k, v, z, b, a; z is the output gate) joined into ``in_proj.weight``
        in that order, and fla's layout (``fla.layers.GatedDeltaNet``): its output gate ``g_proj`` as z, its three
        short convs ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` joined into ``conv1d.weight``, ``o_norm.weight`` as
        ``norm_weight``. Each part joined is checked first as the slice it fills (a ``ValueError`` naming its key);
        ``assign``: as ``load_state_dict``'s."""
        norm, fla_norm = f"{prefix}norm_weight", f"{prefix}o_norm.weight"
        if norm not in state_dict and fla_norm in state_dict:
            state_dict[norm] = _joined(state_dict, [fla_norm], [self.norm_weight], assign)
        # parts joined into one parameter: each checked as the slice it fills (``_state.entry_problem``) first
        convs = [f"{prefix}{n}_conv1d.weight" for n in "qkv"]
        if f"{prefix}conv1d.weight" not in state_dict and all(n in state_dict for n in convs):
            slices = self.conv1d.weight.split([self.key_dim, self.key_dim, self.value_dim], 0)
            state_dict[f"{prefix}conv1d.weight"] = _joined(state_dict, convs, slices, assign)
        names = [f"{prefix}{n}.weight" for n in self._SPLIT_PROJ]
        if names[3] not in state_dict:  # fla's output gate
            names[3] = f"{prefix}g_proj.weight"
        if f"{prefix}in_proj.weight" not in state_dict and all(n in state_dict for n in names):
            slices = self.in_proj.weight.split(list(self.in_proj_sizes), 0)
            state_dict[f"{prefix}in_proj.weight"] = _joined(state_dict, names, slices, assign)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a load that fails leaves every parameter and buffer of the layer as it was
        (the same objects, their values; ``_state.load_or_restore``) and the state dict's tensors untouched."""
        return load_or_restore(self, super().load_state_dict, state_dict, strict=strict, assign=assign)

    @property
    def in_proj_sizes(self) -> tuple[int, int, int, int, int, int]:
        """Output widths of ``in_proj``'s blocks: q, k ``H·K``; v, z ``HV·V``; b, a ``HV``."""
        kd, vd, hv = self.key_dim, self.value_dim, self.num_v_heads
        return kd, kd, vd, vd, hv, hv

    def split_in_proj(self, t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, z, b, a)``: views of ``t`` split along ``dim`` by ``in_proj_sizes`` (``in_proj``'s output, or
        its weight with ``dim=0``)."""
        check_dense("t", t)
        if t.dim() == 0:
            raise ValueError("t: expected at least one dimension, got a 0-dim tensor")
        check_int_in("dim", dim, -t.dim(), t.dim() - 1)
        sizes = self.in_proj_sizes
        if t.shape[dim] != sum(sizes):
            raise ValueError(f"t: expected size {sum(sizes)} (in_proj's output width) along dim {dim}, got shape "
                             f"{list(t.shape)}")
        return t.split(sizes, dim)

    def reset_parameters(self) -> None:
        """The layer's own parameters as the constructor makes them: ``A_log``, ``dt_bias`` (random decays) and
        ``norm_weight`` (ones), e.g. after ``to_empty`` of a layer built on meta. The projections and the convolution
        are submodules with a ``reset_parameters`` of their own."""
        self._init_gates()
        with torch.no_grad():
            self.norm_weight.fill_(1)

    @torch.no_grad()
    def _init_gates(self):
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias, dtype=torch.float32).uniform_(math.log(1e-3), math.log(0.1)))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def init_cache(self, num_seqs: int, device=None) -> GatedDeltaNetCache:
        """An empty cache for ``num_seqs`` sequence slots on ``device`` (default the layer's), in the layer's
        dtype."""
        w = self.in_proj.weight
        return GatedDeltaNetCache(num_seqs, self.conv_dim, self.conv_size, self.num_v_heads, self.head_k_dim,
                                  self.head_v_dim, device=device if device is not None else w.device, dtype=w.dtype)

    # ------------------------------------------------------------------------------------ transformers interop
    @classmethod
    def from_hf(cls, layer_or_config, state_dict=None, *, prefix: str = "", layer_idx: int | None = None,
                impl: str = "auto", device=None, dtype=None, save_states: bool = True) -> GatedDeltaNet:
        """A layer computing what a transformers Qwen3-Next linear-attention layer (``Qwen3NextGatedDeltaNet``)
        computes, with its weights.

        ``layer_or_config``: the transformers layer (its sizes and ``state_dict()`` are read; ``state_dict`` must
        then be None), or its ``Qwen3NextConfig`` (sizes from ``hidden_size``, ``linear_num_key_heads``,
        ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``,
        ``rms_norm_eps``) with ``state_dict`` holding the layer's weights under ``prefix`` (e.g.
        ``"model.layers.0.linear_attn."`` for a model's state dict): see ``load_hf_state_dict``. ``device`` /
        ``dtype`` default to those of ``in_proj_qkvz.weight``. transformers is not imported; the conv activation
        must be SiLU (``hidden_act``), the layer's only one. transformers' ``attention_mask`` (zeroing padded tokens'
        inputs) has no counterpart here: pack sequences of different lengths with ``cu_seqlens`` instead.
        """
        if isinstance(layer_or_config, nn.Module):
            m = layer_or_config
            if not hasattr(m, "in_proj_qkvz"):
                raise TypeError(f"layer_or_config: expected a Qwen3-Next linear-attention layer (in_proj_qkvz, ...) "
                                f"or its config, got {type(m).__name__}")
            if state_dict is not None:
                raise ValueError("state_dict: the weights are read from the given layer; pass None")
            if prefix:
                raise ValueError("prefix: only with a config and a state_dict")
            names = ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size",
                     "layer_norm_epsilon", "activation")
            missing = [a for a in names if not hasattr(m, a)]
            if missing:
                raise TypeError(f"layer_or_config: expected a Qwen3-Next linear-attention layer; "
                                f"{type(m).__name__} has no {', '.join(missing)}")
            sizes = tuple(getattr(m, a) for a in names)
            state_dict = m.state_dict()
            layer_idx = m.layer_idx if layer_idx is None else layer_idx
        else:
            c = layer_or_config
            names = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps", "hidden_act")
            missing = [a for a in names if not hasattr(c, a)]
            if missing:
                raise TypeError(f"layer_or_config: expected a Qwen3-Next layer or config; {type(c).__name__} has no "
                                f"{', '.join(missing)}")
            if state_dict is None:
                raise ValueError("state_dict: a config needs the layer's state dict")
            sizes = tuple(getattr(c, a) for a in names)
        hidden, H, HV, K, V, W, eps, act = sizes
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act: the conv activation must be SiLU ('silu'), got {act!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of tensors, got {type(state_dict).__name__}")
        device = check_device(device, storage=True)
        w = _hf_tensor(state_dict, prefix, "in_proj_qkvz.weight")
        if dtype is None:
            check_impl(impl, op="GatedDeltaNet", gluon=False)
            _check_kernel_dtype(impl, w.dtype, f"dtype (None: that of {prefix}in_proj_qkvz.weight)")
        m = cls(hidden, H, HV, K, V, conv_size=W, norm_eps=eps, layer_idx=layer_idx, impl=impl,
                device=device if device is not None else w.device, dtype=dtype if dtype is not None else w.dtype,
                save_states=save_states)
        m.load_hf_state_dict(state_dict, prefix=prefix)
        return m

    def load_hf_state_dict(self, state_dict, *, prefix: str = "") -> None:
        """Copy the weights of a transformers Qwen3-Next linear-attention layer of this layer's sizes.

        Keys (after ``prefix``) and shapes: ``in_proj_qkvz.weight [2·H·K + 2·HV·V, hidden]``, rows grouped per q/k
        head ``h``: ``[q_h (K), k_h (K), v (r·V), z (r·V)]`` with ``r = HV // H`` (value heads ``h·r .. h·r + r-1``);
        ``in_proj_ba.weight [2·HV, hidden]``, per q/k head ``[b (r), a (r)]``; ``conv1d.weight [conv_dim, 1,
        conv_size]`` (channels ``[q; k; v]`` as here); ``A_log [HV]``, ``dt_bias [HV]``, ``norm.weight [V]``,
        ``out_proj.weight [hidden, HV·V]``. Any float dtype (cast to the layer's). Other keys under ``prefix`` (a
        conv bias, say) raise ``ValueError``; everything is checked before a parameter changes.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        H, HV, K, V, hid = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.hidden_size
        r = HV // H
        t = _layer_weights(state_dict, prefix, {
            "in_proj_qkvz.weight": (2 * H * K + 2 * HV * V, hid), "in_proj_ba.weight": (2 * HV, hid),
            "conv1d.weight": (self.conv_dim, 1, self.conv_size), "A_log": (HV,), "dt_bias": (HV,),
            "norm.weight": (V,), "out_proj.weight": (hid, HV * V)}, "a Qwen3-Next linear-attention layer")
        qkvz = t["in_proj_qkvz.weight"].reshape(H, 2 * K + 2 * r * V, hid)
        q, k, v, z = qkvz.split([K, K, r * V, r * V], 1)
        b, a = t["in_proj_ba.weight"].reshape(H, 2 * r, hid).split([r, r], 1)
        w = self.in_proj.weight
        fused = torch.cat([p.reshape(-1, hid).to(device=w.device, dtype=w.dtype) for p in (q, k, v, z, b, a)], 0)
        _copy_all(self, ((w, fused), (self.conv1d.weight, t["conv1d.weight"]), (self.A_log, t["A_log"]),
                         (self.dt_bias, t["dt_bias"]), (self.norm_weight, t["norm.weight"]),
                         (self.o_proj.weight, t["out_proj.weight"])))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in the layout of a transformers Qwen3-Next linear-attention layer (the inverse of
        ``load_hf_state_dict``; new tensors, detached)."""
        H, HV, K, V, hid = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.hidden_size
        r = HV // H
        with torch.no_grad():
            q, k, v, z, b, a = self.split_in_proj(self.in_proj.weight, 0)
            qkvz = torch.cat([q.reshape(H, K, hid), k.reshape(H, K, hid), v.reshape(H, r * V, hid),
                              z.reshape(H, r * V, hid)], 1)
            ba = torch.cat([b.reshape(H, r, hid), a.reshape(H, r, hid)], 1)
            return {"in_proj_qkvz.weight": qkvz.reshape(-1, hid), "in_proj_ba.weight": ba.reshape(-1, hid),
                    "conv1d.weight": self.conv1d.weight.clone(), "A_log": self.A_log.detach().clone(),
                    "dt_bias": self.dt_bias.detach().clone(), "norm.weight": self.norm_weight.detach().clone(),
                    "out_proj.weight": self.o_proj.weight.detach().clone()}

    # -------------------------------------------------------------------------------------------- fla interop
    _FLA_OPTIONS = (("use_gate", False, "no output gate (o_norm a plain RMSNorm)"),
                    ("use_short_conv", False, "no short convolutions"),
                    ("conv_bias", True, "short convolutions with a bias"),
                    ("allow_neg_eigval", True, "beta doubled (negative eigenvalues)"))

    @classmethod
    def from_fla(cls, layer, *, layer_idx: int | None = None, impl: str = "auto", device=None, dtype=None,
                 save_states: bool = True) -> GatedDeltaNet:
        """A layer computing what fla's ``fla.layers.GatedDeltaNet`` ``layer`` computes, with its weights
        (``load_fla_state_dict``): sizes ``hidden_size``, ``num_heads``, ``num_v_heads``, ``head_k_dim``,
        ``head_v_dim``, ``conv_size`` and the gated norm's ``eps`` are read from it (no ``num_v_heads``, as in fla
        releases before value-head groups: ``num_heads``). fla's options this layer has
        no counterpart for are refused by name (``ValueError``): ``use_gate=False``, ``use_short_conv=False``,
        ``conv_bias=True``, ``allow_neg_eigval=True``, a norm or conv activation other than SiLU. ``device`` /
        ``dtype`` default to those of ``q_proj.weight``. fla is not imported. fla's ``attention_mask`` (padded
        tokens dropped) has no counterpart here: pack sequences of different lengths with ``cu_seqlens``."""
        need = ("q_proj", "o_norm", "hidden_size", "num_heads", "head_k_dim", "head_v_dim", "conv_size", "use_gate")
        if not isinstance(layer, nn.Module) or not all(hasattr(layer, a) for a in need):
            raise TypeError(f"layer: expected an fla GatedDeltaNet layer ({', '.join(need)}, ...), got "
                            f"{type(layer).__name__}")
        for name, bad, what in cls._FLA_OPTIONS:
            if getattr(layer, name, not bad) == bad:
                raise ValueError(f"layer: fla's {name}={bad} ({what}) has no counterpart here")
        missing = [f"{n}_conv1d" for n in "qkv" if not hasattr(layer, f"{n}_conv1d")]
        missing += [] if hasattr(layer.o_norm, "eps") else ["o_norm.eps"]
        if missing:
            raise TypeError(f"layer: expected an fla GatedDeltaNet layer; {type(layer).__name__} has no "
                            f"{', '.join(missing)}")
        acts = [("o_norm", getattr(layer.o_norm, "activation", "swish"))]
        acts += [(f"{n}_conv1d", getattr(getattr(layer, f"{n}_conv1d"), "activation", "silu")) for n in "qkv"]
        for name, act in acts:
            if act not in ("silu", "swish"):
                raise ValueError(f"layer: {name}'s activation must be SiLU ('silu' / 'swish'), got {act!r}")
        if getattr(layer.o_norm, "weight", None) is None:
            raise ValueError("layer: o_norm has no weight (elementwise_affine=False); this layer's norm has one")
        device = check_device(device, storage=True)
        w = layer.q_proj.weight
        if dtype is None:
            check_impl(impl, op="GatedDeltaNet", gluon=False)
            _check_kernel_dtype(impl, w.dtype, "dtype (None: that of q_proj.weight)")
        # fla releases before value-head groups (GVA) have no num_v_heads: as many value heads as heads
        m = cls(layer.hidden_size, layer.num_heads, getattr(layer, "num_v_heads", layer.num_heads), layer.head_k_dim,
                layer.head_v_dim, conv_size=layer.conv_size, norm_eps=layer.o_norm.eps,
                layer_idx=getattr(layer, "layer_idx", None) if layer_idx is None else layer_idx, impl=impl,
                device=device if device is not None else w.device, dtype=dtype if dtype is not None else w.dtype,
                save_states=save_states)
        m.load_fla_state_dict(layer.state_dict())
        return m

    def _fla_shapes(self) -> dict[str, tuple[int, ...]]:
        kd, vd, HV, hid, W = self.key_dim, self.value_dim, self.num_v_heads, self.hidden_size, self.conv_size
        return {"q_proj.weight": (kd, hid), "k_proj.weight": (kd, hid), "v_proj.weight": (vd, hid),
                "g_proj.weight": (vd, hid), "b_proj.weight": (HV, hid), "a_proj.weight": (HV, hid),
                "q_conv1d.weight": (kd, 1, W), "k_conv1d.weight": (kd, 1, W), "v_conv1d.weight": (vd, 1, W),
                "A_log": (HV,), "dt_bias": (HV,), "o_norm.weight": (self.head_v_dim,), "o_proj.weight": (hid, vd)}

    def load_fla_state_dict(self, state_dict, *, prefix: str = "") -> None:
        """Copy the weights of an fla ``GatedDeltaNet`` layer of this layer's sizes (keys after ``prefix``:
        ``q_proj`` / ``k_proj`` ``[H·K, hidden]``, ``v_proj`` / ``g_proj`` (the output gate) ``[HV·V, hidden]``,
        ``b_proj`` / ``a_proj`` ``[HV, hidden]``, ``q_conv1d`` / ``k_conv1d`` ``[H·K, 1, conv_size]``, ``v_conv1d``
        ``[HV·V, 1, conv_size]`` (``.weight`` each), ``A_log`` / ``dt_bias`` ``[HV]``, ``o_norm.weight [V]``,
        ``o_proj.weight [hidden, HV·V]``). Any float dtype (cast to the layer's). Other keys under ``prefix`` (a conv
        bias, say) raise ``ValueError``; everything is checked before a parameter changes."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        t = _layer_weights(state_dict, prefix, self._fla_shapes(), "an fla GatedDeltaNet layer (without conv biases)")
        w = self.in_proj.weight
        fused = torch.cat([t[f"{n}_proj.weight"].to(device=w.device, dtype=w.dtype) for n in "qkvgba"], 0)
        conv = torch.cat([t[f"{n}_conv1d.weight"] for n in "qkv"], 0)
        _copy_all(self, ((w, fused), (self.conv1d.weight, conv), (self.A_log, t["A_log"]),
                         (self.dt_bias, t["dt_bias"]), (self.norm_weight, t["o_norm.weight"]),
                         (self.o_proj.weight, t["o_proj.weight"])))

    def fla_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in the layout of an fla ``GatedDeltaNet`` layer (the inverse of ``load_fla_state_dict``;
        new tensors, detached)."""
        with torch.no_grad():
            q, k, v, z, b, a = (t.clone() for t in self.split_in_proj(self.in_proj.weight, 0))
            cq, ck, cv = (t.clone() for t in self.conv1d.weight.split([self.key_dim, self.key_dim, self.value_dim]))
            return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "g_proj.weight": z,
                    "b_proj.weight": b, "a_proj.weight": a, "q_conv1d.weight": cq, "k_conv1d.weight": ck,
                    "v_conv1d.weight": cv, "A_log": self.A_log.detach().clone(),
                    "dt_bias": self.dt_bias.detach().clone(), "o_norm.weight": self.norm_weight.detach().clone(),
                    "o_proj.weight": self.o_proj.weight.detach().clone()}

    # --------------------------------------------------------------------------------------- pieces
    def _conv(self, x, init, cu_seqlens):
        """Causal depthwise conv over ``x [B, T, C]`` starting from ``init [N, C, W-1]`` (None = zeros).

        Returns ``(y [B, T, C], final [N, C, W-1])``; with ``cu_seqlens`` (``_clamped_bounds``' form:
        non-decreasing within ``[0, T]``) no sequence sees another's tokens, and the padding tokens outside
        ``[cu[0], cu[N])`` reach no sequence (their own outputs are unspecified).
        """
        W, C = self.conv_size, x.shape[-1]
        w = self.conv1d.weight
        if cu_seqlens is None:
            B, T = x.shape[:2]
            pad = init.transpose(1, 2).to(x.dtype) if init is not None else x.new_zeros(B, W - 1, C)
            xf = torch.cat([pad, x], 1)
            y = _depthwise_conv(xf, w)
            return y, xf[:, T:].transpose(1, 2)
        # varlen: give every sequence its own W-1 leading slots (zeros or its initial state), conv once. Sequence n's
        # stream (slots, then tokens) starts at cu[n] + n(W-1); padding tokens before cu[0] keep their own index and
        # those from cu[N] on move by N(W-1): places no stream holds, so every index is distinct and in the buffer
        T = x.shape[1]
        dev = x.device
        cu = _clamped_bounds(cu_seqlens.to(dev), T)
        N = cu.numel() - 1
        t = torch.arange(T, device=dev)
        seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=N - 1)
        dest = torch.where(t < cu[0], t, torch.where(t >= cu[N], t + N * (W - 1), t + (seq + 1) * (W - 1)))
        j = torch.arange(W - 1, device=dev)
        head = (cu[:-1] + torch.arange(N, device=dev) * (W - 1))[:, None] + j  # [N, W-1] leading slots
        xp = x.new_zeros(T + N * (W - 1), C)
        if init is not None:
            xp = xp.index_copy(0, head.flatten(), init.transpose(1, 2).reshape(-1, C).to(x.dtype))
        xp = xp.index_copy(0, dest, x[0])
        y = _depthwise_conv(xp[None], w)[0]
        tail = (cu[1:] + torch.arange(N, device=dev) * (W - 1))[:, None] + j
        return y[dest - (W - 1)][None], xp[tail.flatten()].reshape(N, W - 1, C).transpose(1, 2)

    def _conv_packed(self, x, init, bos, eos):
        """The conv of packed decode tokens ``x [1, T, C]`` from ``init [N, C, W-1]``, bounds from ``_packed_bounds``,
        by index gathers that no bound value can move out of range (device ops only).

        Returns ``(y [1, T, C], final [N, C, W-1], in_seq [T] bool)``; tokens outside every sequence get
        unspecified values and ``in_seq`` False."""
        W, T, N = self.conv_size, x.shape[1], bos.shape[0]
        dev = x.device
        xf, old = x[0], init.transpose(1, 2)
        t = torch.arange(T, device=dev)
        seq = torch.searchsorted(eos, t, right=True).clamp(max=N - 1)
        in_seq = (t >= bos[seq]) & (t < eos[seq])
        win = _windows(old, xf, seq, bos[seq], (t - bos[seq])[:, None] + torch.arange(W, device=dev))  # [T, W, C]
        cdt = torch.promote_types(x.dtype, torch.float32)
        y = (win.to(cdt) * self.conv1d.weight[:, 0].t().to(cdt)).sum(1).to(x.dtype)
        n = torch.arange(N, device=dev)
        fin = _windows(old, xf, n, bos, (eos - bos)[:, None] + torch.arange(W - 1, device=dev))
        return y[None], fin.transpose(1, 2), in_seq

    def _qkv_gates(self, y, b, a):
        """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` from the conv output ``y``; g, beta ``[B, T, HV]`` from the
        projections ``a``, ``b``."""
        B, T, _ = y.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        q, k, v = F.silu(y).split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
        cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
        beta = torch.sigmoid(b.to(cdt))
        g = -torch.exp(self.A_log.to(cdt)) * F.softplus(a.to(cdt) + self.dt_bias.to(cdt))
        return q, k, v, g, beta

    def _project_in(self, x):
        """``in_proj(x)`` split into the conv input ``[q; k; v] [B, T, conv_dim]``, z, b and a (views)."""
        return self.in_proj(x).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)

    def _project_out(self, o, z, rows=None):
        """``o_proj(gated RMSNorm(o, z))``; o ``[B, T, HV, V]``, z ``[B, T, HV·V]`` (a view of in_proj's output).
        The kernel takes the norm unless impl="reference" or autograd needs it (the kernel is forward-only).
        ``rows [B]`` int32 or None: sequences with a negative row get a zero norm output, so their output (o_proj
        of a zero row, no bias) is 0 whatever their inputs held."""
        B, T = o.shape[:2]
        z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (o, z, self.norm_weight))
        if self.impl != "reference" and not grad:
            y = gdn_gated_norm(o, z, self.norm_weight, self.norm_eps, rows)
        else:
            y = gated_rms_norm(o, z, self.norm_weight, self.norm_eps).reshape(B, T, self.value_dim)
            if rows is not None:
                y = torch.where((rows >= 0)[:, None, None], y, 0.0)
        return self.o_proj(y)

    def _rule(self, q, k, v, g, beta, state0, cu_seqlens, want_final, cu_host=None):
        if self.impl == "reference":
            o, fin = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state0,
                                                    output_final_state=want_final, use_qk_l2norm=True,
                                                    cu_seqlens=cu_seqlens)
            return o.to(v.dtype), fin
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state0, output_final_state=want_final,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_host,
                                      save_states=self.save_states, impl=self.impl)

    def _pool_rule(self, q, k, v, g, beta, cache, batch, cu_seqlens, cu_host):
        """The chunked rule from the pool rows ``batch`` of ``cache``, final states written back into them: in place
        through ``state_indices`` (no copies) for the inference kernels, else by ``_gather_rule``."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
        if self.impl == "reference" or grad:
            return self._gather_rule(q, k, v, g, beta, cache, batch, cu_seqlens, cu_host)
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=cache.recurrent_state,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_host,
                                      state_indices=batch.op, impl=self.impl)
        return o

    def _gather_rule(self, q, k, v, g, beta, cache, batch, cu_seqlens, cu_host):
        """``_pool_rule`` by copies: the rows gathered, the rule run (differentiable), final states scattered back."""
        o, fin = self._rule(q, k, v, g, beta, cache.recurrent_state[batch.write], cu_seqlens, True, cu_host)
        cache.recurrent_state.index_copy_(0, batch.write, fin.detach().to(cache.recurrent_state.dtype))
        return o

    # --------------------------------------------------------------------------------------- forward
    def _check_cache(self, cache) -> None:
        if not isinstance(cache, GatedDeltaNetCache):
            raise TypeError(f"cache: expected a GatedDeltaNetCache, got {type(cache).__name__}")
        want_conv = (self.conv_dim, self.conv_size - 1)
        want_rec = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if tuple(cache._conv.shape[1:]) != want_conv or tuple(cache.recurrent_state.shape[1:]) != want_rec:
            raise ValueError(f"cache: conv/recurrent rows {list(cache._conv.shape[1:])} / "
                             f"{list(cache.recurrent_state.shape[1:])} do not match the layer's {list(want_conv)} / "
                             f"{list(want_rec)} (make it with layer.init_cache)")
        w = self.in_proj.weight
        if cache.device != w.device:
            raise ValueError(f"cache: on {cache.device}, the layer on {w.device}")
        if cache._conv.dtype != w.dtype:
            raise TypeError(f"cache: conv_state is {cache._conv.dtype}, the layer {w.dtype}")
        cache._check_idle("forward")

    def forward(self, hidden_states: torch.Tensor, cache: GatedDeltaNetCache | None = None,
                cu_seqlens: torch.Tensor | None = None, *, slots=None, verify: bool = False) -> torch.Tensor:
        """``hidden_states [B, T, hidden]`` (the layer's dtype and device) -> ``[B, T, hidden]``.

        ``cu_seqlens [N+1]`` int32/int64 packs N sequences along T (then ``B == 1``); without it the B rows are the
        sequences. Without a cache: the chunked op (training / prefill). With a ``cache`` the sequences live in the
        slots ``slots`` (a host sequence of ints or a device int32 tensor, see ``GatedDeltaNetCache``; default
        ``cache.slots``, else ``0..N-1``):

        - host slots that all hold a state: a decode step (the recurrent op) when there are at most
          ``max_decode_tokens`` new tokens per sequence (with ``cu_seqlens``: on average), else the chunked op
          continuing from the cached states;
        - host slots not all holding a state: a prefill; the fresh slots start from zero states (whatever their
          rows held), the others continue from theirs; initial states are read from and final states written to
          the cache rows (the chunked op over the state pool). Sets the slots' flags;
        - a device slot tensor: a decode step (any number of tokens).

        A decode step of the kernel impls has no host sync, host-to-device copy or branch on device values. Tokens
        outside ``[cu[0], cu[N])`` are padding: they reach no sequence and no cache row (their output: ``o_proj`` of the
        gated norm of a zero o, 0 for finite inputs). ``cu_seqlens`` on a GPU is never read on the host, prefill
        included (the chunked op plans on the device), and no value of it can cause an out-of-bounds access: a
        decode step clamps each bound as its kernel does, a prefill takes the bounds clamped to ``[0, T]`` and made
        non-decreasing. A CPU ``cu_seqlens`` is checked on the host: non-decreasing within ``[0, T]``
        (``ValueError``). Skipped (padding) sequences output 0.
        ``verify=True`` (decode only): the tokens are drafts; outputs of all of them are returned, the cache is left
        as it was until ``cache.commit(accepted)`` advances each sequence by its accepted tokens. A decode step is
        inference only (a ``RuntimeError`` under autograd with ``hidden_states`` or a parameter requiring grad).
        The tensors passed share no memory with the cache's. Invalid arguments raise ``TypeError`` /
        ``ValueError`` before anything in the cache changes.
        """
        x = check_dense("hidden_states", hidden_states)
        w = self.in_proj.weight
        mdt = self.max_decode_tokens
        check_int_in("max_decode_tokens", mdt, 0, 2**63 - 1)
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got {list(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(f"hidden_states: expected the layer's dtype {w.dtype}, got {x.dtype}")
        if x.device != w.device:
            raise ValueError(f"hidden_states: expected a tensor on the layer's device {w.device}, got {x.device}")
        if self.impl != "reference":  # before any cache row changes: every path of the kernel impls runs kernels
            _check_kernel_dtype(self.impl, w.dtype, "GatedDeltaNet (the layer's dtype)")
            check_kernel_device(w.device, _REF, w.dtype)
        B, T, _ = x.shape
        if B == 0 or T == 0:
            raise ValueError(f"hidden_states: expected B >= 1 and T >= 1, got {list(x.shape)}")
        if not isinstance(verify, bool):
            raise TypeError(f"verify: expected a bool, got {type(verify).__name__}")
        N = sequence_count(cu_seqlens, B, x.device)
        if cache is None:
            if slots is not None:
                raise ValueError("slots: given without a cache")
            if verify:
                raise ValueError("verify: a verify step needs a cache")
        else:
            self._check_cache(cache)
        batch = cache._batch(slots, N) if cache is not None else None
        if cache is not None:
            cache._check_reads(hidden_states=x, cu_seqlens=cu_seqlens,
                               slots=batch.slots if batch.ids is None else None)
            if batch.ids is None:
                cache._check_held(batch.slots)
        decode = batch is not None and batch.ids is None
        fresh = []
        if batch is not None and not decode:
            fresh = [not cache._held[s] for s in batch.ids]
            decode = not any(fresh) and (verify or T <= self.max_decode_tokens * (1 if cu_seqlens is None else N))
            if verify and any(fresh):
                raise ValueError("verify: every slot must hold a state (prefill first); fresh slots "
                                 f"{[s for s, f in zip(batch.ids, fresh, strict=True) if f]}")
        # read (and checked) where the chunked op reads it: a CPU tensor (no sync), or for the torch reference
        cu_host = gdn_plan.host_bounds(cu_seqlens, T, need=self.impl == "reference" and not decode)
        if cu_seqlens is not None and not decode:
            cu_seqlens = _clamped_bounds(cu_seqlens, T)
        if cache is None:
            xc, z, b, a = self._project_in(x)
            o, _ = self._rule(*self._qkv_gates(self._conv(xc, None, cu_seqlens)[0], b, a), None, cu_seqlens, False,
                              cu_host)
            return self._project_out(o, z)
        if decode:
            if torch.is_grad_enabled():
                named = (("hidden_states", x), *self.named_parameters())
                grad = next((name for name, t in named if t.requires_grad), None)
                if grad is not None:
                    raise RuntimeError(f"GatedDeltaNet: decode steps are inference only (gated_delta_rule_decode is "
                                       f"forward-only): {grad} requires grad; run them under torch.no_grad() / "
                                       "torch.inference_mode()")
            return self._decode(x, cache, batch, cu_seqlens, verify)
        return self._prefill(x, cache, batch, cu_seqlens, cu_host, fresh)

    def _prefill(self, x, cache, batch, cu_seqlens, cu_host, fresh):
        B, T, _ = x.shape
        if self.impl != "reference" and (self.head_k_dim > 256 or self.head_v_dim > 1024):  # before any row changes
            raise ValueError(f"head_k_dim / head_v_dim: a prefill runs the chunked op, which takes head_k_dim up to "
                             f"256 and head_v_dim up to 1024; this layer has {self.head_k_dim} / {self.head_v_dim} "
                             "(impl='reference' takes any)")
        rows = batch.write
        kept = None
        if any(fresh):
            new = rows if all(fresh) else rows[torch.tensor([i for i, f in enumerate(fresh) if f], device=rows.device)]
            with torch.no_grad():
                # a freed slot's states stay in place until a call succeeds: kept, and put back if this one is refused
                kept = [(t, t[new]) for t in (cache._conv, cache.recurrent_state, cache._lens)]
                for t, _ in kept:
                    t.index_fill_(0, new, 0)
        try:
            xc, z, b, a = self._project_in(x)
            y, conv_fin = self._conv(xc, cache._conv[rows], cu_seqlens)
            q, k, v, g, beta = self._qkv_gates(y, b, a)
            o = self._pool_rule(q, k, v, g, beta, cache, batch, cu_seqlens, cu_host)
        except BaseException:
            if kept is not None:
                with torch.no_grad():
                    for t, old in kept:
                        t.index_copy_(0, new, old)
            raise
        with torch.no_grad():
            cache._conv.index_copy_(0, rows, conv_fin.detach().to(cache._conv.dtype))
            counts = cu_seqlens.diff() if cu_seqlens is not None else torch.full_like(rows, T)
            add_token_counts(cache._lens, rows, counts)
        for s in batch.ids:
            cache._held[s] = True
        return self._project_out(o, z)

    def _decode(self, x, cache, batch, cu_seqlens, verify):
        if cu_seqlens is None and self.impl != "reference" and self.head_k_dim <= 256 and self.head_v_dim <= 1024:
            return self._decode_fused(x, cache, batch, verify)
        B, T, _ = x.shape
        batch = batch.resolved(cache.num_seqs)
        N = batch.op.shape[0]
        xc, z, b, a = self._project_in(x)
        init = cache._conv[batch.write]
        if cu_seqlens is None:
            y, conv_fin = self._conv(xc, init, None)
            keep = batch.live[:, None] if batch.live is not None else None  # [B, 1]: rows to output
        else:
            bos, eos = _packed_bounds(cu_seqlens, T)
            y, conv_fin, in_seq = self._conv_packed(xc, init, bos, eos)
            n_tok = (eos - bos).to(torch.int32)
            keep = in_seq[None, :]  # [1, T]: tokens of some live sequence
            if batch.live is not None:
                seq = torch.searchsorted(eos, torch.arange(T, device=x.device), right=True).clamp(max=N - 1)
                keep = keep & batch.live[seq][None, :]
        q, k, v, g, beta = self._qkv_gates(y, b, a)
        if verify:
            accepted = torch.zeros(N, dtype=torch.int32, device=x.device)  # nothing committed until commit()
            o = gated_delta_rule_decode(q, k, v, g, beta, cache.recurrent_state, batch.op,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, accepted=accepted,
                                        impl=self.impl)
            # the draft keeps its own copy of the caller's cu_seqlens: a buffer refilled before commit() must not
            # change what it commits (its rows op / write are the call's own tensors)
            cache._draft = _Draft(batch.op, batch.write, xc.reshape(-1, xc.shape[-1]).detach(),
                                  tuple(t.detach() for t in (q, k, v, g, beta)), T,
                                  None if cu_seqlens is None else cu_seqlens.clone(), self.impl)
        else:
            o = gated_delta_rule_decode(q, k, v, g, beta, cache.recurrent_state, batch.op,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, impl=self.impl)
            cache._conv.index_copy_(0, batch.write, conv_fin.to(cache._conv.dtype))
            add_token_counts(cache._lens, batch.write, torch.full_like(batch.op, T) if cu_seqlens is None else n_tok)
        out = self._project_out(o, z)
        if keep is not None:
            out = torch.where(keep[..., None], out, 0.0)
        return out

    def _decode_fused(self, x, cache, batch, verify):
        """A dense decode step (T tokens per sequence) of the kernel impls: in_proj, the prep kernel (conv + SiLU,
        gates, pool rows; conv rows and lengths advanced unless ``verify``), the decode op, the gated-norm kernel
        (zeros for skipped sequences), o_proj."""
        B, T, _ = x.shape
        # the decode op's launch refusal, before the prep kernel advances the conv rows and lengths
        check_launch(B, self.num_v_heads, self.head_k_dim, self.head_v_dim, x.device, "hidden_states")
        # autocast may give in_proj's output another dtype; the prep kernel takes the conv rows' dtype
        mixed = self.in_proj(x).to(cache._conv.dtype)
        q, k, v, g, beta, rows = gdn_decode_prep(
            mixed, self.conv1d.weight, cache._conv, cache._lens, batch.slots, self.A_log, self.dt_bias,
            num_heads=self.num_heads, head_k_dim=self.head_k_dim, num_v_heads=self.num_v_heads,
            head_v_dim=self.head_v_dim, num_slots=cache.num_seqs, update=not verify)
        if verify:
            accepted = torch.zeros(B, dtype=torch.int32, device=x.device)  # nothing committed until commit()
            o = gated_delta_rule_decode(q, k, v, g, beta, cache.recurrent_state, rows, use_qk_l2norm_in_kernel=True,
                                        accepted=accepted, impl=self.impl)
            C = self.conv_dim
            cache._draft = _Draft(rows, batch.write, mixed[..., :C].reshape(B * T, C), (q, k, v, g, beta), T, None,
                                  self.impl)
        else:
            o = gated_delta_rule_decode(q, k, v, g, beta, cache.recurrent_state, rows, use_qk_l2norm_in_kernel=True,
                                        impl=self.impl)
        z = mixed[..., self.conv_dim:self.conv_dim + self.value_dim]
        return self._project_out(o, z, rows if batch.ids is None else None)
