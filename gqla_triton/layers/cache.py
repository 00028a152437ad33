"""Paged KV caches for GQLAttention: ``LatentCache`` (absorb path) and ``GroupedCache`` (grouped path).

Both hold ``max_batch`` sequence slots. Each slot owns a list of pages taken from a shared free list;
``block_table [max_batch, max_pages] int32`` maps logical page ``p`` of slot ``b`` to a physical page and
``cache_seqlens [max_batch] int32`` counts the tokens of each slot. Kernels take the rows of the slots in
a batch: ``block_table[seq_ids]``, ``cache_seqlens[seq_ids]`` (see ``tables``). Page bookkeeping is kept on
the host (python lists), so ``allocate`` / ``append`` / ``free`` never read device memory.

Unused block-table entries point at page 0; kernels only read pages below ``cache_seqlens``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch

__all__ = ["PagedCache", "LatentCache", "GroupedCache"]


def _as_ids(seq_ids, n: int | None = None) -> list[int]:
    if seq_ids is None:
        if n is None:
            raise ValueError("seq_ids: required")
        return list(range(n))
    if isinstance(seq_ids, torch.Tensor):
        seq_ids = seq_ids.tolist()
    elif isinstance(seq_ids, int):
        seq_ids = [seq_ids]
    return [int(s) for s in seq_ids]


class PagedCache(abc.ABC):
    """Page allocator + block table shared by the two cache kinds (storage tensors live in subclasses)."""

    def __init__(self, max_batch: int, max_seqlen: int, *, page_size: int = 64, num_pages: int | None = None,
                 device=None):
        if max_batch <= 0:
            raise ValueError(f"max_batch: expected a positive int, got {max_batch}")
        if max_seqlen <= 0:
            raise ValueError(f"max_seqlen: expected a positive int, got {max_seqlen}")
        if page_size <= 0 or page_size % 16 != 0:
            raise ValueError(f"page_size: expected a positive multiple of 16, got {page_size}")
        self.max_batch = max_batch
        self.max_seqlen = max_seqlen
        self.page_size = page_size
        self.max_pages = math.ceil(max_seqlen / page_size)
        self.num_pages = num_pages if num_pages is not None else max_batch * self.max_pages
        if self.num_pages <= 0:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._pages: list[list[int]] = [[] for _ in range(max_batch)]
        self._lens: list[int] = [0] * max_batch
        self.block_table = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=self.device)
        self.cache_seqlens = torch.zeros(max_batch, dtype=torch.int32, device=self.device)

    # ---- bookkeeping -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def seqlens(self, seq_ids=None) -> list[int]:
        """Host copy of the token counts of ``seq_ids`` (all slots by default)."""
        return [self._lens[s] for s in _as_ids(seq_ids, self.max_batch)]

    def _check_ids(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids: duplicate slots in {ids}")
        for s in ids:
            if not 0 <= s < self.max_batch:
                raise ValueError(f"seq_ids: slot {s} outside [0, {self.max_batch})")

    def allocate(self, batch_slots, num_tokens) -> None:
        """Make room for ``num_tokens`` more tokens (an int or one per slot) in each of ``batch_slots``.

        Raises ``ValueError`` (and allocates nothing) when the slot would pass ``max_seqlen`` or the free
        list runs out of pages.
        """
        ids = _as_ids(batch_slots)
        self._check_ids(ids)
        counts = [int(num_tokens)] * len(ids) if isinstance(num_tokens, int) else [int(n) for n in num_tokens]
        if len(counts) != len(ids):
            raise ValueError(f"num_tokens: expected {len(ids)} counts, got {len(counts)}")
        need = []
        for s, n in zip(ids, counts, strict=True):
            if n < 0:
                raise ValueError(f"num_tokens: expected >= 0, got {n}")
            total = self._lens[s] + n
            if total > self.max_seqlen:
                raise ValueError(f"num_tokens: slot {s} would hold {total} tokens > max_seqlen {self.max_seqlen}")
            need.append(max(0, math.ceil(total / self.page_size) - len(self._pages[s])))
        if sum(need) > len(self._free):
            raise ValueError(f"allocate: out of pages (need {sum(need)}, {len(self._free)} free)")
        changed = False
        for s, k in zip(ids, need, strict=True):
            for _ in range(k):
                self._pages[s].append(self._free.pop())
                changed = True
        if changed:
            self._sync_table(ids)

    def free(self, seq_ids) -> None:
        """Release the pages of ``seq_ids`` and reset their lengths to 0."""
        ids = _as_ids(seq_ids)
        self._check_ids(ids)
        for s in ids:
            self._free.extend(reversed(self._pages[s]))
            self._pages[s] = []
            self._lens[s] = 0
        self._sync_table(ids)
        self._sync_lens()

    def _sync_table(self, ids: list[int]) -> None:
        rows = torch.zeros(len(ids), self.max_pages, dtype=torch.int32)
        for i, s in enumerate(ids):
            if self._pages[s]:
                rows[i, : len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        self.block_table[torch.tensor(ids, dtype=torch.long, device=self.device)] = rows.to(self.device)

    def _sync_lens(self) -> None:
        self.cache_seqlens.copy_(torch.tensor(self._lens, dtype=torch.int32))

    def tables(self, seq_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table [B, max_pages] int32, cache_seqlens [B] int32)`` for the slots ``seq_ids``."""
        ids = _as_ids(seq_ids, self.max_batch)
        if ids == list(range(self.max_batch)):
            return self.block_table, self.cache_seqlens
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.block_table[idx].contiguous(), self.cache_seqlens[idx].contiguous()

    def _write_index(self, ids: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical (page, offset) of the next ``T`` tokens of each slot: two LongTensors [B, T]."""
        self.allocate(ids, T)
        pages, offs = [], []
        for s in ids:
            pos = range(self._lens[s], self._lens[s] + T)
            pages.append([self._pages[s][p // self.page_size] for p in pos])
            offs.append([p % self.page_size for p in pos])
        return (torch.tensor(pages, dtype=torch.long, device=self.device),
                torch.tensor(offs, dtype=torch.long, device=self.device))

    def _advance(self, ids: list[int], T: int) -> None:
        for s in ids:
            self._lens[s] += T
        self._sync_lens()

    def _check_new(self, name: str, t: torch.Tensor, B: int, T: int | None, tail: Sequence[int]) -> int:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        want = [B, T if T is not None else t.shape[1] if t.dim() > 1 else -1, *tail]
        if t.dim() != len(want) or list(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating tensor, got {t.dtype}")
        return t.shape[1]

    @abc.abstractmethod
    def gather(self, seq_id: int) -> tuple[torch.Tensor, ...]:
        """One sequence's cached tensors in logical token order."""


class LatentCache(PagedCache):
    """Absorb-path cache: ``kv [num_pages, page_size, 1, kv_rank + rope_dim]`` (latent, then rope key)."""

    def __init__(self, max_batch: int, max_seqlen: int, kv_rank: int, rope_dim: int, *, page_size: int = 64,
                 num_pages: int | None = None, dtype=torch.bfloat16, device=None):
        super().__init__(max_batch, max_seqlen, page_size=page_size, num_pages=num_pages, device=device)
        if kv_rank <= 0 or rope_dim < 0:
            raise ValueError(f"kv_rank/rope_dim: expected kv_rank > 0, rope_dim >= 0, got {kv_rank}, {rope_dim}")
        self.kv_rank, self.rope_dim, self.dtype = kv_rank, rope_dim, dtype
        self.kv = torch.zeros(self.num_pages, page_size, 1, kv_rank + rope_dim, dtype=dtype, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        return self.kv.element_size() * (self.kv_rank + self.rope_dim)

    def append(self, seq_ids, c_kv: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write ``c_kv [B, T, kv_rank]`` and (roped) ``k_rope [B, T, rope_dim]`` after each slot's tokens."""
        ids = _as_ids(seq_ids, c_kv.shape[0] if isinstance(c_kv, torch.Tensor) else None)
        self._check_ids(ids)
        T = self._check_new("c_kv", c_kv, len(ids), None, [self.kv_rank])
        self._check_new("k_rope", k_rope, len(ids), T, [self.rope_dim])
        if T == 0:
            return
        page, off = self._write_index(ids, T)
        val = torch.cat([c_kv, k_rope], -1).detach().to(self.dtype)
        self.kv.index_put_((page, off, torch.zeros_like(page)), val)
        self._advance(ids, T)

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``(c_kv [L, kv_rank], k_rope [L, rope_dim])`` of one slot."""
        L = self._lens[seq_id]
        pages = torch.tensor(self._pages[seq_id], dtype=torch.long, device=self.device)
        flat = self.kv[pages, :, 0].reshape(-1, self.kv_rank + self.rope_dim)[:L]
        return flat[:, : self.kv_rank], flat[:, self.kv_rank:]


class GroupedCache(PagedCache):
    """Grouped-path cache: ``k [pages, page, g, d_h]``, ``v [pages, page, g, d_v]``, ``k_rope [pages, page, d_R]``
    (the rope key stored once per token, shared by all groups)."""

    def __init__(self, max_batch: int, max_seqlen: int, num_groups: int, head_dim: int, rope_dim: int,
                 v_head_dim: int | None = None, *, page_size: int = 64, num_pages: int | None = None,
                 dtype=torch.bfloat16, device=None):
        super().__init__(max_batch, max_seqlen, page_size=page_size, num_pages=num_pages, device=device)
        dv = head_dim if v_head_dim is None else v_head_dim
        if num_groups <= 0 or head_dim <= 0 or dv <= 0 or rope_dim < 0:
            raise ValueError("num_groups/head_dim/v_head_dim: expected positive ints, rope_dim >= 0")
        self.num_groups, self.head_dim, self.v_head_dim, self.rope_dim, self.dtype = (
            num_groups, head_dim, dv, rope_dim, dtype)
        P = self.num_pages
        self.k = torch.zeros(P, page_size, num_groups, head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros(P, page_size, num_groups, dv, dtype=dtype, device=self.device)
        self.k_rope = torch.zeros(P, page_size, rope_dim, dtype=dtype, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        return self.k.element_size() * (self.num_groups * (self.head_dim + self.v_head_dim) + self.rope_dim)

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write ``k [B, T, g, d_h]``, ``v [B, T, g, d_v]``, ``k_rope [B, T, d_R]`` after each slot's tokens."""
        ids = _as_ids(seq_ids, k.shape[0] if isinstance(k, torch.Tensor) else None)
        self._check_ids(ids)
        T = self._check_new("k", k, len(ids), None, [self.num_groups, self.head_dim])
        self._check_new("v", v, len(ids), T, [self.num_groups, self.v_head_dim])
        self._check_new("k_rope", k_rope, len(ids), T, [self.rope_dim])
        if T == 0:
            return
        page, off = self._write_index(ids, T)
        self.k.index_put_((page, off), k.detach().to(self.dtype))
        self.v.index_put_((page, off), v.detach().to(self.dtype))
        self.k_rope.index_put_((page, off), k_rope.detach().to(self.dtype))
        self._advance(ids, T)

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous ``(k [L, g, d_h], v [L, g, d_v], k_rope [L, d_R])`` of one slot."""
        L = self._lens[seq_id]
        pages = torch.tensor(self._pages[seq_id], dtype=torch.long, device=self.device)
        k = self.k[pages].reshape(-1, self.num_groups, self.head_dim)[:L]
        v = self.v[pages].reshape(-1, self.num_groups, self.v_head_dim)[:L]
        kr = self.k_rope[pages].reshape(-1, self.rope_dim)[:L]
        return k, v, kr

    @classmethod
    def from_latent(cls, latent_cache: LatentCache, layer, *, dtype=None) -> GroupedCache:
        """One-time switch: expand every token of ``latent_cache`` to per-group K = W_UK c, V = W_UV c.

        Keeps the slot structure (same pages, block tables and lengths); ``layer`` is the GQLAttention
        whose ``kv_b_proj`` produced the latent. The rope key is copied unchanged.
        """
        if not isinstance(latent_cache, LatentCache):
            raise TypeError(f"latent_cache: expected a LatentCache, got {type(latent_cache).__name__}")
        if latent_cache.kv_rank != layer.kv_rank or latent_cache.rope_dim != layer.rope_dim:
            raise ValueError(f"latent_cache: kv_rank/rope_dim {latent_cache.kv_rank}/{latent_cache.rope_dim} do not "
                             f"match the layer's {layer.kv_rank}/{layer.rope_dim}")
        lc = latent_cache
        out = cls(lc.max_batch, lc.max_seqlen, layer.num_groups, layer.head_dim, layer.rope_dim, layer.v_head_dim,
                  page_size=lc.page_size, num_pages=lc.num_pages, dtype=dtype or lc.dtype, device=lc.device)
        out._free = list(lc._free)
        out._pages = [list(p) for p in lc._pages]
        out._lens = list(lc._lens)
        out.block_table.copy_(lc.block_table)
        out.cache_seqlens.copy_(lc.cache_seqlens)
        w = layer.kv_b_proj.weight.detach().to(device=lc.device, dtype=torch.float32)
        w = w.view(layer.num_groups, layer.head_dim + layer.v_head_dim, layer.kv_rank)
        with torch.no_grad():
            for p0 in range(0, lc.num_pages, 256):  # bounded temporary memory
                c = lc.kv[p0:p0 + 256, :, 0, : lc.kv_rank].float()
                kv = torch.einsum("ptr,gdr->ptgd", c, w)
                out.k[p0:p0 + 256] = kv[..., : layer.head_dim].to(out.dtype)
                out.v[p0:p0 + 256] = kv[..., layer.head_dim:].to(out.dtype)
            out.k_rope.copy_(lc.kv[:, :, 0, lc.kv_rank:].to(out.dtype))
        return out
