"""Developer tools for gqla_triton: config sweeps, profilers, sanitizer drivers and numerical checks.

Each tool is a module run as ``python -m tools.<name>`` from the repository root; ``tools/README.md`` lists
them. Tools reuse the benchmark workloads of ``bench/`` and drive the public ops, switching launch configs
through ``gqla_triton.dispatch.config_override``.
"""
