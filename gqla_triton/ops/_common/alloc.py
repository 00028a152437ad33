"""Buffer allocation for every tensor a launcher hands a kernel to fill.

Launchers allocate outputs and inter-stage buffers through ``empty`` only. Tests wrap a call in
``poisoned()`` so that each such buffer starts NaN-filled (integers: a large negative value): an element a
kernel forgets to write then fails the comparison instead of passing on leftover memory.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["empty", "poisoned"]

_state = threading.local()


def empty(*size, dtype=None, device=None) -> torch.Tensor:
    """``torch.empty`` (NaN-filled inside ``poisoned()``)."""
    t = torch.empty(*size, dtype=dtype, device=device)
    if getattr(_state, "poison", False):
        t.fill_(float("nan") if t.is_floating_point() else -(2**30))
    return t


@contextlib.contextmanager
def poisoned():
    """Inside this block every launcher buffer starts NaN-filled (testing aid; slower)."""
    old = getattr(_state, "poison", False)
    _state.poison = True
    try:
        yield
    finally:
        _state.poison = old
