"""Interpreter address check: every address a kernel loads from or stores to (where its mask is on) must lie inside
an element of a tensor the call was given or created. Guard buffers around an input would only catch stores; this
catches reads too, and reads of a strided view's gaps (bytes of the base tensor outside the view).

    with AddressCheck(q, k_cache, block_table, ...) as ac:   # the tensors passed in, exactly as passed (views too)
        out = op(...)
    ac.assert_clean()

Tensors the call itself creates (outputs, scratch, ``.contiguous()`` copies, index tensors) are recorded by a
``TorchDispatchMode`` and allowed as a whole. Only under ``TRITON_INTERPRET=1`` (the interpreter's masked loads and
stores are wrapped); on the GPU the same cases run under compute-sanitizer instead.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AddressCheck"]


def _element_starts(t: torch.Tensor) -> np.ndarray:
    """Byte addresses of every element of ``t`` (a view: only its own elements), sorted."""
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint64)
    off = np.zeros((), dtype=np.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        off = off[..., None] + np.arange(size, dtype=np.int64) * stride
    return np.unique((t.data_ptr() + off.reshape(-1) * t.element_size()).astype(np.uint64))


class _Record(TorchDispatchMode):
    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                self.sink(t)
        return out


class AddressCheck:
    """Context manager; ``violations`` lists ``(kind, kernel address count)`` of every bad access."""

    def __init__(self, *tensors: torch.Tensor | None):
        self._given = [t for t in tensors if isinstance(t, torch.Tensor)]
        self._exact: list[np.ndarray] = []  # element addresses of given tensors (views exactly)
        self._itemsize: list[int] = []
        self._ranges: list[tuple[int, int]] = []  # [start, end) of tensors created inside the call
        self.violations: list[str] = []

    def _created(self, t: torch.Tensor) -> None:
        self._ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        # a view made inside the call spans at most its own elements: the range above covers its span, which for a
        # view of a given tensor with gaps is checked exactly instead
        for g in self._given:
            if t.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
                self._ranges.pop()
                self._exact.append(_element_starts(t))
                self._itemsize.append(t.element_size())
                return

    def _ok(self, addrs: np.ndarray) -> np.ndarray:
        ok = np.zeros(addrs.shape, dtype=bool)
        for lo, hi in self._ranges:
            ok |= (addrs >= lo) & (addrs < hi)
        for starts in self._exact:
            if starts.size:
                i = np.clip(np.searchsorted(starts, addrs, side="right") - 1, 0, starts.size - 1)
                ok |= starts[i] == addrs  # element starts only: the interpreter addresses whole elements
        return ok

    def _check(self, ptrs, mask, kind: str) -> None:
        a = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64)
        if a.size:
            a = np.unique(a)
            bad = ~self._ok(a)
            if bad.any():
                self.violations.append(f"{kind}: {int(bad.sum())} address(es) outside every tensor, e.g. "
                                       f"{int(a[bad][0]):#x}")

    def __enter__(self) -> AddressCheck:
        from triton.runtime import interpreter as ti

        for t in self._given:
            self._exact.append(_element_starts(t))
            self._itemsize.append(t.element_size())
        self._builder = ti.InterpreterBuilder
        self._load, self._store = ti.InterpreterBuilder.create_masked_load, ti.InterpreterBuilder.create_masked_store
        load, store, check = self._load, self._store, self._check
        ti.InterpreterBuilder.create_masked_load = lambda b, p, m, o, c, v: (check(p, m, "load"), load(b, p, m, o, c,
                                                                                                        v))[1]
        ti.InterpreterBuilder.create_masked_store = lambda b, p, x, m, c: (check(p, m, "store"), store(b, p, x, m,
                                                                                                        c))[1]
        self._mode = _Record(self._created)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._builder.create_masked_load, self._builder.create_masked_store = self._load, self._store

    def assert_clean(self) -> None:
        assert not self.violations, "out-of-bounds accesses: " + "; ".join(sorted(set(self.violations))[:6])
