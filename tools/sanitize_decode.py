"""The adversarial decode cases of ``tests/test_adversarial_decode.py`` on the GPU, for ``compute-sanitizer``.

    compute-sanitizer --tool memcheck python -m tools.sanitize_decode [--dtype bf16|fp16] [--op mla|gqa]
    compute-sanitizer --tool racecheck python -m tools.sanitize_decode

must report 0 errors and exit 0. Every case is also checked against the float64 reference (NaN where it has NaN,
equal infinities, data-derived tolerance elsewhere): exit 1 on a wrong answer. One case list, two runners: the
test module runs the same cases under the interpreter's address check.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch


def main() -> None:
    args = sys.argv[1:]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args[args.index("--dtype") + 1] if "--dtype" in args
                                                            else "bf16"]
    ops = [args[args.index("--op") + 1]] if "--op" in args else ["mla", "gqa"]
    os.environ.setdefault("GQLA_TEST_PROFILE", "gpu")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import test_adversarial_decode as adv

    failures = n = 0
    for op in ops:
        cases, run = (adv.mla_cases(True), adv.run_mla) if op == "mla" else (adv.gqa_cases(True), adv.run_gqa)
        for label, kw in cases:
            n += 1
            try:
                run(kw, "cuda", dtype)
            except AssertionError as e:
                failures += 1
                print(f"FAIL {op} {label}: {e}")
            except Exception:
                failures += 1
                print(f"ERROR {op} {label}:\n{traceback.format_exc()}")
    verdict = "all OK" if not failures else f"{failures} FAILED"
    print(f"{n} adversarial decode cases ({', '.join(ops)}, {dtype}): {verdict}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
