# Sourced by scripts/demo and scripts/test: enter the project's virtual environment (.venv at the repository
# root), creating it and installing what is missing on first use. Needs only python3 (>= 3.10).
#   GQLA_PYTHON  the interpreter that creates .venv (default: python3)
#   GQLA_TORCH   the pip requirement for torch when it is missing (default: "torch==2.13.0"; on a machine without
#                an NVIDIA GPU choose a CPU build of torch here)
#   GQLA_VENV    where the environment lives (default: .venv)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GQLA_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[gqla_triton] creating $venv" >&2
  # system site packages: a machine that already has torch / triton (a GPU box) reuses them
  "${GQLA_PYTHON:-python3}" -m venv --system-site-packages "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
missing() { ! python -c "import $1" >/dev/null 2>&1; }
if missing torch; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "${GQLA_TORCH:-torch==2.13.0}"
fi
need=()
missing triton && need+=("triton>=3.6")
missing einops && need+=(einops)
missing numpy && need+=(numpy)
missing tqdm && need+=(tqdm)
if [ "${GQLA_NEED_TESTS:-0}" = 1 ]; then
  missing pytest && need+=(pytest)
  missing xdist && need+=(pytest-xdist)
  missing hypothesis && need+=(hypothesis)
  missing matplotlib && need+=(matplotlib)
  missing transformers && need+=(transformers)  # the Hugging Face conversion / loading tests
fi
if [ ${#need[@]} -gt 0 ]; then
  python -m pip install -q "${need[@]}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
