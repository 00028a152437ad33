"""The hostile decode cases of ``tests/test_adversarial_decode.py`` on the GPU, under compute-sanitizer.

    python -m tools.sanitize_decode [--cases N] [--racecheck-cases M] [--dtype bf16|fp16] [--op mla,gqa]
    python -m tools.sanitize_decode --worker [--cases N] ...      # the cases alone (what the sanitizer runs)

Without ``--worker`` it runs the worker under ``compute-sanitizer --tool memcheck`` (N cases per op, default 64) and
``--tool racecheck`` (M per op, default 8: racecheck is slow), prints each tool's error count and the cases that
failed, and exits 1 on any sanitizer error or wrong result. Every case (lengths at the int32 extremes, NaN / inf
placement, junk indices and block tables, dense / sparse, MTP, split-KV, both MLA kernels, the FP8 latent cache in
about 30 % of the MLA cases) is checked against the float64 reference with NaN / inf positions exact
(``test_adversarial_decode.check_case``); the worker prints one ``FAIL`` line per wrong case and a summary.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import traceback

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def _worker(args) -> int:
    os.environ.setdefault("GQLA_TEST_PROFILE", "gpu")
    sys.path.insert(0, _TESTS)
    import test_adversarial_decode as adv
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    failures = 0
    for op in args.op.split(","):
        n_fail = 0
        for seed in range(args.cases):
            spec = adv.random_spec(op, seed)
            try:
                adv.check_case(spec, dtype, "cuda")
            except Exception:  # noqa: BLE001 (reported, counted)
                n_fail += 1
                print(f"FAIL {spec}\n{traceback.format_exc(limit=3)}", flush=True)
        print(f"{op}: {args.cases} cases, {n_fail} failed", flush=True)
        failures += n_fail
    return 1 if failures else 0


def _sanitized(tool: str, cases: int, args) -> tuple[int | None, int, str]:
    """Run the worker under ``compute-sanitizer --tool tool``: (its error count or None, exit code, output)."""
    cmd = ["compute-sanitizer", "--tool", tool, sys.executable, "-m", "tools.sanitize_decode", "--worker",
           "--cases", str(cases), "--dtype", args.dtype, "--op", args.op]
    res = subprocess.run(cmd, capture_output=True, text=True)
    text = res.stdout + res.stderr
    # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
    m = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(r"RACECHECK SUMMARY: .*?\((\d+) error", text)
    return (int(m.group(1)) if m else None), res.returncode, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="run the cases in this process (no sanitizer)")
    ap.add_argument("--cases", type=int, default=64, help="cases per op (memcheck, and the worker)")
    ap.add_argument("--racecheck-cases", type=int, default=8, help="cases per op under racecheck")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--op", default="mla,gqa")
    args = ap.parse_args()
    if args.worker:
        sys.exit(_worker(args))
    if shutil.which("compute-sanitizer") is None:
        sys.exit("compute-sanitizer is not on PATH (CUDA toolkit); `--worker` runs the cases without it")
    bad = False
    for tool, cases in (("memcheck", args.cases), ("racecheck", args.racecheck_cases)):
        errors, rc, text = _sanitized(tool, cases, args)
        fails = [line for line in text.splitlines() if line.startswith("FAIL ")]
        summary = [line for line in text.splitlines() if re.match(r"(mla|gqa): \d+ cases", line)]
        print(f"{tool}: {'?' if errors is None else errors} sanitizer errors; " + "; ".join(summary))
        for line in fails:
            print(f"  {line}")
        reports = {}  # each distinct sanitizer report (what, where), counted
        for line in text.splitlines():
            if line.startswith("========= ") and re.search(r"(Race reported|Hazard|Invalid|Error:|Warning:)", line):
                key = re.sub(r"0x[0-9a-f]+", "0x…", line[10:].strip())
                reports[key] = reports.get(key, 0) + 1
        for key, n in sorted(reports.items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {n} x {key[:300]}")
        if errors != 0 or rc != 0:
            bad = True
            if errors is None or (rc != 0 and not fails):
                print(text[-4000:])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
