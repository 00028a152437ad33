"""Triton kernels of the chunked gated delta rule, one module per stage (layouts: ``common.py``).

Forward: ``wy`` -> ``wu`` -> ``state`` (or ``seg`` + ``state`` per segment) -> ``output``. Backward: ``dv_local``
-> ``state_bwd`` -> ``grad`` -> ``wy_bwd``; ``gva`` holds the cross-head sums of the last two.
"""
