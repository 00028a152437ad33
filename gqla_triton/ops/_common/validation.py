"""Input validation shared by every public op: clear ``TypeError``/``ValueError`` naming the argument."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterable, Sequence

import torch

from ...dispatch import is_interpreter
from .boundary import traced

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32,)
MAX_KEYS = 2**30  # most key positions one sequence may address (block-table capacity, topk): int32-safe tiles
MAX_NUM_SPLITS = 1024  # largest explicit split-KV count
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_LOG2E = 1.4426950408889634


def check_dense(name: str, t: object) -> torch.Tensor:
    """``t`` is a dense (strided, not nested) tensor: a ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got a {'nested' if t.is_nested else t.layout} one")
    return t


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a dense (strided, not nested) tensor of the given rank, dtype set, shape (``None`` = any)
    and device, without a lazy negation or conjugation bit (the kernels read its memory as it is)."""
    check_dense(name, t)
    if not torch.compiler.is_compiling() and (t.is_neg() or t.is_conj()):  # (torch.compile cannot trace these)
        raise ValueError(f"{name}: a view with a lazy negation / conjugation bit (torch._neg_view, .conj()): the kernels "
                         f"read its memory as it is; pass {name}.resolve_neg() / .resolve_conj()")
    got = t.shape
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(got) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(got)}")
    if dtypes is not None:
        if not isinstance(dtypes, tuple):
            dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if shape is not None and got != tuple(shape):  # equal sizes (no wildcard) pass without the loop
        for i, want in enumerate(shape):
            if want is not None and got[i] != want:
                want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
                raise ValueError(f"{name}: expected shape {want_s}, got {list(got)} (dim {i})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    """All tensors (None: absent) share one dtype; returns it."""
    first = dtype = None
    for k, v in tensors.items():
        if v is None:
            continue
        if dtype is None:
            first, dtype = k, v.dtype
        elif v.dtype != dtype:
            raise TypeError(f"{k}: expected dtype {dtype} (same as {first}), got {v.dtype}")
    return dtype


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All tensors (None: absent) are tensors on one device; returns it."""
    first = dev = None
    for k, v in tensors.items():
        if v is None:
            continue
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{k}: expected a torch.Tensor, got {type(v).__name__}")
        if dev is None:
            first, dev = k, v.device
    for k, v in tensors.items():
        if v is not None and k != first and v.device != dev:
            raise ValueError(f"{k}: expected a tensor on {dev} (same as {first}), got one on {v.device}")
    return dev


def check_multiple(name: str, value: int, multiple: int, *, upper: int | None = None) -> None:
    if value <= 0 or value % multiple != 0 or (upper is not None and value > upper):
        bound = f" and <= {upper}" if upper is not None else ""
        raise ValueError(f"{name}: expected a positive multiple of {multiple}{bound}, got {value}")


def check_scale(name: str, value: object, default: float, *, factor: float = 1.0) -> float:
    """A scale argument as a float: ``default`` for None, else a real number (not a bool) whose product with
    ``factor`` is 0 or a normal float32 number (the kernels take ``value · factor`` as a float32)."""
    if value is None:
        return float(default)
    check_real_type(name, value, "a finite real number or None")
    try:
        scale = float(value)
    except OverflowError:
        scale = math.inf
    if not is_finite_real(scale) or abs(scale) * factor > _F32_MAX:
        raise ValueError(f"{name}: expected a finite real number of magnitude <= {_F32_MAX / factor:.3g} "
                         f"(float32 range) or None, got {value!r}")
    if scale != 0 and abs(scale) * factor < _F32_TINY:  # float32 would make it 0 or subnormal (0 · inf = NaN)
        raise ValueError(f"{name}: expected 0 or a magnitude >= {_F32_TINY / factor:.3g} (float32's smallest normal "
                         f"number), got {value!r}")
    return scale


def check_softmax_scale(softmax_scale: object, default: float) -> float:
    """``softmax_scale`` of the decode ops: ``check_scale`` with the kernels' factor log2(e)."""
    return check_scale("softmax_scale", softmax_scale, default, factor=_LOG2E)


INT32_MAX = 2**31 - 1


def is_int(value: object) -> bool:
    """An integer of any size (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real_type(name: str, value: object, expected: str) -> None:
    """``value`` is a real number (numpy's too), not a bool, a string or a tensor: else a ``TypeError``
    ``"{name}: expected {expected}, ..."`` (a real number outside its range is the caller's ``ValueError``)."""
    if not is_real(value):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


def check_str_type(name: str, value: object, expected: str) -> None:
    """``value`` is a ``str``: else a ``TypeError`` ``"{name}: expected {expected}, ..."`` (a string that names
    nothing is the caller's ``ValueError``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


def check_choice(name: str, value: object, choices: Iterable[str], *, optional: bool = False) -> str | None:
    """One of the strings ``choices`` (None too where ``optional``): a non-string is a ``TypeError``, a string not
    among them a ``ValueError``, each naming ``name`` and the choices."""
    if optional and value is None:
        return None
    choices = tuple(choices)
    expected = f"{'None or ' if optional else ''}one of {choices}"
    check_str_type(name, value, expected)
    if value not in choices:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def check_int_type(name: str, value: object, expected: str) -> None:
    """``value`` is an int (numpy's too), not a bool: else a ``TypeError`` ``"{name}: expected {expected}, ..."``
    (a value of the right type outside its range is the caller's ``ValueError``, with the same words)."""
    if not is_int(value):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


def check_positive_int(name: str, value: object, *, hi: int = INT32_MAX) -> int:
    """A count or size: an int in ``[1, hi]`` (bools and non-integers are a ``TypeError``; sizes are int32 on the
    GPU)."""
    expected = f"a positive int (at most {hi})"
    check_int_type(name, value, expected)
    if not 0 < value <= hi:
        raise ValueError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return int(value)


def check_page_size(page_size: object, name: str = "page_size") -> int:
    """Tokens per page of a paged cache: a positive multiple of 16 within int32 (bools refused)."""
    check_int_type(name, page_size, "a positive multiple of 16")
    if not 0 < page_size <= INT32_MAX or page_size % 16 != 0:
        raise ValueError(f"{name}: expected a positive multiple of 16, got {page_size!r}")
    return int(page_size)


def check_int_in(name: str, value: object, lo: int, hi: int = INT32_MAX, *, optional: bool = False) -> int | None:
    """An int in ``[lo, hi]`` (None too where ``optional``): a non-integer (a bool too) is a ``TypeError``, an int
    outside the range a ``ValueError``."""
    if optional and value is None:
        return None
    expected = f"{'None or ' if optional else ''}an int in [{lo}, {hi}]"
    check_int_type(name, value, expected)
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return int(value)


def check_optional_int(name: str, value: object, *, lo: int = 1, hi: int = INT32_MAX) -> int | None:
    """None, or an int in ``[lo, hi]`` (``check_int_in``)."""
    return check_int_in(name, value, lo, hi, optional=True)


def check_rank(tp_rank: object, tp_size: object) -> None:
    """A tensor-parallel rank and size: ints (bools refused: ``TypeError``), ``0 <= tp_rank < tp_size``."""
    for name, v in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        check_int_type(name, v, "an int")
    if tp_size <= 0:
        raise ValueError(f"tp_size: expected a positive int, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected an int in [0, {tp_size}), got {tp_rank}")


def check_device(device: object, *, storage: bool = False, name: str = "device") -> torch.device | None:
    """None, or ``device`` as a ``torch.device``: a device, a device string or a CUDA index (bools refused), a CUDA
    device that exists here (not counted while ``torch.compile`` traces, where the device is a traced tensor's and
    the count would break the graph); with ``storage`` not ``meta`` (which holds no values). Another type is a
    ``TypeError``."""
    if device is None:
        return None
    expected = "a torch.device, a device string or a CUDA index"
    if not isinstance(device, (torch.device, str)) and not is_int(device):
        raise TypeError(f"{name}: expected {expected}, got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is not None and (is_int(device) or (isinstance(device, str) and ":" in device)):
        index = device if is_int(device) else device.rpartition(":")[2]
        if str(index) != str(dev.index):  # torch keeps an index in 8 bits: "cuda:256" would be cuda:0
            dev = None
    if dev is None:
        raise ValueError(f"{name}: expected {expected}, got {device!r}")
    if storage and dev.type == "meta":
        raise ValueError(f"{name}: expected a device with storage, got meta (it holds no values)")
    if dev.type == "cuda" and not torch.compiler.is_compiling():  # traced: a tensor's device, which exists
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"{name}: {dev} does not exist ({count} CUDA devices visible)")
    return dev


def is_finite_real(value: object) -> bool:
    """A real number (not a bool) with a finite float value: an int too large for a float is not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if isinstance(value, numbers.Integral):
        try:
            return math.isfinite(value)
        except OverflowError:
            return False
    # inf - inf and nan are nan; unlike math.isfinite this traces under torch.compile, where a float attribute of a
    # module may be symbolic (dynamic=True)
    return bool(value - value == 0)


def check_positive_real(name: str, value: object) -> float:
    """A positive, finite real number (bools, strings and tensors: ``TypeError``)."""
    check_real_type(name, value, "a positive, finite real number")
    if not is_finite_real(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive, finite real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_norm_eps(name: str, value: object) -> float:
    """A layer's RMSNorm epsilon: a positive, finite real number that is a normal float32 number or larger (the
    norms add it in float32, where a smaller one is 0 or subnormal and a zero row would normalise to NaN)."""
    eps = check_positive_real(name, value)
    if eps < _F32_TINY:
        raise ValueError(f"{name}: expected at least float32's smallest normal number {_F32_TINY:.3g}, got {value!r}")
    return eps


def check_eps(name: str, value: object) -> float:
    """A norm's epsilon: a finite real number >= 0 (bools, strings and tensors: ``TypeError``)."""
    check_real_type(name, value, "a finite real number >= 0")
    if not is_finite_real(value) or value < 0:
        raise ValueError(f"{name}: expected a finite real number >= 0, got {type(value).__name__} {value!r}")
    return float(value)


def check_float_dtype(dtype: object, *, optional: bool = True, name: str = "dtype", float8: bool = False) -> None:
    """A floating ``torch.dtype`` (or None where ``optional``) of 16 bits or more: the ``dtype`` arguments of
    parameters and states, whose float8 values would need scales such tensors do not carry; ``float8``: float8
    dtypes too (cache storage, which keeps its scales)."""
    if dtype is None and optional:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or (dtype.itemsize < 2 and not float8):
        raise TypeError(f"{name}: expected {'None or ' if optional else ''}a floating torch.dtype"
                        f"{'' if float8 else ' of 16 bits or more'}, got {dtype!r}")


def check_bools(**flags: object) -> None:
    """Each of ``flags`` is a ``bool`` (no integer stands in): a ``TypeError`` naming the first that is not."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def check_flag(name: str, value: object) -> bool:
    """A boolean option: ``bool`` (or an integer 0 / 1); anything else is a ``TypeError``."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else \
        f"{type(value).__name__} {value!r}"
    raise TypeError(f"{name}: expected a bool, got {got}")


def check_num_splits(num_splits: object) -> int:
    """The split-KV count of the decode ops: an int in ``[0, MAX_NUM_SPLITS]`` (0 = chosen from shapes;
    ``check_int_in``)."""
    return check_int_in("num_splits", num_splits, 0, MAX_NUM_SPLITS)


def check_kernel_device(device: torch.device, reference: str, *dtypes: torch.dtype | None) -> None:
    """Triton kernels run on CUDA, or on CPU only under ``TRITON_INTERPRET=1``: never a silent fallback. The
    interpreter computes bfloat16 wrongly (triton#11584), so bfloat16 among ``dtypes`` is refused there."""
    interpreter = is_interpreter()
    if device.type == "cuda" and not interpreter:
        return
    if interpreter:
        if torch.bfloat16 in dtypes:
            raise TypeError("bfloat16 inputs: Triton's CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 "
                            "wrongly (triton#11584); use float16 or float32 there, bfloat16 on a GPU, or "
                            f"{reference} (impl='reference')")
        if device.type in ("cpu", "cuda"):
            return
    raise RuntimeError(
        f"gqla_triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); got tensors "
        f"on {device}. For a pure-torch path on any device use impl='reference' ({reference})."
    )


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The address range ``[first byte, end byte)`` the elements of ``t`` span (None when empty)."""
    n = t.numel()
    if n == 0:
        return None
    ptr, size = t.data_ptr(), t.element_size()
    if t.is_contiguous():
        return ptr, ptr + n * size
    return ptr, ptr + (sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True)) + 1) * size


def check_disjoint(name: str, t: torch.Tensor | None, **others: torch.Tensor | None) -> None:
    """``t``, which the call writes in place, shares no bytes with ``others`` (None: absent), which it reads: a
    ``ValueError`` naming both otherwise (the kernels would read values they have already overwritten). Judged by
    the address ranges the tensors span, so interleaved views of one buffer are refused too. Not judged while
    ``boundary.traced()`` (tensors without storage; the custom op's body judges its own)."""
    if t is None or traced() or t.device.type == "meta":
        return
    a = _byte_span(t)
    if a is None:
        return
    for other, o in others.items():
        b = _byte_span(o) if o is not None else None
        if b is not None and a[0] < b[1] and b[0] < a[1]:
            raise ValueError(f"{name}: shares memory with {other} ({name} is written in place while {other} is "
                             "read); pass separate tensors")


def inference_writes(t: torch.Tensor):
    """The context in which ``t`` is written in place by torch ops: ``torch.inference_mode()`` for an inference
    tensor (torch refuses its in-place updates elsewhere), else none. The reference paths write state pools through
    it, so they take the pools the kernels take (kernels write raw memory)."""
    return torch.inference_mode() if t.is_inference() else contextlib.nullcontext()


def check_inference_mode(name: str, t: torch.Tensor) -> None:
    """A cache whose tensors (``t`` one of them) were made under ``torch.inference_mode()`` is updated in place only
    inside inference mode, where torch allows it: ``RuntimeError`` before any change, not half-way through one. Not
    judged while torch.compile traces."""
    if not torch.compiler.is_compiling() and t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name}: this cache was made under torch.inference_mode(), so its tensors can be updated "
                           "only inside inference mode; call it there (or make the cache outside it)")


def check_pool_rows(name: str, rows: torch.Tensor, pool_rows: int) -> None:
    """A CPU tensor of state-pool rows: every row it names (>= 0; a negative entry skips its sequence) lies in
    ``[0, pool_rows)`` and is named once, since two sequences updating one row in place would race. Rows on a device
    are not read (no sync)."""
    if rows.device.type != "cpu":
        return
    named = rows[rows >= 0]
    if not named.numel():
        return
    hi = int(named.max())
    if hi >= pool_rows:
        raise ValueError(f"{name}: row {hi} is outside the state pool [0, {pool_rows})")
    uniq, counts = named.unique(return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{name}: pool row {int(uniq[counts > 1][0])} is named by more than one sequence")


def check_decode_inputs(
    q: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    num_pages: int,
    page_size: int,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    num_groups: int | None = None,
    num_splits: int = 0,
    cache_name: str = "kv_cache",
) -> None:
    """Checks shared by the paged decode ops (q ``[B, s_q, h_q, D]``); device values are never read.

    ``page_size`` (dim 1 of the cache, named ``cache_name`` in messages): a multiple of 16 for dense calls, any
    positive size with ``indices`` (sparse rows are addressed one by one). ``num_groups`` set: ``indices`` may also
    be per group, ``[B, s_q, g, topk]``.
    """
    B, s_q = q.shape[0], q.shape[1]
    if B == 0 or s_q == 0:
        raise ValueError(f"q: batch and s_q must be >= 1, got shape {list(q.shape)}")
    check_tensor("block_table", block_table, shape=(B, None), dtypes=INDEX_DTYPES, device=q.device)
    check_tensor("cache_seqlens", cache_seqlens, shape=(B,), dtypes=INDEX_DTYPES, device=q.device)
    if block_table.shape[1] == 0:
        raise ValueError("block_table: expected at least one page column, got shape " + str(list(block_table.shape)))
    # dense key tiles are page-aligned; sparse rows are addressed one by one
    if page_size <= 0 or (indices is None and page_size % 16):
        raise ValueError(f"{cache_name}: page_size (dim 1) must be a positive multiple of 16 for dense calls, positive "
                         f"for sparse ones, got {page_size}")
    if num_pages <= 0:
        raise ValueError(f"{cache_name}: expected at least one page (dim 0), got {num_pages}")
    if block_table.shape[1] * page_size > MAX_KEYS:
        raise ValueError(f"block_table: {block_table.shape[1]} pages x page_size {page_size} address more than "
                         f"{MAX_KEYS} tokens per sequence")
    check_num_splits(num_splits)
    if indices is not None:
        shapes = [(B, s_q, None)] + ([(B, s_q, num_groups, None)] if num_groups else [])
        if not any(indices.dim() == len(s) for s in shapes):
            want = " or ".join("[" + ", ".join("topk" if d is None else str(d) for d in s) + "]" for s in shapes)
            raise ValueError(f"indices: expected shape {want}, got {list(indices.shape)}")
        check_tensor("indices", indices, shape=shapes[0] if indices.dim() == 3 else shapes[1],
                     dtypes=INDEX_DTYPES, device=q.device)
        if not 1 <= indices.shape[-1] <= MAX_KEYS:
            raise ValueError(f"indices: topk (last dimension) must be in [1, {MAX_KEYS}], got {indices.shape[-1]}")
        if num_pages * page_size > INT32_MAX:  # sparse_rows hands the kernels int32 cache rows
            raise ValueError(f"{cache_name}: {num_pages} pages x {page_size} tokens hold more rows than the int32 row "
                             f"indices of sparse calls address ({INT32_MAX})")
    if topk_length is not None:
        if indices is None:
            raise ValueError("topk_length: given without indices (it limits each sparse index row)")
        check_tensor("topk_length", topk_length, shape=(B,), dtypes=INDEX_DTYPES, device=q.device)


def contiguous_indices(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The decode kernels read index tensors (``block_table``, ``cache_seqlens``, ``indices``, ``topk_length``) with
    unit stride along their last dimension and a contiguous row layout: strided, expanded (stride 0) or transposed
    views are copied (cheap for these small int32 tensors, and safe inside a CUDA graph); contiguous ones pass
    through untouched, and so does a 2-D table whose rows are one shared row (batch stride 0, unit stride along
    it: ``row.expand(B, n)``), since every kernel takes a block table's batch stride."""
    return tuple(t if t is None or t.is_contiguous() or _shared_row(t) else t.contiguous() for t in tensors)


def aligned_start(t: torch.Tensor) -> bool:
    """Whether ``t`` starts on a 16-byte boundary, or lies off the GPU, or has no address to read (a fake tensor, or
    any tensor while ``torch.compile`` traces: it cannot trace ``data_ptr``, and the custom ops' bodies, which run on
    the real tensors, check and copy again)."""
    if not t.is_cuda or torch.compiler.is_compiling():
        return True
    try:
        return t.data_ptr() % 16 == 0
    except Exception:  # fake / functional tensors have no storage to point at
        return True


def contiguous(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each tensor (None: None) contiguous and, on a GPU, starting on a 16-byte boundary (copied where not), for
    kernels that read their inputs without strides: the custom ops' bodies, which a compiled graph or a direct
    ``torch.ops`` call may hand any strides. A view one element past a boundary is contiguous but not aligned:
    Triton 3.6's pipelined loads of such a ``q`` faulted with an illegal address on an H100 (chunked GDN forward)."""
    return tuple(t if t is None else t.contiguous() if aligned_start(t) else t.clone(memory_format=torch.contiguous_format)
                 for t in tensors)


def rows_aligned(t: torch.Tensor, *, offset: bool = True) -> bool:
    """Whether a GPU kernel may read ``t`` in place: unit stride along its last dimension and every row on a
    16-byte boundary (each other stride of a dim longer than 1, in bytes, and with ``offset`` the start address, a
    multiple of 16), as the decode kernels' vector loads take it. Rows 8 bytes apart fault with a misaligned address
    (an H100, Triton 3.6: the paged key tiles of a cache sliced from wider rows)."""
    size = t.element_size()
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    if any(n > 1 and st * size % 16 for n, st in zip(t.shape[:-1], t.stride()[:-1], strict=True)):
        return False
    return not offset or t.data_ptr() % 16 == 0


def check_rows_aligned(name: str, t: torch.Tensor | None) -> None:
    """``t`` (None: absent), a cache the kernels read in place, has ``rows_aligned`` rows where it is on a GPU
    (``ValueError``; the interpreter reads any). Under ``torch.compile`` the start address is not traced: the op's
    body copies such a view (``unit_last_stride``)."""
    if t is not None and t.is_cuda and not rows_aligned(t, offset=not torch.compiler.is_compiling()):
        row = t.shape[-1] * t.element_size()
        fix = ("a .clone() has them" if row % 16 == 0 else
               f"its rows of {row} bytes need a view into rows padded to a multiple of 16 bytes, "
               f"e.g. torch.zeros(..., {padded_width(t.shape[-1], t.element_size())})[..., :{t.shape[-1]}]")
        raise ValueError(f"{name}: the kernels read its rows in place with 16-byte loads: unit stride along the last "
                         f"dimension and every other stride and the start address, in bytes, multiples of 16, got "
                         f"strides {list(t.stride())} and storage offset {t.storage_offset()} of "
                         f"{t.element_size()}-byte elements ({fix})")


def padded_width(n: int, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes in a row of ``n`` of them padded to a multiple of 16 bytes (``rows_aligned``
    rows)."""
    return -(-n * itemsize // 16) * 16 // itemsize


def aligned_rows_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in new memory whose rows are ``rows_aligned``: a view into rows of ``padded_width`` (contiguous
    where the row width is a multiple of 16 bytes)."""
    wide = t.new_empty(*t.shape[:-1], padded_width(t.shape[-1], t.element_size()))[..., :t.shape[-1]]
    return wide.copy_(t)


def unit_last_stride(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each tensor (None: None) as the kernels that take every stride but the last read it: unit stride along the
    last dimension, and on a GPU ``rows_aligned``; else ``aligned_rows_copy``. For the custom ops' bodies (the
    public functions refuse such views; a compiled graph or a direct ``torch.ops`` call may hand them any
    strides)."""
    return tuple(t if t is None or (t.stride(-1) == 1 and (not t.is_cuda or rows_aligned(t)))
                 else aligned_rows_copy(t) for t in tensors)


def check_contiguous(name: str, t: torch.Tensor | None, *, aligned: bool = True) -> None:
    """``t`` (None: absent), which a kernel updates in place without strides, is contiguous and on a GPU starts on a
    16-byte boundary, as ``contiguous`` makes what the kernels only read (``ValueError``). ``aligned=False``: any
    start address, for integer counters a kernel reads and writes one element at a time (no rounding that another
    vector width could change)."""
    if t is None:
        return
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (it is updated in place)")
    if aligned and not aligned_start(t):
        raise ValueError(f"{name}: expected a start address on a 16-byte boundary on the GPU (it is updated in "
                         f"place), got one {t.data_ptr() % 16} bytes past")


def _shared_row(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 0 and t.stride(1) == 1


def requires_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a call on these inputs (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def refuse_grad(op: str, hint: str = "", **tensors: torch.Tensor | None) -> None:
    """For an op that updates a state in place (so it has no autograd formula): a ``RuntimeError`` naming the first of
    ``tensors`` that requires grad under autograd, with ``hint`` after the advice."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise RuntimeError(f"{op} is forward-only (inference): {name} requires grad under autograd. Run it under "
                               f"torch.no_grad() / torch.inference_mode(){hint}.")


def forward_only(custom_op, name: str) -> None:
    """Register a backward for the ``torch.library`` op ``custom_op`` that raises a ``RuntimeError`` naming ``name``:
    its outputs keep a ``grad_fn`` when an input requires grad, so a backward through them fails loudly instead of
    the graph being cut silently. Callers route such calls through the custom op (``requires_grad``)."""

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} is forward-only: no gradient flows through it to its inputs; call it under "
                           "torch.no_grad() / torch.inference_mode(), or pass detached inputs")

    custom_op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
