"""The one ``impl=`` vocabulary of every op and layer.

``"auto"``: this GPU's config table decides (the Hopper Gluon kernel where one exists and is enabled, the
portable Triton kernel otherwise). ``"triton"``: the portable Triton kernel (any CUDA GPU, and the CPU
interpreter). ``"gluon"``: the Hopper (sm_90) Gluon kernel; a ``ValueError`` says why where it cannot run.
``"reference"``: the pure-torch path (any device and dtype, float64 included; slow, the definition of
correctness).
"""

from __future__ import annotations

from .validation import check_choice

__all__ = ["IMPLS", "check_impl"]

IMPLS = ("auto", "triton", "gluon", "reference")


def check_impl(impl: object, *, op: str, gluon: bool) -> str:
    """Validate ``impl`` for ``op``; ``gluon``: whether the op has a Gluon kernel at all."""
    check_choice("impl", impl, IMPLS)
    if impl == "gluon" and not gluon:
        raise ValueError(f"impl='gluon': {op} has no Gluon kernel; use 'auto', 'triton' or 'reference'")
    return impl
