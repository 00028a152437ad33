"""Gated DeltaNet ops: chunked prefill/training (``chunk``), recurrent decode (``decode``), references."""
