"""Checked calls remembered by their arguments' metadata.

An op whose checks read only its tensors' metadata and plain option values gets the same answer from them for every
call with the same metadata and options. It can keep what they returned, and what it built from that under the
config in force (a launch plan), under that key and skip both on the next such call: on a decode step or a short
prefill chunk the checks and the planning cost as much host time as the kernel launches.

``call_key`` holds each tensor's shape, strides, storage offset, dtype, device, ``requires_grad`` and the alignment
of its address (``data_ptr() mod 16``: kernels choose vector widths and copy engines by it), each option with its
type (``True`` and ``1`` are different keys: a check may accept one and refuse the other), grad mode and whether the
Triton interpreter runs. Calls it cannot key that way (tensor subclasses, non-strided tensors, tensors without
storage or with a lazy negation / conjugation bit, options of other types, torch.compile tracing) get no key and
are checked every time; a check that fails stores nothing.
"""

from __future__ import annotations

import torch

from ...dispatch import config_state, is_interpreter

__all__ = ["CheckedCalls", "call_key"]

_PLAIN = (type(None), bool, int, float, str, torch.dtype)


def call_key(tensors: tuple, options: tuple) -> tuple | None:
    """The memo key of a call on ``tensors`` (None where absent) and ``options``, or None (see the module)."""
    if torch.compiler.is_compiling():
        return None
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif (type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_nested or t.is_neg()
              or t.is_conj()):
            return None
        else:
            try:
                align = t.data_ptr() % 16
            except RuntimeError:  # no storage (a functorch wrapper)
                return None
            key.append((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, align))
    for v in options:
        if type(v) not in _PLAIN:
            return None
        key.append((type(v), v))
    return (*key, torch.is_grad_enabled(), is_interpreter())


class CheckedCalls:
    """What the checks of keyed calls returned (at most ``limit`` keys; the map starts over when full), and beside
    each, what was built from it under one ``dispatch.config_state`` (``plan``)."""

    def __init__(self, limit: int = 512):
        self._entries: dict[tuple, list] = {}
        self._limit = limit

    def get(self, key: tuple | None):
        """The checked value kept under ``key``, or None (no key, or not checked yet)."""
        e = self._entries.get(key) if key is not None else None
        return None if e is None else e[0]

    def put(self, key: tuple | None, checked) -> None:
        """Keep ``checked`` (not None) under ``key`` (None: nothing is kept)."""
        if key is None:
            return
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[key] = [checked, None]

    def clear(self) -> None:
        """Forget every kept call (each next call is checked and planned again)."""
        self._entries.clear()

    def plan(self, key: tuple | None, build, keep=None):
        """``build()``'s value for the call of ``key``, built once per config state: a config change (a
        ``config_override`` or ``table_swap`` block, ``GQLA_TRITON_CONFIG``, ``reload_tables``) builds it again.
        Unkeyed calls build every time, and so do calls whose value ``keep(value)`` refuses."""
        e = self._entries.get(key) if key is not None else None
        if e is None:
            return build()
        state, kept = config_state(), e[1]  # (one slot: a (state, value) pair is read and replaced whole)
        if kept is not None and kept[0] == state:
            return kept[1]
        value = build()
        if keep is None or keep(value):
            e[1] = (state, value)
        return value
