"""Paged KV caches for GQLAttention: ``LatentCache`` (absorb path) and ``GroupedCache`` (grouped path).

Both hold ``max_batch`` sequence slots over ``num_pages`` pages of ``page_size`` tokens. The device tensors are
the truth the kernels read:

- ``block_table [max_batch, max_pages] int32``: logical page ``p`` of slot ``s`` lives in physical page
  ``block_table[s, p]``; entries past a slot's pages hold ``scratch_page``;
- ``cache_seqlens [max_batch] int32``: the tokens of each slot;
- ``overflow [max_batch] bool``: set where an append went past the slot's reserved pages (see below).

The storage has ``num_pages + 1`` pages: the last, ``scratch_page``, is never handed out and receives the
writes that have no reserved page. The host keeps the page bookkeeping (free list, each slot's pages, page
reference counts) and per slot a flag "holds tokens".

**Decode steps on the device.** ``append`` writes token ``t`` of slot ``s`` at position
``pos = cache_seqlens[s] + t``, in page ``block_table[s, pos // page_size]`` at offset ``pos % page_size``,
then advances ``cache_seqlens`` with a device op: no host sync, no host-to-device copy and no data-dependent
Python, so a step can be captured in a CUDA graph or compiled with ``torch.compile(fullgraph=True)``.
Pages come from ``reserve(seq_ids, num_tokens)``, a host call made before such steps. In eager mode (neither
capturing nor compiling) ``append`` reserves what it needs itself (``auto_reserve=True``, the default), so
plain eager loops need no ``reserve``. Inside a capture or a compiled function nothing is reserved: a token
past the reserved pages (or past ``max_seqlen``) goes to the scratch page, the slot's length stops at its
reservation and ``overflow[s]`` is set; ``check()`` turns the flags into an error. Every output of a step that
overflowed a slot is undefined for that slot (its queries are placed against the length where it stopped), not only
those of the tokens that found no page.

Eager ``append`` / ``reserve`` take the lengths from a host mirror. After an append inside a capture or a
compiled function (or with ``auto_reserve=False``), or a write to ``cache_seqlens`` from outside the cache's
methods (seen through its version counter; such a write must keep each length within its slot's reservation, else
the next eager call is a ``ValueError``), they read the device lengths instead: one host sync per call.
``reserve``, ``free`` and ``fork`` move page lists to the device: a ``RuntimeError`` inside a capture / compile.

**Slot ids** are host values (an int, a sequence of ints, a CPU tensor; a CUDA tensor would need a host sync:
``TypeError``). The device index of a tuple of slots is made on its first eager use and kept (64 tuples, the
oldest out first; a tuple that a CUDA graph captured is never dropped; the prefix ``0 .. B-1`` needs none, its
rows are a slice). A captured or compiled step with a tuple that has no index yet raises ``ValueError``: call
``slot_index(seq_ids)`` (or run one eager step) first.

**Prefix sharing.** ``fork(src, dst)`` gives ``dst`` the tokens of ``src``: the full pages are shared
(reference counted), the partly filled last page is copied. Written pages are never written again (appends
only go past a slot's length), so shared pages stay valid; ``free`` returns a page to the free list when its
last user frees it.

Every call that raises (``TypeError`` / ``ValueError``) leaves the cache as it was.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch

from ..ops._common.validation import (
    INT32_MAX,
    MAX_KEYS,
    check_device,
    check_disjoint,
    check_float_dtype,
    check_inference_mode,
    check_int_in,
    check_page_size,
    check_positive_int,
    check_real_type,
    check_scale,
    check_tensor,
    is_finite_real,
    is_int,
    padded_width,
)
from ..ops.mla.fp8 import E4M3_MAX, FP8_LATENT, FP8_ROPE, FP8_ROW_BYTES, dequantize_latent_fp8, quantize_latent_fp8
from .paged_append import cache_rows

__all__ = ["PagedCache", "LatentCache", "GroupedCache"]

_INDEX_CACHE_SIZE = 64  # slot-index tensors kept per cache (one per distinct tuple of slots), pinned ones aside
_MISSING = object()




def latent_compute_dtypes(dtype: torch.dtype, scaled: bool) -> tuple[torch.dtype, ...]:
    """The query dtypes a ``LatentCache`` of ``dtype`` serves, its default first: FlashMLA's FP8 layout bf16 or
    float32 (its rope values are bf16), a float8 cache scaled per tensor (``scaled``) bf16, fp16 or float32, any
    other cache its own dtype."""
    if dtype == torch.float8_e4m3fn:
        return (torch.bfloat16, torch.float16, torch.float32) if scaled else (torch.bfloat16, torch.float32)
    return (dtype,)


class PagedCache(abc.ABC):
    """Page allocator, block table and lengths shared by the two cache kinds (storage lives in subclasses).

    Args:
        max_batch: sequence slots.
        max_seqlen: most tokens one slot may hold (its block-table row, ``ceil(max_seqlen / page_size)`` pages,
            addresses at most 2**30 positions: the decode kernels' bound).
        page_size: tokens per page, a positive multiple of 16 (keyword-only, default 64).
        num_pages: pages to share among the slots (default ``max_batch * ceil(max_seqlen / page_size)``).
        device: of every tensor of the cache.
        auto_reserve: eager appends reserve the pages they need (default). With False an append takes no pages
            for its tokens (only ``reserve`` does) and one past the reservation is flagged for ``check()``, as
            inside a captured step, and it makes no host sync, except an eager append while pages are shared
            (``fork``): it reads the device lengths (one sync) and copies a shared page it would write.
    """

    def __init__(self, max_batch: int, max_seqlen: int, *, page_size: int = 64, num_pages: int | None = None,
                 device=None, auto_reserve: bool = True):
        self.max_batch = check_positive_int("max_batch", max_batch)
        self.max_seqlen = check_positive_int("max_seqlen", max_seqlen)
        self.page_size = check_page_size(page_size)
        self.max_pages = math.ceil(self.max_seqlen / self.page_size)
        if self.max_pages * self.page_size > MAX_KEYS:  # the decode ops' bound on a block table's positions
            raise ValueError(f"max_seqlen: {self.max_seqlen} tokens on pages of {self.page_size} make a block table of "
                             f"{self.max_pages * self.page_size} positions; the decode kernels address at most "
                             f"{MAX_KEYS} per sequence")
        self.num_pages = (self.max_batch * self.max_pages if num_pages is None
                          else check_positive_int("num_pages", num_pages))
        if (self.num_pages + 1) * self.page_size >= 2**31:
            raise ValueError(f"num_pages: {self.num_pages} pages x {self.page_size} tokens exceed int32 rows")
        if not isinstance(auto_reserve, bool):
            raise TypeError(f"auto_reserve: expected a bool, got {type(auto_reserve).__name__}")
        self.auto_reserve = auto_reserve
        self.scratch_page = self.num_pages
        dev = check_device(device, storage=True) or torch.device("cpu")
        # a normal tensor even under torch.inference_mode(), whose tensors keep no version counter: the counter is how
        # the host mirror of the lengths sees a write from outside the cache
        with torch.inference_mode(False):
            self.cache_seqlens = torch.zeros(self.max_batch, dtype=torch.int32, device=dev)
        self.device = self.cache_seqlens.device  # index resolved ("cuda" -> "cuda:0")
        self.block_table = torch.full((self.max_batch, self.max_pages), self.scratch_page, dtype=torch.int32,
                                      device=self.device)
        self.overflow = torch.zeros(self.max_batch, dtype=torch.bool, device=self.device)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._refs: list[int] = [0] * self.num_pages
        self._shared: set[int] = set()  # pages with more than one user (fork), copied before an append writes them
        self._pages: list[list[int]] = [[] for _ in range(self.max_batch)]
        self._cap: list[int] = [0] * self.max_batch  # tokens each slot's pages hold: min(pages·page_size, max_seqlen)
        self._holds: list[bool] = [False] * self.max_batch
        self._lens: list[int] = [0] * self.max_batch  # host mirror of cache_seqlens while _lens_known
        self._lens_known = True  # False once an append ran inside a capture / compiled function
        self._lens_stamp = self._stamp()
        self._index: dict[tuple[int, ...], torch.Tensor | None] = {}
        self._pinned: set[tuple[int, ...]] = set()

    # ---- storage (subclasses) ----------------------------------------------------------------------
    @abc.abstractmethod
    def _storages(self) -> tuple[torch.Tensor, ...]:
        """The storage tensors, each ``[num_pages + 1, page_size, ...]``."""

    @abc.abstractmethod
    def gather(self, seq_id: int) -> tuple[torch.Tensor, ...]:
        """One slot's cached tensors in logical token order (read through the device tables)."""

    # ---- slot ids ----------------------------------------------------------------------------------
    def _slots(self, seq_ids, n: int | None = None, name: str = "seq_ids") -> tuple[int, ...]:
        """Validated slot ids as a tuple: ``None`` (slots ``0 .. n-1``), an int, a host sequence of ints or a
        CPU integer tensor; distinct, inside ``[0, max_batch)``, ``n`` of them when ``n`` is given."""
        if seq_ids is None:
            if n is None:
                raise ValueError(f"{name}: required (a host sequence of slot ids)")
            if n > self.max_batch:
                raise ValueError(f"{name}: {n} sequences need {n} slots, the cache has max_batch {self.max_batch}")
            return tuple(range(n))
        if type(seq_ids) is tuple or type(seq_ids) is list:
            ids = tuple(seq_ids)
            if all(type(s) is int for s in ids) and ids in self._index:  # validated when cached (ints: hashable)
                if n is not None and len(ids) != n:
                    raise ValueError(f"{name}: expected {n} slots, got {len(ids)}")
                return ids
        elif isinstance(seq_ids, torch.Tensor):
            if seq_ids.device.type != "cpu":
                raise TypeError(f"{name}: expected host slot ids (a sequence of ints or a CPU tensor), got a tensor "
                                f"on {seq_ids.device} (reading it would need a host sync)")
            if seq_ids.dtype == torch.bool or seq_ids.is_floating_point() or seq_ids.is_complex():
                raise TypeError(f"{name}: expected an integer tensor, got {seq_ids.dtype}")
            if seq_ids.dim() > 1:
                raise ValueError(f"{name}: expected a 0-d or 1-d tensor, got shape {list(seq_ids.shape)}")
            ids = tuple(seq_ids.reshape(-1).tolist())
        elif is_int(seq_ids):
            ids = (int(seq_ids),)
        elif isinstance(seq_ids, (range, Sequence)) and not isinstance(seq_ids, (str, bytes)):
            ids = tuple(seq_ids)
        else:
            raise TypeError(f"{name}: expected None, an int, a sequence of ints or a CPU integer tensor, got "
                            f"{type(seq_ids).__name__}")
        for s in ids:
            if not is_int(s):
                raise TypeError(f"{name}: expected int slot ids, got {type(s).__name__} {s!r}")
        ids = tuple(int(s) for s in ids)
        for s in ids:
            if not 0 <= s < self.max_batch:
                raise ValueError(f"{name}: slot {s} outside [0, {self.max_batch})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}: duplicate slots in {list(ids)}")
        if n is not None and len(ids) != n:
            raise ValueError(f"{name}: expected {n} slots, got {len(ids)}")
        return ids

    def _slot(self, seq_id, name: str = "seq_id") -> int:
        if not is_int(seq_id):
            raise TypeError(f"{name}: expected an int slot id, got {type(seq_id).__name__} {seq_id!r}")
        if not 0 <= seq_id < self.max_batch:
            raise ValueError(f"{name}: slot {seq_id} outside [0, {self.max_batch})")
        return int(seq_id)

    def _index_of(self, ids: tuple[int, ...]) -> torch.Tensor | None:
        """Device index (int64) of validated slots, ``None`` for the prefix ``0 .. B-1`` (rows are then a
        slice). Made once per tuple in eager mode and kept (``_remember``): no host-to-device copy after that.
        A CUDA-graph capture or a torch.compile trace finds it there (and a captured graph pins it)."""
        idx = self._index.get(ids, _MISSING)
        if idx is not _MISSING:
            if idx is not None and not torch.compiler.is_compiling() and self._capturing():
                self._pinned.add(ids)  # the graph reads this tensor at every replay: never evict it
            return idx
        if ids == tuple(range(len(ids))):
            return None
        if self._device_only():
            raise ValueError(f"seq_ids: slots {list(ids)} have no device index yet; call cache.slot_index(seq_ids) "
                             "(or run one eager step with them) before capturing or compiling a step")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _remember(self, ids: tuple[int, ...], idx: torch.Tensor | None) -> None:
        if ids in self._index or torch.compiler.is_compiling():
            return
        if idx is not None:  # prefixes (no tensor) stay; other tuples: least recently made first out
            old = [k for k, v in self._index.items() if v is not None and k not in self._pinned]
            if len(old) >= _INDEX_CACHE_SIZE:
                del self._index[old[0]]
        self._index[ids] = idx

    def slot_index(self, seq_ids) -> torch.Tensor | None:
        """The cached device index (``[B]`` int64) of ``seq_ids``, ``None`` when they are ``0 .. B-1``.
        Call it (or run one eager step) before capturing a step with other slots in a CUDA graph. It is the
        cache's own tensor, which every later step with these slots reads: read it, never write it."""
        ids = self._slots(seq_ids)
        idx = self._index_of(ids)
        self._remember(ids, idx)
        return idx

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _device_only(self) -> bool:
        """Inside a CUDA-graph capture or a torch.compile trace: no host reads, no host bookkeeping."""
        return torch.compiler.is_compiling() or self._capturing()

    # ---- host queries ------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def _stamp(self) -> int | None:
        """Version counter of ``cache_seqlens`` (made outside inference mode, so it has one; a write through
        ``.numpy()`` or ``.data`` bypasses it and is not seen)."""
        try:
            return self.cache_seqlens._version
        except RuntimeError:
            return None

    def _mark_lens(self) -> None:
        self._lens_stamp = self._stamp()

    def __getstate__(self) -> dict:
        # a copy's cache_seqlens is a new tensor, its version counter restarted: the stamp is taken again there
        state = self.__dict__.copy()
        state["_lens_stamp"] = self._mirror_valid()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lens_stamp = self._stamp() if state["_lens_stamp"] else -1  # -1: no version, the device is read

    def _mirror_valid(self) -> bool:
        return self._lens_known and self._stamp() == self._lens_stamp

    def _host_lens(self) -> list[int]:
        """Every slot's length: the host mirror, or one read of the device after device-only appends or a
        write to ``cache_seqlens`` from outside the cache's methods (seen through its version counter), which must
        keep each length within ``[0, reserved]`` (else a ``ValueError``)."""
        if self._mirror_valid():
            return self._lens
        lens = self.cache_seqlens.tolist()
        for s, n in enumerate(lens):  # only an outside write can leave a slot's reservation (appends stop at it)
            if not 0 <= n <= self._cap[s]:
                raise ValueError(f"cache_seqlens: slot {s} holds {n} tokens, outside [0, {self._cap[s]}] (its "
                                 "reserved pages): a length written from outside the cache must stay within its "
                                 "slot's reservation")
        if self._lens_known:  # an outside write, no device-only append: the mirror can follow the device again
            self._lens = lens
            self._mark_lens()
        return lens

    def seqlens(self, seq_ids=None) -> list[int]:
        """Token counts of ``seq_ids`` (all slots by default) as host ints."""
        ids = self._slots(seq_ids, self.max_batch if seq_ids is None else None)
        lens = self._host_lens()
        return [lens[s] for s in ids]

    def reserved(self, seq_ids=None) -> list[int]:
        """Tokens each slot of ``seq_ids`` (all by default) can hold without taking pages."""
        ids = self._slots(seq_ids, self.max_batch if seq_ids is None else None)
        return [self._cap[s] for s in ids]

    def holds_tokens(self, seq_ids=None) -> list[bool]:
        """Per slot: has it received tokens since it was last freed (host flags, no device read)."""
        ids = self._slots(seq_ids, self.max_batch if seq_ids is None else None)
        return [self._holds[s] for s in ids]

    def tables(self, seq_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table [B, max_pages] int32, cache_seqlens [B] int32)`` of the slots ``seq_ids``."""
        if seq_ids is None:
            return self.block_table, self.cache_seqlens
        ids = self._slots(seq_ids)
        idx = self._index_of(ids)
        self._remember(ids, idx)
        return self._rows(idx, len(ids))

    def _rows(self, idx: torch.Tensor | None, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        if idx is None:
            return self.block_table[:B], self.cache_seqlens[:B]
        return self.block_table.index_select(0, idx), self.cache_seqlens.index_select(0, idx)

    def check(self) -> None:
        """Raise ``RuntimeError`` if an append inside a captured / compiled step (or with ``auto_reserve``
        off) went past a slot's reserved pages; one host sync. ``free`` clears a slot's flag."""
        bad = self.overflow.nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(
                f"cache overflow: slots {bad} received tokens past their reserved pages (or max_seqlen "
                f"{self.max_seqlen}); those tokens went to the scratch page and the lengths stopped at the "
                "reservation. Call reserve(seq_ids, num_tokens) before the steps.")

    # ---- page bookkeeping --------------------------------------------------------------------------
    def _counts(self, ids: tuple[int, ...], num_tokens) -> list[int]:
        if is_int(num_tokens):
            counts = [int(num_tokens)] * len(ids)
        elif isinstance(num_tokens, (Sequence, range)) and not isinstance(num_tokens, (str, bytes)):
            counts = list(num_tokens)
            if len(counts) != len(ids):
                raise ValueError(f"num_tokens: expected {len(ids)} counts (one per slot), got {len(counts)}")
            for n in counts:
                if not is_int(n):
                    raise TypeError(f"num_tokens: expected ints, got {type(n).__name__} {n!r}")
            counts = [int(n) for n in counts]
        else:
            raise TypeError(f"num_tokens: expected an int or a sequence of ints, got {type(num_tokens).__name__}")
        for n in counts:
            if not 0 <= n <= INT32_MAX:
                raise ValueError(f"num_tokens: expected counts in [0, {INT32_MAX}], got {n}")
        return counts

    def _plan(self, ids: tuple[int, ...], counts: list[int]) -> list[int]:
        """Pages each slot needs for ``counts`` more tokens; ValueError (nothing changed) when it cannot."""
        lens = self._host_lens()
        need = []
        for s, n in zip(ids, counts, strict=True):
            total = lens[s] + n
            if total > self.max_seqlen:
                raise ValueError(f"num_tokens: slot {s} would hold {total} tokens > max_seqlen {self.max_seqlen}")
            need.append(max(0, math.ceil(total / self.page_size) - len(self._pages[s])))
        if sum(need) > len(self._free):
            raise ValueError(f"reserve: out of pages (need {sum(need)}, {len(self._free)} free)")
        return need

    def _take(self, ids: tuple[int, ...], need: list[int]) -> None:
        changed = []
        for s, k in zip(ids, need, strict=True):
            for _ in range(k):
                p = self._free.pop()
                self._refs[p] = 1
                self._pages[s].append(p)
            if k:
                changed.append(s)
                self._cap[s] = min(len(self._pages[s]) * self.page_size, self.max_seqlen)
        self._sync_table(changed)

    def reserve(self, seq_ids, num_tokens) -> None:
        """Guarantee pages for the next ``num_tokens`` tokens (an int, or one count per slot) of each slot.

        A host call, made outside captured / compiled steps (it may read the device lengths once). Raises
        ``ValueError`` and takes nothing when a slot would pass ``max_seqlen`` or the free pages run out.
        """
        self._host_call("reserve")
        ids = self._slots(seq_ids)
        counts = self._counts(ids, num_tokens)
        self._take(ids, self._plan(ids, counts))

    allocate = reserve

    def free(self, seq_ids) -> None:
        """Empty the slots ``seq_ids``: length 0, no pages, overflow flag cleared. A page returns to the free
        list when its last user frees it (forked slots share pages)."""
        self._host_call("free")
        ids = self._slots(seq_ids)
        mirror = self._mirror_valid()
        for s in ids:
            for p in reversed(self._pages[s]):
                self._refs[p] -= 1
                if self._refs[p] == 1:
                    self._shared.discard(p)
                elif self._refs[p] == 0:
                    self._free.append(p)
            self._pages[s] = []
            self._cap[s] = 0
            self._holds[s] = False
            self._lens[s] = 0
        if ids:
            self._sync_table(list(ids))
            dev = torch.tensor(ids, dtype=torch.long, device=self.device)
            self.cache_seqlens.index_fill_(0, dev, 0)
            self.overflow.index_fill_(0, dev, False)
            if mirror:
                self._mark_lens()

    def fork(self, src: int, dst: int) -> None:
        """Make empty slot ``dst`` a copy of slot ``src``: the full pages of ``src`` are shared, its partly
        filled last page is copied into a fresh page. The two then decode independently. Raises
        ``ValueError`` (nothing changed) when ``dst`` holds pages or no page is free for the copy. A length moved
        back from outside into the shared pages (within the reservation) is followed by the next eager append, which
        copies each shared page it writes first; an append inside a captured or compiled step keeps no host
        bookkeeping and cannot: move lengths back there only past the shared pages."""
        self._host_call("fork")
        src, dst = self._slot(src, "src"), self._slot(dst, "dst")
        if src == dst:
            raise ValueError(f"dst: expected a slot other than src ({src})")
        if self._pages[dst] or self._holds[dst]:
            raise ValueError(f"dst: slot {dst} holds pages or tokens; free it first")
        L = self._host_lens()[src]
        mirror = self._mirror_valid()
        full, part = divmod(L, self.page_size)
        if part and not self._free:
            raise ValueError("fork: out of pages (the partly filled last page needs a copy, 0 free)")
        shared = self._pages[src][:full]
        for p in shared:
            self._refs[p] += 1
            self._shared.add(p)
        pages = list(shared)
        if part:
            p = self._free.pop()
            self._refs[p] = 1
            old = self._pages[src][full]
            for t in self._storages():
                t[p].copy_(t[old])
            pages.append(p)
        self._pages[dst] = pages
        self._cap[dst] = min(len(pages) * self.page_size, self.max_seqlen)
        self._holds[dst] = self._holds[src]
        self._lens[dst] = L
        self._sync_table([dst])
        self.cache_seqlens[dst] = self.cache_seqlens[src]
        self.overflow[dst] = self.overflow[src]
        if mirror:
            self._mark_lens()

    def _host_call(self, name: str) -> None:
        if self._device_only():
            raise RuntimeError(f"{name}: a host call (it moves page lists to the device); make it outside CUDA-graph "
                               "capture and torch.compile")
        self._check_mode(name)

    def _check_reads(self, **reads: torch.Tensor | None) -> None:
        """The tensors a call reads after it appends (None: absent) share no memory with what the append writes
        (``ValueError``): e.g. sparse ``indices`` that are a view of ``cache_seqlens`` would be read after the
        append has moved them."""
        if torch.compiler.is_compiling() or all(t is None for t in reads.values()):
            return  # traced: fake tensors have no storage (as check_disjoint)
        for name in ("cache_seqlens", "block_table", "overflow"):
            check_disjoint(f"cache.{name}", getattr(self, name), **reads)
        for t in self._storages():
            check_disjoint("cache storage", t, **reads)

    def _check_mode(self, name: str) -> None:
        check_inference_mode(name, self.block_table)

    def _sync_table(self, slots: list[int]) -> None:
        """Write the block-table rows of ``slots`` from the host page lists (one host-to-device copy)."""
        if not slots:
            return
        rows = torch.full((len(slots), self.max_pages), self.scratch_page, dtype=torch.int32)
        for i, s in enumerate(slots):
            if self._pages[s]:
                rows[i, : len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        idx = torch.tensor(slots, dtype=torch.long)
        self.block_table.index_copy_(0, idx.to(self.device), rows.to(self.device))

    # ---- append ------------------------------------------------------------------------------------
    def _check_new(self, name: str, t, B: int, T: int | None, tail: Sequence[int]) -> int:
        check_tensor(name, t)  # a dense (strided, not nested) tensor
        want = [B, T if T is not None else t.shape[1] if t.dim() > 1 else -1, *tail]
        if t.dim() != len(want) or list(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating tensor, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name}: expected a tensor on the cache's device {self.device}, got one on {t.device}")
        return t.shape[1]

    @staticmethod
    def _batch_of(name: str, t, ndim: int) -> int:
        """``B`` of new tokens ``t`` (for ``seq_ids=None``)."""
        check_tensor(name, t)
        if t.dim() != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
        return t.shape[0]

    def _shared_targets(self, ids: tuple[int, ...], T: int, need: list[int] | None) -> list[tuple[int, int]]:
        """``(slot, page index)`` of the shared pages (``fork``) an append of ``T`` tokens would write: only after a
        length moved back from outside (within the reservation) does an append reach one. ValueError (nothing
        changed) when the free pages cannot hold a copy of each beside ``need``."""
        lens, ps = self._host_lens(), self.page_size
        out = [(s, j) for s in ids for j in range(lens[s] // ps, min(len(self._pages[s]), -(-(lens[s] + T) // ps)))
               if self._pages[s][j] in self._shared]
        if out and len(out) + sum(need or ()) > len(self._free):
            raise ValueError(f"append: out of pages (the {len(out)} pages shared with a forked slot that this append "
                             f"would write need copies, {len(self._free) - sum(need or ())} free)")
        return out

    def _unshare(self, targets: list[tuple[int, int]]) -> None:
        """Copy-on-write: each target page is copied into a free page that its slot then holds alone."""
        for s, j in targets:
            old, new = self._pages[s][j], self._free.pop()
            for t in self._storages():
                t[new].copy_(t[old])
            self._refs[old] -= 1
            if self._refs[old] == 1:
                self._shared.discard(old)
            self._refs[new] = 1
            self._pages[s][j] = new
        self._sync_table(sorted({s for s, _ in targets}))

    def _write(self, ids: tuple[int, ...], T: int, values: Sequence[tuple[torch.Tensor, torch.Tensor]],
               idx=_MISSING) -> None:
        """Append ``T`` tokens to each validated slot: ``values`` pairs a flat storage view ``[rows, ...]``
        with the new rows ``[B * T, ...]`` (already in the storage dtype)."""
        B = len(ids)
        if not torch.compiler.is_compiling():  # new rows read from any of the cache's own tensors: copied out first
            own = {t.untyped_storage().data_ptr()
                   for t in (*self._storages(), self.block_table, self.cache_seqlens, self.overflow)}
            values = [(dst, src.clone() if src.untyped_storage().data_ptr() in own else src) for dst, src in values]
        device_only = self._device_only()
        need, mirror, unshare = None, False, ()
        if not device_only:
            self._check_mode("append")
            if self.auto_reserve:
                lens, cap = self._host_lens(), self._cap
                if not all(lens[s] + T <= cap[s] for s in ids):
                    need = self._plan(ids, [T] * B)  # with the copies below, the only checks that can fail
            if self._shared:
                unshare = self._shared_targets(ids, T, need)
            mirror = self._mirror_valid()
        if idx is _MISSING:
            idx = self._index_of(ids)
        self._remember(ids, idx)
        if need is not None:
            self._take(ids, need)
        if unshare:
            self._unshare(unshare)
        if device_only:
            self._lens_known = False
        rows = cache_rows(self.block_table, self.cache_seqlens, self.overflow, idx, B, T, max_seqlen=self.max_seqlen,
                          num_pages=self.num_pages, page_size=self.page_size)
        for dst, src in values:
            dst.index_copy_(0, rows, src)
        holds = self._holds
        if not all(holds[s] for s in ids):
            for s in ids:
                holds[s] = True
        if mirror and self.auto_reserve:  # every token had a page: the mirror advances by T
            for s in ids:
                self._lens[s] += T
            self._mark_lens()
        elif not self.auto_reserve:  # the device may have stopped short of T: later host calls read it
            self._lens_known = False


class LatentCache(PagedCache):
    """Absorb-path cache: ``kv [num_pages + 1, page_size, 1, kv_rank + rope_dim]`` (latent, then rope key; the
    last page is the scratch page; a view into rows padded to a multiple of 16 bytes, as the kernels read them on a
    GPU, where the row is not one). ``dtype=torch.float8_e4m3fn``: FlashMLA's FP8 latent layout (``kv_rank`` 512,
    ``rope_dim`` 64; ``kv [..., 656]`` float8_e4m3fn rows, ``ops/mla/fp8.py``), quantised on append; queries then
    run in ``compute_dtype`` (bf16, or float32: exact and slow). With ``k_scale`` (a positive finite number) it is
    instead one e4m3 value per channel scaled per tensor (vLLM's ``kv_cache_dtype="fp8"``; any ``kv_rank`` /
    ``rope_dim``): a row is stored as ``row / k_scale`` saturated to ±448 (NaN kept) and reads back as
    ``e4m3 · k_scale`` (``k_descale``, float32 ``[1]``); queries run in ``compute_dtype`` (bf16, fp16 or float32).
    Other arguments as ``PagedCache``."""

    def __init__(self, max_batch: int, max_seqlen: int, kv_rank: int, rope_dim: int, *, page_size: int = 64,
                 num_pages: int | None = None, dtype=torch.bfloat16, device=None, auto_reserve: bool = True,
                 compute_dtype=None, k_scale=None):
        check_int_in("kv_rank", kv_rank, 1)
        check_int_in("rope_dim", rope_dim, 0)
        check_float_dtype(dtype, optional=False, float8=True)
        scaled = k_scale is not None
        fp8 = dtype == torch.float8_e4m3fn and not scaled
        if dtype.itemsize == 1 and dtype != torch.float8_e4m3fn:
            raise TypeError(f"dtype: the one 8-bit cache is FlashMLA's FP8 layout (torch.float8_e4m3fn), got {dtype}")
        if scaled:
            check_real_type("k_scale", k_scale, "None or a positive, finite real number")
        if scaled and (dtype != torch.float8_e4m3fn or not is_finite_real(k_scale) or not k_scale > 0):
            raise ValueError(f"k_scale: the scale of a float8_e4m3fn cache (dtype=torch.float8_e4m3fn), a positive "
                             f"finite number; got {k_scale!r} for dtype {dtype}")
        if scaled:  # the kernels' k_descale is a float32: a normal float32 number
            check_scale("k_scale", k_scale, 1.0)
        if fp8 and (kv_rank, rope_dim) != (FP8_LATENT, FP8_ROPE):
            raise ValueError(f"kv_rank/rope_dim: the FP8 latent layout holds {FP8_LATENT} latent + {FP8_ROPE} rope "
                             f"values per token, got {kv_rank}/{rope_dim} (k_scale: a cache scaled per tensor holds "
                             "any widths)")
        allowed = latent_compute_dtypes(dtype, scaled)
        check_float_dtype(compute_dtype, name="compute_dtype")
        if compute_dtype is not None and compute_dtype not in allowed:
            raise ValueError(f"compute_dtype: expected None or one of {allowed} for a {dtype} cache, got "
                             f"{compute_dtype!r}")
        super().__init__(max_batch, max_seqlen, page_size=page_size, num_pages=num_pages, device=device,
                         auto_reserve=auto_reserve)
        self.kv_rank, self.rope_dim, self.dtype = int(kv_rank), int(rope_dim), dtype
        self.fp8 = fp8
        self.compute_dtype = compute_dtype or allowed[0]
        self.k_scale = float(k_scale) if scaled else None
        # the kernels' k_descale (None: no per-tensor scale)
        self.k_descale = torch.full((1,), self.k_scale, dtype=torch.float32, device=self.device) if scaled else None
        width = FP8_ROW_BYTES if fp8 else self.kv_rank + self.rope_dim
        pitch = padded_width(width, dtype.itemsize)  # rows on 16-byte boundaries, as the kernels read them on a GPU
        self.kv = torch.zeros(self.num_pages + 1, self.page_size, 1, pitch, dtype=dtype,
                              device=self.device)[..., :width]

    def _storages(self):
        return (self.kv,)

    @property
    def bytes_per_token(self) -> int:
        """Bytes a token's row takes: its values, padded to a multiple of 16 bytes."""
        return self.kv.element_size() * self.kv.stride(1)

    def append(self, seq_ids, c_kv: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write ``c_kv [B, T, kv_rank]`` and (roped) ``k_rope [B, T, rope_dim]`` after each slot's tokens
        (``seq_ids``: ``B`` distinct slots, default ``0 .. B-1``)."""
        ids = self._slots(seq_ids, self._batch_of("c_kv", c_kv, 3) if seq_ids is None else None)
        T = self._check_new("c_kv", c_kv, len(ids), None, [self.kv_rank])
        self._check_new("k_rope", k_rope, len(ids), T, [self.rope_dim])
        if T:
            self._append(ids, c_kv, k_rope)

    def _append(self, ids, c_kv, k_rope, idx=_MISSING) -> None:
        c, r = c_kv.detach(), k_rope.detach()
        if c.dtype != r.dtype:  # torch.cat promotes no float8 dtype: widen both as it would (exactly)
            wide = torch.float64 if torch.float64 in (c.dtype, r.dtype) else torch.float32
            c, r = c.to(wide), r.to(wide)
        val = torch.cat([c, r], -1)
        if self.fp8:  # the rows as bytes (index_copy_ takes uint8 on every device)
            if val.element_size() == 1:  # float8 values: widened (exactly) to what the quantiser takes
                val = val.to(torch.float32)
            val = quantize_latent_fp8(val).view(torch.uint8).reshape(-1, FP8_ROW_BYTES)
            dst = self.kv.view(torch.uint8).view(-1, FP8_ROW_BYTES)
        elif self.k_scale is not None:
            D = self.kv_rank + self.rope_dim
            val = (val.to(torch.float32) / self.k_scale).clamp(-E4M3_MAX, E4M3_MAX).to(self.dtype)
            val, dst = val.view(torch.uint8).reshape(-1, D), self.kv.view(torch.uint8).view(-1, D)
        else:
            D = self.kv_rank + self.rope_dim
            val, dst = val.to(self.dtype).reshape(-1, D), self.kv.view(-1, D)
        self._write(ids, c_kv.shape[1], [(dst, val)], idx)

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``(c_kv [L, kv_rank], k_rope [L, rope_dim])`` of one slot in ``compute_dtype`` (an FP8 cache
        dequantised; read through the device tables; one host sync)."""
        s = self._slot(seq_id)
        L = self._host_lens()[s]
        pages = self.block_table[s, : math.ceil(L / self.page_size)].long()
        flat = self._dequantized(self.kv[pages, :, 0].reshape(-1, self.kv.shape[-1])[:L]).to(self.compute_dtype)
        return flat[:, : self.kv_rank], flat[:, self.kv_rank:]

    def _dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache rows ``[..., width]`` as the values they hold: an FP8 cache's dequantised (float32), else a view."""
        if self.fp8:
            return dequantize_latent_fp8(rows, torch.float32)
        if self.k_scale is not None:
            return rows.to(torch.float32) * self.k_scale
        return rows

    def latent_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The rows of pages ``[start, stop)`` as ``[pages, page_size, kv_rank + rope_dim]``: a view, or an 8-bit
        cache's rows dequantised (float32). ``start`` / ``stop``: ints in ``[0, num_pages + 1]`` (the scratch page
        is the last), ``stop`` None for the end."""
        P = self.kv.shape[0]
        check_int_in("start", start, 0, P)
        check_int_in("stop", stop, 0, P, optional=True)
        return self._dequantized(self.kv[start:stop, :, 0])


class GroupedCache(PagedCache):
    """Grouped-path cache: ``k [P, page, g, d_h]``, ``v [P, page, g, d_v]``, ``k_rope [P, page, d_R]`` with
    ``P = num_pages + 1`` (the last page is the scratch page; the rope key is stored once per token, shared by
    all groups). Other arguments as ``PagedCache``."""

    def __init__(self, max_batch: int, max_seqlen: int, num_groups: int, head_dim: int, rope_dim: int,
                 v_head_dim: int | None = None, *, page_size: int = 64, num_pages: int | None = None,
                 dtype=torch.bfloat16, device=None, auto_reserve: bool = True):
        super().__init__(max_batch, max_seqlen, page_size=page_size, num_pages=num_pages, device=device,
                         auto_reserve=auto_reserve)
        dv = head_dim if v_head_dim is None else v_head_dim
        for name, v, lo in (("num_groups", num_groups, 1), ("head_dim", head_dim, 1), ("v_head_dim", dv, 1),
                            ("rope_dim", rope_dim, 0)):
            check_int_in(name, v, lo)
        check_float_dtype(dtype, optional=False, float8=True)
        if dtype.itemsize == 1:
            raise TypeError(f"dtype: the grouped cache has no 8-bit layout (FP8 is the latent cache's), got {dtype}")
        self.num_groups, self.head_dim, self.v_head_dim, self.rope_dim, self.dtype = (
            int(num_groups), int(head_dim), int(dv), int(rope_dim), dtype)
        P, ps = self.num_pages + 1, self.page_size
        self.k = torch.zeros(P, ps, self.num_groups, self.head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros(P, ps, self.num_groups, self.v_head_dim, dtype=dtype, device=self.device)
        self.k_rope = torch.zeros(P, ps, self.rope_dim, dtype=dtype, device=self.device)

    def _storages(self):
        return (self.k, self.v, self.k_rope)

    @property
    def bytes_per_token(self) -> int:
        return self.k.element_size() * (self.num_groups * (self.head_dim + self.v_head_dim) + self.rope_dim)

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write ``k [B, T, g, d_h]``, ``v [B, T, g, d_v]``, ``k_rope [B, T, d_R]`` after each slot's tokens
        (``seq_ids``: ``B`` distinct slots, default ``0 .. B-1``)."""
        ids = self._slots(seq_ids, self._batch_of("k", k, 4) if seq_ids is None else None)
        T = self._check_new("k", k, len(ids), None, [self.num_groups, self.head_dim])
        self._check_new("v", v, len(ids), T, [self.num_groups, self.v_head_dim])
        self._check_new("k_rope", k_rope, len(ids), T, [self.rope_dim])
        if T:
            self._append(ids, k, v, k_rope)

    def _append(self, ids, k, v, k_rope, idx=_MISSING) -> None:
        g, dh, dv, dR = self.num_groups, self.head_dim, self.v_head_dim, self.rope_dim
        pairs = [(self.k.view(-1, g, dh), k.detach().to(self.dtype).reshape(-1, g, dh)),
                 (self.v.view(-1, g, dv), v.detach().to(self.dtype).reshape(-1, g, dv))]
        if dR:
            pairs.append((self.k_rope.view(-1, dR), k_rope.detach().to(self.dtype).reshape(-1, dR)))
        self._write(ids, k.shape[1], pairs, idx)

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous ``(k [L, g, d_h], v [L, g, d_v], k_rope [L, d_R])`` of one slot (read through the device
        tables; one host sync)."""
        s = self._slot(seq_id)
        L = self._host_lens()[s]
        pages = self.block_table[s, : math.ceil(L / self.page_size)].long()
        rows = pages.numel() * self.page_size  # explicit: a rope_dim of 0 leaves reshape(-1, 0) undetermined
        k = self.k[pages].reshape(rows, self.num_groups, self.head_dim)[:L]
        v = self.v[pages].reshape(rows, self.num_groups, self.v_head_dim)[:L]
        kr = self.k_rope[pages].reshape(rows, self.rope_dim)[:L]
        return k, v, kr

    @classmethod
    def from_latent(cls, latent_cache: LatentCache, layer, *, dtype=None) -> GroupedCache:
        """One-time switch: expand every token of ``latent_cache`` to per-group K = W_UK c, V = W_UV c.

        Keeps the slot structure (same pages, reference counts, block tables, lengths and flags); ``layer`` is
        the GQLAttention whose ``kv_b_proj`` produced the latent. The rope key is copied unchanged.
        """
        from .gqla import GQLAttention

        if not isinstance(latent_cache, LatentCache):
            raise TypeError(f"latent_cache: expected a LatentCache, got {type(latent_cache).__name__}")
        if not isinstance(layer, GQLAttention):
            raise TypeError(f"layer: expected the GQLAttention whose kv_b_proj produced the latent, got "
                            f"{type(layer).__name__}")
        if latent_cache.kv_rank != layer.kv_rank or latent_cache.rope_dim != layer.rope_dim:
            raise ValueError(f"latent_cache: kv_rank/rope_dim {latent_cache.kv_rank}/{latent_cache.rope_dim} do not "
                             f"match the layer's {layer.kv_rank}/{layer.rope_dim}")
        lc = latent_cache
        out = cls(lc.max_batch, lc.max_seqlen, layer.num_groups, layer.head_dim, layer.rope_dim, layer.v_head_dim,
                  page_size=lc.page_size, num_pages=lc.num_pages, dtype=dtype or lc.compute_dtype, device=lc.device,
                  auto_reserve=lc.auto_reserve)
        out._free = list(lc._free)
        out._refs = list(lc._refs)
        out._shared = set(lc._shared)
        out._pages = [list(p) for p in lc._pages]
        out._cap = list(lc._cap)
        out._holds = list(lc._holds)
        out._lens = list(lc._host_lens())
        out._lens_known = lc._lens_known
        out.block_table.copy_(lc.block_table)
        out.cache_seqlens.copy_(lc.cache_seqlens)
        out.overflow.copy_(lc.overflow)
        out._mark_lens()
        w = layer.kv_b_proj.weight.detach().to(device=lc.device, dtype=torch.float32)
        w = w.view(layer.num_groups, layer.head_dim + layer.v_head_dim, layer.kv_rank)
        with torch.no_grad():
            for p0 in range(0, lc.num_pages + 1, 256):  # bounded temporary memory
                rows = lc.latent_rows(p0, min(p0 + 256, lc.num_pages + 1))
                kv = torch.einsum("ptr,gdr->ptgd", rows[..., : lc.kv_rank].float(), w)
                out.k[p0:p0 + 256] = kv[..., : layer.head_dim].to(out.dtype)
                out.v[p0:p0 + 256] = kv[..., layer.head_dim:].to(out.dtype)
                out.k_rope[p0:p0 + 256] = rows[..., lc.kv_rank:].to(out.dtype)
        return out
