"""Names of the Gluon (``triton.experimental.gluon``) API that differ between the Triton releases the package runs
on (3.6 through 3.9): one place for the Hopper kernels to take them from."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, tma

__all__ = ["async_load", "barrier", "reinterpret", "tma_load"]

# Triton 3.6 names the cp.async copy async_copy_global_to_shared; later releases call it async_load
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# ... and the TMA tile copy the same way (in 3.9 the old name is a stub that raises)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# ... the shared-memory view of other bytes ``_reinterpret``, and the CTA barrier ``thread_barrier``
reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret
barrier = getattr(gl, "barrier", None) or gl.thread_barrier
