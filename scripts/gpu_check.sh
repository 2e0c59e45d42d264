#!/usr/bin/env bash
# GPU check in one command, for a machine with one NVIDIA GPU, a CUDA build of
# torch and flashinfer-python installed (`pip install -e ".[gpu,test]"`), no network.
# Budget: under 8 minutes (each phase has its own timeout; FlashInfer's first
# use JIT-compiles its kernels unless flashinfer-jit-cache / flashinfer-cubin is
# installed, which is most of the pytest phase on a cold cache).
#
#   scripts/gpu_check.sh            # from anywhere; exit status 0 only if every phase passed
#
# Phases: environment report; pytest of tests/gpu (FlashInfer vs torch kernels and
# engines, fp32 CUDA reference equality) plus tests/test_reference.py; the
# many-questions benchmark on the small model (cache on vs off); a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
export PYTHONUNBUFFERED=1

PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-330}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-110}
declare -a SUMMARY=()
FAILED=0

phase() {  # phase NAME TIMEOUT CMD...: run, time and record one phase
  local name=$1 limit=$2 start rc
  shift 2
  echo
  echo "=== ${name} (limit ${limit}s) ==="
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  local took=$((SECONDS - start)) status=ok
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    status="TIMEOUT"
  elif [[ $rc -ne 0 ]]; then
    status="FAILED (exit $rc)"
  fi
  [[ $status == ok ]] || FAILED=1
  SUMMARY+=("$(printf '%-28s %-18s %4ss' "$name" "$status" "$took")")
}

echo "=== environment ==="
nvidia-smi -L || { echo "nvidia-smi failed: no NVIDIA driver/GPU visible"; FAILED=1; }
python - <<'PY'
import importlib.metadata as md

import torch

print(f"python torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
for dist in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "transformers"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
try:
    import flashinfer
    print(f"import flashinfer: ok ({flashinfer.__version__})")
except Exception as e:  # noqa: BLE001
    print(f"import flashinfer: FAILED ({type(e).__name__}: {e})")
from mmserve.kernels.select import resolve_attention_backend
print("attention backend 'auto' on cuda/bf16 resolves to:",
      resolve_attention_backend("auto", "cuda", torch.bfloat16))
PY

# -rs lists every skip with its reason; MMSERVE_REQUIRE_GPU=1 makes a missing
# GPU or flashinfer a failure (a skipped GPU test is not a pass).
phase "pytest tests/gpu + reference" "$PYTEST_TIMEOUT" env MMSERVE_REQUIRE_GPU=1 \
  python -m pytest -q -rs --durations=8 tests/gpu tests/test_reference.py

phase "benchmark many_questions" "$BENCH_TIMEOUT" \
  python -m benchmarks.many_questions --size small --device cuda \
  --images 4 --questions 4 --max-tokens 16

echo
echo "=== summary (total ${SECONDS}s) ==="
printf '%s\n' "${SUMMARY[@]}"
if [[ $FAILED -ne 0 ]]; then
  echo "GPU CHECK: FAILED"
  exit 1
fi
echo "GPU CHECK: PASSED"
