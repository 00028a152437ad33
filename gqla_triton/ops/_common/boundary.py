"""Where a public op crosses into its kernels.

Every op has exactly one ``torch.library`` custom op (with a fake), which ``torch.compile`` traces. Eager calls
run the same launcher directly: torch.library's dispatch costs tens of microseconds per call, which sets the
pace of host-bound calls (a decode step, a short prefill chunk). Both routes run the same code after
validation, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["route"]


def route(custom_op: Callable, eager: Callable) -> Callable:
    """``custom_op`` while torch.compile traces, ``eager`` otherwise."""
    return custom_op if torch.compiler.is_compiling() else eager
