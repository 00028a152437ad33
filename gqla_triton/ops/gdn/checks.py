"""Argument checks of the Gated DeltaNet ops: a ``TypeError`` / ``ValueError`` naming the argument."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_bool", "check_scale", "check_state_indices", "forward_only"]


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def check_scale(scale: object, default: float) -> float:
    """``scale`` as a float: ``default`` for None, else a finite real number (not a bool)."""
    if scale is None:
        return float(default)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a finite real number or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number or None, got {scale!r}")
    return float(scale)


def check_state_indices(state_indices: torch.Tensor, pool_rows: int) -> None:
    """Non-negative ``state_indices`` must lie in ``[0, pool_rows)`` and be distinct (two sequences updating one
    pool row would race). Checked on the host (one device read) unless a CUDA graph is being captured, where the
    kernel's own guard applies (an index >= pool_rows is skipped like a negative one, never dereferenced)."""
    if state_indices.numel() == 0:
        return
    if state_indices.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    live = [i for i in state_indices.tolist() if i >= 0]
    out = [i for i in live if i >= pool_rows]
    if out:
        raise ValueError(f"state_indices: index {out[0]} is outside the state pool [0, {pool_rows})")
    if len(set(live)) != len(live):
        seen, dup = set(), None
        for i in live:
            if i in seen:
                dup = i
                break
            seen.add(i)
        raise ValueError(f"state_indices: pool row {dup} appears more than once (each sequence needs its own row)")


class _ForwardOnly(torch.autograd.Function):
    """Identity on the output of a forward-only op whose inputs require grad: its backward raises."""

    @staticmethod
    def forward(ctx, o, *inputs):
        return o.view_as(o)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("gated_delta_rule_decode is forward-only (inference): it has no backward; train with "
                           "chunk_gated_delta_rule, or call it under torch.no_grad() / on detached inputs")


def forward_only(o: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``o``, made to raise on a backward when grad mode is on and any input requires grad (no cost otherwise)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _ForwardOnly.apply(o, *[t for t in inputs if t.requires_grad])
    return o
