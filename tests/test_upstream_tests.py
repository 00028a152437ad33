"""tools.upstream_tests: another project's tests run with its entry points rebound to ours (a fake upstream
package here: the real ones need a GPU)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _run(tmp_path, project, test_file, *extra, pkg=None, cwd=ROOT):
    """The tool on ``test_file``, the fake upstream package's folder ``pkg`` (default: its absolute path) on
    PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), pkg or str(tmp_path / "pkg")])}
    return subprocess.run([sys.executable, "-m", "tools.upstream_tests", project, str(test_file), "--", *extra],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _fake_fla(tmp_path):
    upstream = "def {0}(*a, **k):\n    raise AssertionError('the upstream function ran')\n"
    _write(tmp_path / "pkg/fla/__init__.py", "from . import layers  # noqa: F401  (as fla imports its layers)\n")
    _write(tmp_path / "pkg/fla/ops/__init__.py", "")
    _write(tmp_path / "pkg/fla/ops/gated_delta_rule/__init__.py",
           upstream.format("chunk_gated_delta_rule") + upstream.format("fused_recurrent_gated_delta_rule")
           + "chunk_gdn = chunk_gated_delta_rule\nfused_recurrent_gdn = fused_recurrent_gated_delta_rule\n")
    # fla's layer binds the names when fla is imported, before any rebinding: the tool rebinds them there too
    _write(tmp_path / "pkg/fla/layers/__init__.py", "from . import gated_deltanet  # noqa: F401\n")
    _write(tmp_path / "pkg/fla/layers/gated_deltanet.py",
           "from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule\n")


def test_fla_suite_calls_ours(tmp_path):
    _fake_fla(tmp_path)
    tests = tmp_path / "up/tests"
    _write(tests / "conftest.py", """
        import pytest

        @pytest.fixture
        def upstream_fixture():
            return 7
    """)
    _write(tests / "ref_helper.py", "VALUE = 3\n")
    _write(tests / "__init__.py", "")  # fla's test folders are packages
    _write(tests / "test_up.py", """
        import torch
        import ref_helper
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, chunk_gdn, fused_recurrent_gated_delta_rule
        from fla.ops.gated_delta_rule import fused_recurrent_gdn

        import gqla_triton.ops.gdn as ours
        from fla.layers import gated_deltanet as layer

        def test_bound(upstream_fixture):
            assert chunk_gated_delta_rule is ours.chunk_gated_delta_rule
            assert fused_recurrent_gated_delta_rule is ours.fused_recurrent_gated_delta_rule
            assert chunk_gdn is ours.chunk_gated_delta_rule  # fla's short names
            assert fused_recurrent_gdn is ours.fused_recurrent_gated_delta_rule
            assert layer.chunk_gated_delta_rule is ours.chunk_gated_delta_rule
            assert layer.fused_recurrent_gated_delta_rule is ours.fused_recurrent_gated_delta_rule
            assert ref_helper.VALUE == 3 and upstream_fixture == 7

        def test_runs():  # on the GPU where there is one: CPU tensors run only under the interpreter (CI)
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            x = torch.nn.functional.normalize(torch.randn(1, 5, 1, 16, device=dev), dim=-1)
            g, beta = -torch.rand(1, 5, 1, device=dev), torch.rand(1, 5, 1, device=dev)
            o, ht = chunk_gated_delta_rule(x, x, x, g, beta, output_final_state=True)
            assert o.shape == (1, 5, 1, 16) and ht.shape == (1, 1, 16, 16)
    """)
    _write(tests / "test_other.py", "def test_never_collected():\n    raise AssertionError\n")
    r = _run(tmp_path, "fla", tests / "test_up.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout
    assert "rebound to gqla_triton: fla.ops.gated_delta_rule.chunk_gated_delta_rule" in r.stdout
    _write(tests / "test_fails.py", "def test_fails():\n    assert False\n")
    assert _run(tmp_path, "fla", tests / "test_fails.py", "-q").returncode == 1  # the tests' status is the tool's


def test_relative_pythonpath(tmp_path):
    """The upstream package found through a PYTHONPATH entry relative to the caller's folder: the tests run in a
    temporary folder, where the entry must still name the package's folder."""
    _fake_fla(tmp_path)
    _write(tmp_path / "up/test_rel.py", """
        import fla.ops.gated_delta_rule as up
        import gqla_triton.ops.gdn as ours

        def test_bound():
            assert up.chunk_gated_delta_rule is ours.chunk_gated_delta_rule
    """)
    r = _run(tmp_path, "fla", tmp_path / "up/test_rel.py", "-q", pkg="pkg", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout


def test_flashmla_script_calls_ours(tmp_path):
    _write(tmp_path / "pkg/flash_mla/__init__.py",
           "".join(f"def {n}(*a, **k):\n    raise AssertionError\n"
                   for n in ("flash_mla_with_kvcache", "get_mla_metadata", "flash_mla_sparse_fwd")))
    _write(tmp_path / "up/tests/lib.py", "OK = 1\n")
    _write(tmp_path / "up/tests/test_decode.py", """
        import sys
        import flash_mla
        import lib
        from gqla_triton.ops.mla import compat

        if __name__ == "__main__":
            assert flash_mla.flash_mla_with_kvcache is compat.flash_mla_with_kvcache and lib.OK
            assert sys.argv[1:] == ["--dtype", "fp16"]
            sys.exit(3)
    """)
    r = _run(tmp_path, "flashmla", tmp_path / "up/tests/test_decode.py", "--dtype", "fp16")
    assert r.returncode == 3, r.stdout + r.stderr


def test_unknown_project_or_missing_file_is_refused(tmp_path):
    r = _run(tmp_path, "vllm", tmp_path / "x.py")
    assert r.returncode != 0 and "usage" in r.stderr
    r = _run(tmp_path, "fla", tmp_path / "missing.py")
    assert r.returncode != 0 and "no such file" in r.stderr
