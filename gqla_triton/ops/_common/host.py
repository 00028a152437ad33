"""Host-side helpers for launchers: integer math in plain Python (``triton.cdiv`` / ``triton.next_power_of_2`` are
constexpr functions whose calls cost about a microsecond each, which adds up on the small-launch paths), device
tensors from host values, and the device a launch runs on."""

import contextlib

import torch

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third axes
MAX_GRID_X = 2**31 - 1  # and on its first


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def device_ints(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``values`` (host integers) as a tensor of ``dtype`` on ``device``. To a CUDA device they travel through
    pinned host memory in a non-blocking copy, so building a plan does not wait for the GPU (torch's caching host
    allocator keeps the pinned buffer until the copy has run). During CUDA-graph capture the plain copy is used: a
    captured copy would re-read a pinned buffer that is reused after the call."""
    device = torch.device(device)
    if device.type != "cuda" or capturing(device):
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def capturing(device: torch.device) -> bool:
    """Whether the current stream captures a CUDA graph (``device`` a CUDA one)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_REPLAYED: dict[int, torch.Tensor] = {}  # id -> a cached device tensor a captured graph reads


def keep_for_replays(*tensors: torch.Tensor | None) -> None:
    """Keep ``tensors`` (None: absent) alive for good where a CUDA graph is being captured on their device: they
    come from caches that drop entries (``functools.lru_cache``), and the graph reads their memory at every replay,
    which another allocation could take once the cache dropped them. Nothing happens outside a capture."""
    for t in tensors:
        if t is not None and capturing(t.device):
            _REPLAYED[id(t)] = t


def stream_key(device) -> int | None:
    """The current stream of a CUDA ``device`` (its ``stream_id``), else None: the key under which host-built
    device tensors that arrived by ``device_ints``' non-blocking copy may be reused."""
    device = torch.device(device)
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None


def on_device(device: torch.device):
    """A context in which ``device`` is the current CUDA device: a no-op where it already is (one device query) and
    for tensors off CUDA. Triton and Gluon launch a kernel on the current device and its current stream, whatever
    device its tensors are on; every launch of this package runs inside this context for its tensors' device, so
    tensors on a GPU other than the current one (a model spread over GPUs, e.g. by transformers' ``device_map``)
    are read by a kernel on their own GPU, ordered on that GPU's current stream."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
