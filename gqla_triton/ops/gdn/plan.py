"""What one call of the chunked op launches: its config, the chunk programs and the segments of sequence splitting.

``chunk_plan`` is built per call, before the forward, and the backward reuses the forward's plan (under
torch.compile each custom op builds its plan inside itself). A varlen plan comes from the host values of
cu_seqlens where the caller has them (``cu_seqlens_cpu``, or a CPU tensor): its index tensors are cached by value
(``_chunk_index``, ``_seg_plan``). Otherwise it is built on the device (``device_plan``): one small kernel, no host
read, so a call with cu_seqlens on a GPU never waits for the device and can be captured in a CUDA graph; the
counts that size its grids are bounds from the shapes, the programs past the real chunks return at once.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import torch

from ...dispatch import DeviceInfo, device_info, is_interpreter, select_config
from .._common.alloc import empty
from .._common.host import MAX_GRID_X, MAX_GRID_Y, cdiv, device_ints, keep_for_replays, next_pow2, on_device, stream_key
from .config import ChunkConfig
from .kernels.plan import gdn_plan_kernel

__all__ = ["BT", "CHUNK_SIZES", "ChunkPlan", "SegPlan", "chunk_plan", "config_key", "device_plan", "host_bounds",
           "host_cu_seqlens", "kernel_chunk", "plans_on_device", "read_cu_seqlens", "seg_len"]

BT = 64  # the default chunk size (fla's)
CHUNK_SIZES = (16, 32, 64)  # the chunk sizes the kernels take (fla's set)


class SegPlan(NamedTuple):
    """Sequence splitting of the state passes: each sequence cut into segments of L chunks (an empty sequence keeps
    one empty segment)."""

    nseg: int  # segments over all sequences
    cu: torch.Tensor  # [nseg+1] int64 token bounds of the segments
    coff: torch.Tensor  # [nseg] int32 first chunk-state row of each segment
    soff: torch.Tensor  # [N+1] int32 first segment of each sequence
    L: int  # chunks per segment (the last segment of a sequence may have fewer)


class ChunkPlan(NamedTuple):
    """Launch plan of one call. Chunk programs run on a grid ``(NG, B·HV)``: dense inputs have NG = NT chunks per
    batch row, varlen inputs (B = 1) NG = NTT chunks over all sequences, indexed by ``cidx``. A varlen plan has
    ``padding`` where tokens may lie outside [cu[0], cu[N]): they belong to no sequence, and their outputs and
    gradients are zeroed. A plan built on the device has ``empty_slots``: NTT, the segment count and max_chunks are
    bounds, and the cidx rows past the real chunks are (-1, 0) (their programs return at once)."""

    cfg: ChunkConfig
    gpu: DeviceInfo  # the inputs' device (``dispatch.device_info``)
    BT: int  # chunk size (one of CHUNK_SIZES)
    N: int  # sequences
    seq_cu: tuple[int, ...] | None  # token bounds of the sequences in the [B·T] rows, N+1 values (None: on device)
    cu: torch.Tensor | None  # [N+1] cu_seqlens as the kernels read it (contiguous), None for dense inputs
    NTT: int  # chunks over all sequences
    NT: int  # chunks per sequence (dense inputs), 0 under varlen
    NG: int  # grid axis 0 of the chunk programs
    cidx: torch.Tensor | None  # [NTT, 2] int32 (sequence, chunk within it), varlen only
    coff: torch.Tensor | None  # [N+1] int32 first chunk-state row of each sequence, varlen only
    seg: SegPlan | None  # sequence splitting of the state passes, or None
    max_chunks: int  # chunks of the longest sequence
    padding: bool = False  # tokens outside every sequence may exist (see above)
    empty_slots: bool = False  # built on the device (see above)

    @property
    def varlen(self) -> bool:
        return self.cu is not None


def kernel_chunk(chunk_size: int, device: torch.device, impl: str) -> int:
    """The chunk the kernels run for a call asking for ``chunk_size`` on ``device`` with ``impl``: the same, except
    that the GPU kernels take 16 as 32. The chunk size changes rounding only (the function is the same at every
    size); at 16 every product of the backward's ``wy_bwd`` stage would be 16 deep, the tile width Triton 3.6
    miscompiles there on sm_90. The interpreter and ``impl="reference"`` take 16."""
    if chunk_size == 16 and impl != "reference" and torch.device(device).type == "cuda" and not is_interpreter():
        return 32
    return chunk_size


def config_key(K: int, V: int) -> dict:
    """The tables match the padded widths the kernels tile with: K = 192 runs [.., 256] state tiles, where the
    K = 128 entry's state passes would need 254-333 KB of shared memory."""
    return {"K": next_pow2(K), "V": next_pow2(V)}


def fit_shared(cfg: ChunkConfig, dtype: torch.dtype) -> ChunkConfig:
    """``cfg`` for inputs of ``dtype``: the tables' tiles and stages are chosen for 2-byte inputs; with fp32 inputs
    the sequential state passes run one pipeline stage and the gradient kernel V tiles of at most 32 in one stage,
    which keeps every stage within a Hopper block's shared memory up to K = V = 256 (``tools.audit_shared``; at
    K = V = 128 the H200 table's own stages would take the state passes' backward to 328712 bytes and the gradient
    kernel to 475136)."""
    return _fp32_config(cfg) if dtype == torch.float32 else cfg


@functools.lru_cache(maxsize=64)
def _fp32_config(cfg: ChunkConfig) -> ChunkConfig:
    return cfg.replace(state_num_stages=1, state_bwd_num_stages=1, grad_bv=min(cfg.grad_bv, 32), grad_num_stages=1)


def grad_fp32_bytes(BT: int, K: int) -> int:
    """Shared memory (bytes) of the backward's gradient kernel on fp32 inputs in chunks of ``BT`` for key dim ``K``,
    as five ``[BT, K]`` fp32 tiles (K padded): what Triton 3.6-3.9 allocate for sm_90 at 64-token chunks and a
    256-wide K tile (327680). An estimate elsewhere (131072 at 32-token chunks and K 256; at 64 and K 128, 188416 on
    sm_90 with V 256, 131072 on sm_89): ``tools.audit_shared`` compiles each GPU's table against it."""
    return 5 * BT * next_pow2(K) * 4


def backward_unsupported(info: DeviceInfo, BT: int, K: int, dtype: torch.dtype) -> str | None:
    """Why the backward cannot run on device ``info`` in chunks of ``BT`` for key dim ``K`` in ``dtype`` (None
    when it can): on fp32 inputs the gradient kernel holds whole K rows of its chunk's tiles
    (``grad_fp32_bytes``)."""
    if info.interpreter or dtype != torch.float32 or grad_fp32_bytes(BT, K) <= info.smem_per_block:
        return None
    fits = [c for c in (32, 16) if c < BT and grad_fp32_bytes(c, K) <= info.smem_per_block]
    return (f"float32 inputs with K {K} in chunks of {BT}: the backward's gradient kernel needs "
            f"{grad_fp32_bytes(BT, K)} bytes of shared memory, this GPU has {info.smem_per_block}; use "
            f"{f'chunk_size={fits[0]}, ' if fits else ''}bf16 / fp16 inputs, or impl='reference'")


def _check_grid(B: int, HV: int, NG: int, BT: int, N: int, V: int) -> None:
    """The per-chunk kernels' grids take (batch x value head) programs and chunk groups on their second and third
    axes, the state passes' (sequence x value head x V block) programs on their first: a ``ValueError`` past CUDA's
    65535, or past 2^31 - 1 at the narrowest V block (16)."""
    units = N * HV * cdiv(V, 16)
    if units > MAX_GRID_X:
        raise ValueError(f"cu_seqlens / v: {N} sequences x {HV} value heads x {cdiv(V, 16)} V blocks make {units} "
                         f"state-pass programs, more than one launch takes ({MAX_GRID_X}); split the call")
    if B * HV > MAX_GRID_Y:
        raise ValueError(f"q / v: batch {B} x {HV} value heads = {B * HV} programs, more than one launch takes "
                         f"along a grid axis ({MAX_GRID_Y}); pass the sequences as one varlen batch (cu_seqlens)")
    if NG > MAX_GRID_Y:
        raise ValueError(f"q: {NG} chunks of {BT} tokens per sequence (or in all, varlen), more than one launch "
                         f"takes along a grid axis ({MAX_GRID_Y}); split the call")


def _check_cu(name: str, cu: list[int], T: int) -> list[int]:
    """Host values of cu_seqlens: non-decreasing within [0, T] (tokens outside [cu[0], cu[N]) are padding)."""
    if cu[0] < 0 or cu[-1] > T or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"{name}: must be non-decreasing within [0, T={T}], got {cu}")
    return cu


def read_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """Host copy of ``cu_seqlens`` (any strides), checked: non-decreasing within [0, T]."""
    return _check_cu("cu_seqlens", cu_seqlens.tolist(), T)


def host_bounds(cu_seqlens: torch.Tensor | None, T: int, *, need: bool = False) -> list[int] | None:
    """cu_seqlens' checked host values where a call reads them: a CPU tensor (no sync), or wherever ``need`` (the
    torch reference, a result sized by the real chunk count); None where the plan is built on the device instead,
    for no cu_seqlens, and while torch.compile traces (the custom ops plan inside themselves)."""
    if cu_seqlens is None or torch.compiler.is_compiling():
        return None
    if need or not plans_on_device(cu_seqlens):
        return read_cu_seqlens(cu_seqlens, T)
    return None


def host_cu_seqlens(cu_seqlens_cpu, cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """fla's ``cu_seqlens_cpu`` (a 1-D CPU int32 / int64 tensor or a sequence of integers), the host copy of
    ``cu_seqlens`` (checked ``[N+1]``, or None), as a checked list: its shape, non-decreasing within ``[0, T]``, and
    equal to ``cu_seqlens`` where that is a CPU tensor (read with no sync; not while torch.compile traces)."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu: given without cu_seqlens (it is the host copy of cu_seqlens)")
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens_cpu: expected a CPU int32/int64 tensor, got a {cu_seqlens_cpu.dtype} "
                            f"tensor on {cu_seqlens_cpu.device}")
        if cu_seqlens_cpu.dim() != 1:
            raise ValueError(f"cu_seqlens_cpu: expected a 1-D tensor, got shape {list(cu_seqlens_cpu.shape)}")
        cu = cu_seqlens_cpu.tolist()
    elif isinstance(cu_seqlens_cpu, (list, tuple)) and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu_seqlens_cpu):
        cu = [int(x) for x in cu_seqlens_cpu]
    else:
        raise TypeError(f"cu_seqlens_cpu: expected a CPU integer tensor or a sequence of ints, got "
                        f"{type(cu_seqlens_cpu).__name__}")
    if len(cu) != cu_seqlens.numel():
        raise ValueError(f"cu_seqlens_cpu: expected {cu_seqlens.numel()} values (the shape of cu_seqlens), got "
                         f"{len(cu)}")
    _check_cu("cu_seqlens_cpu", cu, T)
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling() and cu_seqlens.tolist() != cu:
        raise ValueError(f"cu_seqlens_cpu: {cu} differs from cu_seqlens {cu_seqlens.tolist()}")
    return cu


@functools.lru_cache(maxsize=32)
def _chunk_index(seq_cu: tuple[int, ...], BT: int, device: torch.device,
                 stream: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Varlen chunk programs of the sequences ``seq_cu`` in chunks of BT tokens: (NTT, cidx [NTT, 2] int32,
    coff [N+1] int32). ``stream`` (``host.stream_key``) is part of the cache key only: the tensors arrive by a
    non-blocking copy, ordered before the kernels of the stream that made them and no other."""
    pairs, offs = [], [0]
    for n in range(len(seq_cu) - 1):
        c = cdiv(seq_cu[n + 1] - seq_cu[n], BT)
        pairs.extend((n, i) for i in range(c))
        offs.append(offs[-1] + c)
    cidx = device_ints(pairs, torch.int32, device).reshape(-1, 2)
    return len(pairs), cidx, device_ints(offs, torch.int32, device)


@functools.lru_cache(maxsize=32)
def _device_bounds(seq_cu: tuple[int, ...], device: torch.device, stream: int | None = None) -> torch.Tensor:
    """The sequence bounds ``seq_cu`` as the kernels of a plan built from host values read them (``[N+1]`` int64
    on ``device``; ``stream`` as ``_chunk_index``'s): the plan's own copy, so its chunk programs and state rows
    always match the bounds the kernels read, whatever the caller's ``cu_seqlens`` tensor holds (a
    ``cu_seqlens_cpu`` that differs from it, a pool row that aliases it)."""
    return device_ints(seq_cu, torch.int64, device)


# sequence splitting chains [K, K] fp32 segment maps in one program: at K 256 such a map alone (256 KiB) is more than
# an H100 / H200 SM's shared memory, so longer keys keep one sequential program per sequence
SEG_MAX_K = 128


def seg_len(cfg: ChunkConfig, units: int, max_chunks: int) -> int:
    """Chunks per segment for sequence splitting, or 0 to keep one sequential program per sequence: split when the
    (sequence x value head) units are fewer than ``seg_below``, into about ``seg_units`` units in all, with
    segments of at least ``seg_min`` chunks."""
    if not cfg.seg_units or units >= cfg.seg_below:
        return 0
    L = max(cfg.seg_min, cdiv(max_chunks, cdiv(cfg.seg_units, units)))
    return L if L < max_chunks else 0


@functools.lru_cache(maxsize=32)
def _seg_plan(seq_cu: tuple[int, ...], L: int, BT: int, device: torch.device, stream: int | None = None) -> SegPlan:
    """Split each sequence (token bounds ``seq_cu``) into segments of L chunks of BT tokens (``stream``: as
    ``_chunk_index``'s)."""
    cu, rows, soff = [seq_cu[0]], [], [0]
    row = 0
    for a, b in zip(seq_cu[:-1], seq_cu[1:], strict=True):
        nc = cdiv(b - a, BT)
        for c in range(0, nc, L):
            rows.append(row + c)
            cu.append(min(a + (c + L) * BT, b))
        if nc == 0:
            rows.append(row)
            cu.append(b)
        row += nc
        soff.append(len(rows))
    return SegPlan(len(rows), device_ints(cu, torch.int64, device), device_ints(rows, torch.int32, device),
                   device_ints(soff, torch.int32, device), L)


@functools.lru_cache(maxsize=64)
def _impl_config(cfg: ChunkConfig, impl: str) -> ChunkConfig:
    """``cfg`` as ``impl`` (``"triton"`` / ``"gluon"``) runs it (``chunk_plan``)."""
    if impl == "triton":
        return cfg.replace(sout_impl="triton")
    return cfg.replace(sout_impl="gluon", sout_gluon_units=0, sout_chunks=cfg.sout_chunks or 1, seg_units=0)


def chunk_plan(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
               cu_host: list[int] | None = None, chunk_size: int = BT, impl: str = "auto") -> ChunkPlan:
    """The plan of a call with q ``[B, T, H, K]``, v ``[B, T, HV, V]`` and ``cu_seqlens`` (or None), in chunks of
    ``chunk_size`` tokens (one of ``CHUNK_SIZES``). ``cu_host``: ``read_cu_seqlens``' copy where the caller has it;
    otherwise cu_seqlens is read here when it is a CPU tensor, and the plan built on the device when it is not
    (``device_plan``). ``impl``: ``"auto"`` keeps the table's config; ``"triton"`` never runs the Gluon ``sout``
    kernel; ``"gluon"`` runs it for every forward without gradient (sequences unsplit, no unit threshold; the caller
    has checked that it can, ``launch.sout_sm90_unsupported``)."""
    BT = chunk_size
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gpu = device_info(q)
    cfg = fit_shared(select_config("gdn_chunk", config_key(K, V), info=gpu), q.dtype)
    if impl in ("triton", "gluon"):
        cfg = _impl_config(cfg, impl)
    if cu_seqlens is not None and cu_host is None and plans_on_device(cu_seqlens):
        return device_plan(cfg, gpu, cu_seqlens, T, HV, K, BT, V)
    if cu_seqlens is None:
        NT = cdiv(T, BT)
        seq_cu = tuple(b * T for b in range(B + 1))
        NTT, NG, cidx, coff, cu = B * NT, NT, None, None, None
    else:
        seq_cu = tuple(cu_host if cu_host is not None else read_cu_seqlens(cu_seqlens, T))
        NTT, cidx, coff = _chunk_index(seq_cu, BT, cu_seqlens.device, stream_key(cu_seqlens.device))
        NT, NG, cu = 0, NTT, _device_bounds(seq_cu, cu_seqlens.device, stream_key(cu_seqlens.device))
    N = len(seq_cu) - 1
    _check_grid(B, HV, NG, BT, N, v.shape[3])
    longest = NT if cu_seqlens is None else max(cdiv(b - a, BT) for a, b in zip(seq_cu[:-1], seq_cu[1:], strict=True))
    L = seg_len(cfg, N * HV, longest) if K <= SEG_MAX_K else 0
    seg = _seg_plan(seq_cu, L, BT, q.device, stream_key(q.device)) if L else None
    padding = cu_seqlens is not None and (seq_cu[0] > 0 or seq_cu[-1] < T)
    keep_for_replays(cidx, coff, cu, *(seg[1:4] if seg is not None else ()))  # cached: a captured graph reads them
    return ChunkPlan(cfg, gpu, BT, N, seq_cu, cu, NTT, NT, NG, cidx, coff, seg, longest, padding)


PLAN_BLOCK = 1024  # entries per step of the device plan's passes


def plans_on_device(cu_seqlens: torch.Tensor) -> bool:
    """Whether a varlen call without a host copy of ``cu_seqlens`` builds its plan on the device: wherever reading
    it would be a host sync (any device but the CPU)."""
    return cu_seqlens.device.type != "cpu"


def device_plan(cfg: ChunkConfig, gpu: DeviceInfo, cu_seqlens: torch.Tensor, T: int, HV: int, K: int, BT: int,
                V: int) -> ChunkPlan:
    """The plan of a varlen call (T tokens, HV value heads, key dim K, chunks of BT) from ``cu_seqlens`` ``[N+1]``
    as it lies on its device (any strides), by ``gdn_plan_kernel``: no host read. The bounds, from the shapes:
    N sequences in T tokens hold at most (T + N·(BT−1)) // BT chunks, the longest at most ceil(T/BT); segments of
    L chunks number at most chunks // L + N. Sequence splitting is chosen as ``chunk_plan`` chooses it, with the
    longest sequence taken at its bound."""
    N = cu_seqlens.numel() - 1
    NTT = (T + N * (BT - 1)) // BT
    _check_grid(1, HV, NTT, BT, N, V)
    longest = cdiv(T, BT)
    L = seg_len(cfg, N * HV, longest) if K <= SEG_MAX_K else 0
    NSEG = NTT // L + N if L else 0
    dev = cu_seqlens.device
    i64 = empty(N + 1 + (NSEG + 1 if L else 0), dtype=torch.int64, device=dev)
    i32 = empty(N + 1 + 2 * NTT + (NSEG + N + 1 if L else 0), dtype=torch.int32, device=dev)
    cu, coff = i64[:N + 1], i32[:N + 1]
    cidx = i32[N + 1:N + 1 + 2 * NTT].view(NTT, 2)
    seg_cu, seg_coff, soff = i64[N + 1:], i32[N + 1 + 2 * NTT:][:NSEG], i32[N + 1 + 2 * NTT + NSEG:]
    with on_device(cu_seqlens.device):
        gdn_plan_kernel[(1,)](cu_seqlens, cu_seqlens.stride(0), cu, coff, cidx, seg_cu if L else cu,
                              seg_coff if L else coff, soff if L else coff, N, T, NTT, NSEG, N.bit_length(), max(L, 1),
                              BT=BT, SPLIT=L > 0, BLOCK=PLAN_BLOCK, num_warps=4)
    seg = SegPlan(NSEG, seg_cu, seg_coff, soff, L) if L else None
    return ChunkPlan(cfg, gpu, BT, N, None, cu, NTT, 0, NTT, cidx, coff, seg, longest, True, True)
