"""Where a public op crosses into its kernels.

Every op has exactly one ``torch.library`` custom op (with a fake), which ``torch.compile`` traces. Eager calls
run the same launcher directly: torch.library's dispatch costs tens of microseconds per call, which sets the
pace of host-bound calls (a decode step, a short prefill chunk). Both routes run the same code after
validation, so they cannot disagree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["route", "runner", "traced"]


def traced() -> bool:
    """torch.compile / torch.export traces, or a ``torch.func`` transform (``vmap``, ``grad``, ...) runs: the call's
    tensors may hold no storage, and the custom op runs (under ``vmap`` torch runs it per sample; torch refuses the
    ops that write in place, and the other transforms, with its own error)."""
    return torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None


def route(custom_op: Callable, eager: Callable) -> Callable:
    """``custom_op`` while ``traced()``, ``eager`` otherwise."""
    return custom_op if traced() else eager


def runner(custom_op: Callable, eager: Callable, *, grad: bool, memo, key: tuple | None,
           build: Callable | None) -> Callable:
    """What runs a checked call: ``custom_op`` where autograd records it (``grad``; the op's backward raises or
    differentiates) or ``traced()``, else ``eager`` with ``prepared=`` the plan ``memo`` (a ``memo.CheckedCalls``)
    keeps under ``key`` (``build()`` on a miss or without a key; ``build`` None: the call has no plan). Outside a
    trace the plan is formed here on every route, so its refusals (a launch past the GPU's shared memory or grid)
    come before what the caller does next with the runner (a layer writes its cache, then runs the op)."""
    if traced():
        return custom_op
    prepared = memo.plan(key, build) if build is not None else None
    return custom_op if grad else functools.partial(eager, prepared=prepared)
