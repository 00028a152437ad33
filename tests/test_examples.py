"""The examples run end to end (tiny sizes under the interpreter in the ci profile) and their self-checks pass."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# each script's last line when its own checks pass
PASSED = {"hybrid_lm.py": "outputs agree", "convert_llama.py": "OK"}


@pytest.mark.parametrize("script", sorted(PASSED))
def test_example_runs_and_agrees(script):
    if script == "convert_llama.py":
        pytest.importorskip("transformers")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, f"{script} failed:\n{res.stdout}\n{res.stderr[-4000:]}"
    assert res.stdout.strip().splitlines()[-1] == PASSED[script], res.stdout
