"""Another project's own tests, run against this package's drop-in entry points.

    python -m tools.upstream_tests fla      PATH/TO/flash-linear-attention/tests/ops/test_gdn.py [-- PYTEST ARGS]
    python -m tools.upstream_tests flashqla PATH/TO/FlashQLA/tests/test_gdr_unit.py           [-- PYTEST ARGS]
    python -m tools.upstream_tests flashmla PATH/TO/FlashMLA/tests/test_flash_mla_dense_decoding.py [-- SCRIPT ARGS]

The upstream package must be importable (its tests take their references and helpers from it); its entry points
are rebound to ours before the test module is imported, so every call the tests make to them runs here:

- ``fla``: ``fla.ops.gated_delta_rule``'s ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` and
  their short names ``chunk_gdn`` / ``fused_recurrent_gdn`` (also in ``fla.ops``, the ``chunk`` / ``fused_recurrent``
  submodules, and the names ``fla.layers.gated_deltanet`` imported from it
  when the full fla package is there: its layer and model tests then run ours), from ``gqla_triton.ops.gdn``.
- ``flashqla``: ``flash_qla``'s ``chunk_gated_delta_rule`` / ``_fwd`` / ``_bwd``, from ``gqla_triton.ops.gdn`` and
  its ``flash_qla`` module.
- ``flashmla``: ``flash_mla``'s ``flash_mla_with_kvcache``, ``get_mla_metadata`` and ``flash_mla_sparse_fwd``, from
  ``gqla_triton.ops.mla.compat``; FlashMLA's tests are scripts, run as ``__main__`` with the script's folder on
  ``sys.path`` and ``NSYS_PROFILING_SESSION_ID`` set (their harness then skips looking its own kernels up by name in
  profiler traces; the correctness checks are unchanged).

pytest suites run from a temporary folder holding the test file, its sibling helper modules and a conftest that
rebinds the names (the upstream conftest, if any, is imported from it, so its hooks and markers still apply).
Exits with the tests' status.
"""

from __future__ import annotations

import importlib
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# project -> (upstream module, attribute, our module, our attribute)
BINDINGS = {
    "fla": [  # the two functions, and fla's short names for them (chunk_gdn, fused_recurrent_gdn)
        (m, alias or a, "gqla_triton.ops.gdn", a)
        for m in ("fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk",
                  "fla.ops.gated_delta_rule.fused_recurrent", "fla.layers.gated_deltanet")
        for a, alias in (("chunk_gated_delta_rule", None), ("fused_recurrent_gated_delta_rule", None),
                         ("chunk_gated_delta_rule", "chunk_gdn"),
                         ("fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"))
    ],
    "flashqla": [
        ("flash_qla", "chunk_gated_delta_rule", "gqla_triton.ops.gdn", "chunk_gated_delta_rule"),
        ("flash_qla", "chunk_gated_delta_rule_fwd", "gqla_triton.ops.gdn.flash_qla", "chunk_gated_delta_rule_fwd"),
        ("flash_qla", "chunk_gated_delta_rule_bwd", "gqla_triton.ops.gdn.flash_qla", "chunk_gated_delta_rule_bwd"),
    ],
    "flashmla": [
        ("flash_mla", a, "gqla_triton.ops.mla.compat", a)
        for a in ("flash_mla_with_kvcache", "get_mla_metadata", "flash_mla_sparse_fwd")
    ],
}


def rebind(project: str) -> list[str]:
    """Rebind ``project``'s entry points to ours. Upstream modules that do not exist, or do not define the name,
    are left alone; returns the ``module.attribute`` names rebound (an empty list is an error: nothing would run
    here)."""
    done = []
    for mod, attr, ours, our_attr in BINDINGS[project]:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, attr):
            setattr(m, attr, getattr(importlib.import_module(ours), our_attr))
            done.append(f"{mod}.{attr}")
    if not done:
        raise SystemExit(f"{project}: none of its entry points could be imported; is the package installed?")
    return done


_CONFTEST = """\
import os, sys
sys.path.insert(0, {root!r})
from tools.upstream_tests import rebind
_REBOUND = rebind({project!r})
if os.path.exists(os.path.join(os.path.dirname(__file__), "conftest_upstream.py")):
    from conftest_upstream import *  # noqa: F401,F403  (its hooks and fixtures)


def pytest_report_header(config):
    return "rebound to gqla_triton: " + ", ".join(_REBOUND)
"""


def run_pytest(project: str, test_file: Path, args: list[str]) -> int:
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix=f"upstream-{project}-") as tmp:
        # the test file and its helper modules (not the other tests; no __init__.py: the folder is no package)
        for p in test_file.parent.glob("*.py"):
            if p == test_file or not (p.name.startswith("test_") or p.name == "__init__.py"):
                shutil.copy(p, Path(tmp) / ("conftest_upstream.py" if p.name == "conftest.py" else p.name))
        (Path(tmp) / "conftest.py").write_text(_CONFTEST.format(root=root, project=project))
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")  # not the upstream's options (or ours)
        # the test file's own folder last: helper packages beside it (not copied) stay importable; the caller's
        # entries made absolute, since pytest runs in the temporary folder (an empty entry is the caller's folder)
        inherited = [os.path.abspath(p or ".") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)] \
            if os.environ.get("PYTHONPATH") else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *inherited, str(test_file.parent)])}
        return subprocess.call([sys.executable, "-m", "pytest", test_file.name, "-p", "no:cacheprovider", *args],
                               cwd=tmp, env=env)


def run_script(project: str, script: Path, args: list[str]) -> int:
    print("rebound to gqla_triton:", ", ".join(rebind(project)), file=sys.stderr)
    # FlashMLA's scripts time their own kernels by name in a profiler trace, which ours do not bear; under a
    # profiling session (this variable) their harness skips that lookup and keeps every correctness check
    os.environ.setdefault("NSYS_PROFILING_SESSION_ID", "gqla_triton")
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if len(argv) != 2 or argv[0] not in BINDINGS:
        raise SystemExit(f"usage: python -m tools.upstream_tests {{{','.join(BINDINGS)}}} TEST_FILE [-- ARGS]")
    project, path = argv[0], Path(argv[1]).resolve()
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    if project == "flashmla":
        return run_script(project, path, extra)
    return run_pytest(project, path, extra)


if __name__ == "__main__":
    sys.exit(main())
