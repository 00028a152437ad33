#!/usr/bin/env bash
# One device call on the H200: GPU test profile, then benchmarks with anchors timed in the same run.
# Logs and result JSON go under $OUT (at most 8 files come back: gpu.txt, tests.log, sanitize.log,
# bench.log, results.tar).
#   TESTS="tests/..."  pytest targets (default: tests; "none" skips)
#   OPS="combine,gdn,..."  bench ops (default: all; "none" skips)    WORKLOADS="G1,M1" (default: all)
#   WARM=1  compiles the anchors' JIT kernels (bench/warm.py) in the background while the tests run
#   SWEEPS="mla:M1,M2 gqa:Q1"  config sweeps (python -m bench.<op> --sweep ...) before the benches
#   DEADLINE=570  seconds from the start by which the benches are cut (overrides BENCH_TIMEOUT)
#   EXTRA="cmd"  one more command after the sweeps (log: extra.log, cut after EXTRA_TIMEOUT s)
#   SANITIZE=1  also runs the sparse adversarial-index scripts under compute-sanitizer memcheck
#   PRE="cmds"  evaluated in this shell before the tests (so an `export GQLA_TRITON_CONFIG=...` holds for the rest)
# Exit status: nonzero when the tests or the EXTRA command failed.
set -u
START=$SECONDS
OUT=${OUT:-/tmp/gqla_out}
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ -f .anchors/anchors.tar.xz ]; then
  mkdir -p /tmp/anchors && tar -xJf .anchors/anchors.tar.xz -C /tmp/anchors
  export PYTHONPATH=".:/tmp/anchors" FLA_DISABLE_BACKEND_DISPATCH=1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${WARM:-0}" = 1 ]; then
  python3 -m bench.warm > "$OUT/warm.log" 2>&1 &
  WARM_PID=$!
fi
if [ -n "${PRE:-}" ]; then eval "$PRE"; fi
TESTS=${TESTS:-tests}
if [ "$TESTS" != none ]; then
  GQLA_FAIL_LOG="$OUT/failures.log" timeout "${TEST_TIMEOUT:-420}" python3 -m pytest $TESTS -n "${TEST_WORKERS:-12}" --dist load -p no:cacheprovider --tb=short -v -rfE --durations=25 --timeout "${PER_TEST_TIMEOUT:-150}" -W ignore::pytest.PytestWarning > "$OUT/tests.log" 2>&1
  TESTS_RC=$?
  echo "tests exit: $TESTS_RC" >> "$OUT/tests.log"
  grep -cE " PASSED" "$OUT/tests.log"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -n 30; tail -n 30 "$OUT/tests.log"
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  for s in ${SANITIZE_SCRIPTS:-bench/sanitize_*.py}; do
    [ -f "$s" ] || continue
    echo "== $s" >> "$OUT/sanitize.log"
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 "$s" >> "$OUT/sanitize.log" 2>&1
    echo "$s memcheck exit $?" | tee -a "$OUT/sanitize.log"
  done
fi
if [ -n "${EXTRA:-}" ]; then  # one more command (e.g. python3 -m bench.gdn_profile), log in extra.log
  timeout "${EXTRA_TIMEOUT:-150}" bash -c "$EXTRA" > "$OUT/extra.log" 2>&1
  EXTRA_RC=$?
  echo "extra exit $EXTRA_RC"; grep -E "BEST|FAILED|total|wall" "$OUT/extra.log" | tail -n 30
fi
OPS=${OPS:-combine,gdn,gdn_decode,mla,gqa,sparse,gqla}
for sw in ${SWEEPS:-}; do
  timeout 240 python3 -m bench."${sw%%:*}" --sweep "${sw#*:}" --budget "${SWEEP_BUDGET:-100}" > "$OUT/sweep_${sw%%:*}.log" 2>&1
  echo "sweep $sw exit $?"; grep -E "BEST|best|WRONG|FAILED" "$OUT/sweep_${sw%%:*}.log" | tail -n 12
done
if [ -n "${WARM_PID:-}" ] && [[ ",$OPS," == *",gdn,"* ]]; then
  for _ in $(seq "${WARM_WAIT:-90}"); do kill -0 "$WARM_PID" 2>/dev/null || break; sleep 1; done
  kill "$WARM_PID" 2>/dev/null && echo "warm-up cut after ${WARM_WAIT:-90} s of waiting"; tail -n 12 "$OUT/warm.log"
fi
if [ "$OPS" != none ]; then
  BT=${BENCH_TIMEOUT:-400}
  [ -n "${DEADLINE:-}" ] && BT=$((DEADLINE - (SECONDS - START)))
  END=$((SECONDS + BT))
  # one process per op: a fault in one (an anchor's illegal address) must not lose the others' results
  for op in ${OPS//,/ }; do
    left=$((END - SECONDS))
    [ "$left" -gt 5 ] || { echo "bench $op skipped: no time left" | tee -a "$OUT/bench.log"; continue; }
    timeout "$left" python3 -m bench.run --op "$op" ${WORKLOADS:+--workload "$WORKLOADS"} 2>&1 \
      | tee -a "$OUT/bench.log" | grep -v '^\[bench\]\|^\[row\]\|TileLang' | tail -n 40
  done
  tar -cf "$OUT/results.tar" bench/results/*.json 2>/dev/null
fi
# the exit status reports the tests and the extra command (a benchmark cut by its deadline does not count)
echo "session exit: tests ${TESTS_RC:-skipped}, extra ${EXTRA_RC:-skipped}"
[ "${TESTS_RC:-0}" = 0 ] && [ "${EXTRA_RC:-0}" = 0 ]
