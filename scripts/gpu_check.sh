#!/usr/bin/env bash
# GPU check in one command, for a machine with one NVIDIA GPU and no network.
#
#   scripts/gpu_check.sh [OUT_DIR]     # from anywhere; exit status 0 only if every phase passed
#
# Where: an image with CUDA (nvcc), Python 3.12 and a CUDA build of torch, transformers,
# pytest, numpy, pillow and xxhash (the `image` lines of scripts/gpu_bundle.txt), with the
# work tree and .gpu_bundle/ (built by scripts/gpu_bundle.sh where PyPI is reachable)
# copied there. Nothing is downloaded: the bundle's wheels are installed with
# `pip install --no-index --no-deps --target .gpu_site` and put first on PYTHONPATH,
# leaving the image's own packages (torch, transformers) untouched; the project runs
# from the work tree (PYTHONPATH, no install). Without .gpu_bundle/ the environment
# must already have flashinfer (e.g. `pip install -e ".[gpu,test]"`).
#
# Phases, each with its own timeout, 600 s in all (10 minutes; 750 s on a machine
# with two GPUs, which adds the --tp 2 phase). FlashInfer
# compiles its kernels on first use (JIT, into ~/.cache/flashinfer), which is most of
# the pytest phase: on an H100/H200 the tests need the FA3 prefill module (10 files of
# about 2 minutes of one core each, measured on a CPU machine) and the decode module
# (about 10 s a file), for bf16 and for fp16, and (tests/gpu/test_cuda_graph_gpu.py) the
# tensor-core decode module of OneVision-0.5B's 14/2 heads, so that the graph-decode
# phase finds every kernel it needs built; ninja builds each module's files in parallel.
#   install      30 s: checksums, then the offline install of .gpu_bundle/ (skipped without it)
#   environment  30 s: nvidia-smi; python, torch, CUDA, GPU, nvcc, ninja, flashinfer,
#                transformers versions; import flashinfer; what backend "auto" picks
#   pytest       310 s: tests/gpu (FlashInfer vs the torch backend, both engines, greedy
#                equality with transformers in fp32 on CUDA, CUDA-graph decode vs eager:
#                tests/gpu/test_cuda_graph_gpu.py; FlashInfer's fused RMSNorm (+ residual),
#                cos/sin-cache RoPE and SiLU-and-mul vs mmserve/kernels/ops.py's torch
#                versions: tests/gpu/test_fused_ops_gpu.py) and tests/test_reference.py,
#                with MMSERVE_REQUIRE_GPU=1 (a missing GPU or flashinfer fails, not skips)
#   quantized   120 s: tests/gpu/test_kv_fp8_gpu.py (FlashInfer's fp8-KV decode and prefill,
#                their own JIT modules, and the torch backend on CUDA vs fp32 attention over
#                the upcast pages; both engines with --kv-cache-dtype fp8_e4m3) and
#                tests/gpu/test_quant*_gpu.py where present (quantized weights on CUDA)
#   benchmark    40 s: benchmarks/in_process.py cache_on_off, small model on CUDA (cache on vs off)
#   graph decode 70 s: benchmarks/graph_decode.py on the OneVision-0.5B-shaped checkpoint
#                (built on first use, ~25 s): decode tokens/s at batch 1, 8, 32 for
#                FlashInfer with CUDA graphs, FlashInfer eager and the torch backend, their
#                tokens compared, capture time and memory; the engine thread's step
#                profile (host share) on many_questions for the same three
#   --tp 2      150 s, only with two GPUs (else a "skipped" row with the reason):
#                tests/gpu/test_tp_gpu.py, tp 2 over NCCL against tp 1 (fp32 and bf16)
#
# Output, in OUT_DIR (the argument, else $GPU_CHECK_OUT, else $OUT, else gpu_check_out/):
#   gpu_check.log  all output;  summary.txt  the phases table;  versions.json;
#   pytest.xml (JUnit);  benchmark.json;  graph_decode.json (and its tables in the log);
#   summary.json  phases (status, seconds, limit), versions, pytest counts, benchmark and
#   graph-decode figures and "passed".
#
# Env: PYTHON (default: the active venv's python, else the first of python, python3,
# python3.12 that has torch), GPU_BUNDLE (.gpu_bundle), GPU_SITE (.gpu_site),
# GPU_CHECK_ONLY=setup (install + environment only, no GPU needed; used by
# `scripts/gpu_bundle.sh --check PYTHON`), INSTALL_TIMEOUT, ENV_TIMEOUT, PYTEST_TIMEOUT,
# BENCH_TIMEOUT, GRAPH_TIMEOUT, TP_TIMEOUT, QUANT_TIMEOUT (seconds).
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD
abspath() { case $1 in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac }
export PYTHONUNBUFFERED=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

OUT_DIR=$(abspath "${1:-${GPU_CHECK_OUT:-${OUT:-$ROOT/gpu_check_out}}}")
mkdir -p "$OUT_DIR" || exit 2
LOG=$OUT_DIR/gpu_check.log
exec 3>&1 4>&2
exec > >(tee "$LOG") 2>&1
TEE_PID=$!

BUNDLE=$(abspath "${GPU_BUNDLE:-$ROOT/.gpu_bundle}")
SITE=$(abspath "${GPU_SITE:-$ROOT/.gpu_site}")
ONLY=${GPU_CHECK_ONLY:-}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-30}
ENV_TIMEOUT=${ENV_TIMEOUT:-30}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-310}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-40}
GRAPH_TIMEOUT=${GRAPH_TIMEOUT:-70}
QUANT_TIMEOUT=${QUANT_TIMEOUT:-120}
TP_TIMEOUT=${TP_TIMEOUT:-150}
HAVE_BUNDLE=0
compgen -G "$BUNDLE/*.whl" >/dev/null && HAVE_BUNDLE=1

if [[ -n ${PYTHON:-} ]]; then
  PY=$PYTHON
elif [[ -n ${VIRTUAL_ENV:-} ]]; then
  PY=$VIRTUAL_ENV/bin/python
elif [[ $HAVE_BUNDLE -eq 0 && -x .venv/bin/python ]]; then
  PY=$ROOT/.venv/bin/python # a full `pip install -e ".[gpu,test]"` here
else
  PY=
  for cand in python python3 python3.12; do
    if command -v "$cand" >/dev/null &&
      "$cand" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
      PY=$cand
      break
    fi
  done
  PY=${PY:-python3}
fi
PY=$(command -v "$PY" || echo "$PY")
export GPU_CHECK_PY=$PY GPU_CHECK_OUT_DIR=$OUT_DIR GPU_CHECK_ONLY=$ONLY GPU_SITE=$SITE \
  GPU_BUNDLE=$BUNDLE GPU_CHECK_HAVE_BUNDLE=$HAVE_BUNDLE

declare -a SUMMARY=()
PHASES_TSV=$OUT_DIR/phases.tsv
: >"$PHASES_TSV"
FAILED=0

phase() { # phase NAME TIMEOUT CMD...: run, time and record one phase
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
  SUMMARY+=("$(printf '%-30s %-18s %4ss (limit %ss)' "$name" "$status" "$took" "$limit")")
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$took" "$limit" >>"$PHASES_TSV"
}

echo "gpu_check: python $PY, bundle ${BUNDLE} ($([[ $HAVE_BUNDLE -eq 1 ]] && echo present || echo absent)), output $OUT_DIR"

# ---- install: the bundle's wheels, offline, into $SITE -----------------------------------
if [[ $HAVE_BUNDLE -eq 1 ]]; then
  phase "install (offline)" "$INSTALL_TIMEOUT" "$PY" - <<'PY'
import hashlib
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

bundle, site = Path(os.environ["GPU_BUNDLE"]), Path(os.environ["GPU_SITE"])
pins = [
    line.split("#")[0].split()[1]
    for line in Path("scripts/gpu_bundle.txt").read_text().splitlines()
    if line.split("#")[0].split()[:1] == ["wheel"]
]
sums = bundle / "SHA256SUMS"
if sums.exists():
    for line in sums.read_text().splitlines():
        digest, name = line.split()
        if hashlib.sha256((bundle / name).read_bytes()).hexdigest() != digest:
            sys.exit(f"checksum mismatch: {bundle / name} (rebuild with scripts/gpu_bundle.sh)")
    print(f"checksums ok: {len(sums.read_text().splitlines())} wheels")
marker = site / ".gpu_check_site"
if site.exists() and any(site.iterdir()) and not marker.exists():
    sys.exit(f"{site} exists and was not made by gpu_check.sh: not replacing it")
shutil.rmtree(site, ignore_errors=True)
if importlib.util.find_spec("pip") is not None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
           "--find-links", str(bundle), "--target", str(site), *pins]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
else:  # no pip in the image: unpack the wheels (all are plain purelib/platlib wheels)
    print("no pip: unpacking the wheels into", site)
    wanted = {re.sub(r"[-_.]+", "_", p.split("==")[0]).lower(): p.split("==")[1] for p in pins}
    for whl in sorted(bundle.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        if wanted.get(re.sub(r"[-_.]+", "_", name).lower()) != version:
            continue
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        for data in site.glob("*.data"):
            for sub in data.iterdir():
                dest = site / "bin" if sub.name == "scripts" else site
                dest.mkdir(exist_ok=True)
                for item in sub.iterdir():
                    shutil.move(str(item), str(dest / item.name))
            shutil.rmtree(data)
    for exe in (site / "bin").glob("*") if (site / "bin").is_dir() else []:
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


found = {norm(d.metadata["Name"]): d.version for d in md.distributions(path=[str(site)])}
for pin in pins:
    name, version = pin.split("==")
    if found.get(norm(name)) != version:
        sys.exit(f"{pin} not installed in {site} (found {found})")
marker.write_text("made by scripts/gpu_check.sh; replaced on every run\n")
print(f"installed {len(pins)} wheels into {site}: " + ", ".join(pins))
PY
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
fi
# The project itself: from the work tree, without installing it or its dependencies.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# FlashInfer's JIT links against $CUDA_HOME/lib64 and guesses CUDA_HOME from `which nvcc`,
# which is wrong where the nvcc on PATH is a wrapper or link outside the toolkit.
if [[ -z ${CUDA_HOME:-} ]]; then
  nvcc_path=$(command -v nvcc || true)
  for cand in "${CUDA_PATH:-}" ${nvcc_path:+"$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")"} \
    /usr/local/cuda /usr/local/cuda-*; do
    if [[ -n $cand && -x $cand/bin/nvcc && -e $cand/lib64/libcudart.so ]]; then
      export CUDA_HOME=$cand
      break
    fi
  done
fi

# ---- environment --------------------------------------------------------------------------
if [[ $ONLY != setup ]]; then
  echo
  nvidia-smi -L || echo "nvidia-smi failed: no NVIDIA driver/GPU visible"
fi
phase "environment" "$ENV_TIMEOUT" "$PY" - <<'PY'
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

setup_only = os.environ["GPU_CHECK_ONLY"] == "setup"
problems, v = [], {"python": platform.python_version(), "executable": sys.executable}
image = [
    name
    for line in Path("scripts/gpu_bundle.txt").read_text().splitlines()
    if line.split("#")[0].split()[:1] == ["image"]
    for name in line.split("#")[0].split()[2:]
]
if missing := [m for m in image if importlib.util.find_spec(m) is None]:
    problems.append(f"the image lacks {missing} (scripts/gpu_bundle.txt counts on them)")

import torch  # noqa: E402

v["torch"], v["torch_cuda"] = torch.__version__, torch.version.cuda
v["cuda_available"] = torch.cuda.is_available()
if v["cuda_available"]:
    v["gpu"] = torch.cuda.get_device_name(0)
    v["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
elif not setup_only:
    problems.append("torch.cuda.is_available() is False")
v["cuda_home"] = os.environ.get("CUDA_HOME")
nvcc = os.path.join(v["cuda_home"], "bin", "nvcc") if v["cuda_home"] else shutil.which("nvcc") or "nvcc"
try:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    v["nvcc"] = (re.findall(r"release ([\d.]+)", out) or ["?"])[0]
except (OSError, subprocess.SubprocessError) as e:
    v["nvcc"] = None
    if not setup_only:
        problems.append(f"no nvcc for FlashInfer's JIT ({e})")
v["ninja"] = shutil.which("ninja")
if v["ninja"] is None:
    problems.append("no `ninja` on PATH for FlashInfer's JIT")
for dist in ("flashinfer-python", "apache-tvm-ffi", "flashinfer-cubin", "flashinfer-jit-cache",
             "transformers", "tokenizers", "safetensors", "numpy", "pytest"):
    try:
        v[dist] = md.version(dist)
    except md.PackageNotFoundError:
        v[dist] = None
try:
    import flashinfer

    v["flashinfer_file"] = flashinfer.__file__
    print(f"import flashinfer: ok ({flashinfer.__version__} from {flashinfer.__file__})")
except Exception as e:  # noqa: BLE001
    problems.append(f"import flashinfer failed ({type(e).__name__}: {e})")
from mmserve.kernels.select import resolve_attention_backend  # noqa: E402

v["auto_backend_cuda_bf16"] = resolve_attention_backend("auto", "cuda", torch.bfloat16)
if not setup_only and v["auto_backend_cuda_bf16"] != "flashinfer":
    problems.append(f"backend 'auto' on cuda/bf16 is {v['auto_backend_cuda_bf16']!r}")
leaked = sorted(m for m in ("fastapi", "pydantic", "decord") if m in sys.modules)
if leaked:
    print(f"note: importing the backend pulled in {leaked}")
v["problems"] = problems
for key, val in v.items():
    print(f"{key:24} {val}")
out = Path(os.environ["GPU_CHECK_OUT_DIR"]) / "versions.json"
out.write_text(json.dumps(v, indent=2) + "\n")
sys.exit(1 if problems else 0)
PY

if [[ $ONLY != setup ]]; then
  # -rs lists every skip with its reason; MMSERVE_REQUIRE_GPU=1 makes a missing
  # GPU or flashinfer a failure (a skipped GPU test is not a pass).
  phase "pytest tests/gpu + reference" "$PYTEST_TIMEOUT" env MMSERVE_REQUIRE_GPU=1 \
    "$PY" -m pytest -v -rs --durations=10 -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest.xml" --ignore=tests/gpu/test_tp_gpu.py \
    --ignore=tests/gpu/test_kv_fp8_gpu.py --ignore-glob='tests/gpu/test_quant*_gpu.py' \
    tests/gpu tests/test_reference.py

  # fp8 KV and quantized weights: their own phase, so their kernels' JIT cannot starve
  # the phase above
  phase "pytest quantized" "$QUANT_TIMEOUT" env MMSERVE_REQUIRE_GPU=1 \
    "$PY" -m pytest -v -rs --durations=5 -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest_quantized.xml" tests/gpu/test_kv_fp8_gpu.py \
    $(compgen -G 'tests/gpu/test_quant*_gpu.py')

  # --tp 2 (NCCL, one rank per GPU) only where there are two GPUs; else a skip row
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [[ ${NGPU:-0} -ge 2 ]]; then
    phase "pytest --tp 2 (2 GPUs)" "$TP_TIMEOUT" "$PY" -m pytest -v -rs -p no:cacheprovider \
      tests/gpu/test_tp_gpu.py
  else
    echo "=== pytest --tp 2: skipped (needs 2 GPUs, ${NGPU:-0} visible) ==="
    SUMMARY+=("$(printf '%-30s %-18s %4ss (limit %ss)' "pytest --tp 2 (2 GPUs)" "skipped: ${NGPU:-0} GPU" 0 "$TP_TIMEOUT")")
    printf '%s\t%s\t%s\t%s\n' "pytest --tp 2 (2 GPUs)" "skipped: needs 2 GPUs, ${NGPU:-0} visible" 0 "$TP_TIMEOUT" >>"$PHASES_TSV"
  fi

  phase "benchmark many_questions" "$BENCH_TIMEOUT" "$PY" -c '
import json, sys
from benchmarks import in_process, workloads
wl = workloads.many_questions(4, 4, 16)
result = in_process.cache_on_off(in_process.model_dir("small"), wl, device="cuda")
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=2, default=str)
' "$OUT_DIR/benchmark.json"

  # CUDA graphs on/off, FlashInfer vs torch, at OneVision-0.5B shapes (checkpoint built once
  # into $MMSERVE_CACHE_DIR or ~/.cache/mmserve)
  rm -f "$OUT_DIR"/graph_decode*.json  # no stale figures from an earlier run in this folder
  phase "graph decode (onevision-0.5b)" "$GRAPH_TIMEOUT" "$PY" -m benchmarks.graph_decode \
    --device cuda --size onevision-0.5b --family llava-onevision --batches 1,8,32 --tokens 32 \
    --images 2 --questions 2 --profile-tokens 16 --out "$OUT_DIR"
fi

# ---- summary ------------------------------------------------------------------------------
echo
echo "=== summary (total ${SECONDS}s) ==="
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.txt"
export GPU_CHECK_FAILED=$FAILED GPU_CHECK_SECONDS=$SECONDS
timeout 30 "$PY" - <<'PY' || echo "(summary.json not written)"
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(os.environ["GPU_CHECK_OUT_DIR"])
s = {"passed": os.environ["GPU_CHECK_FAILED"] == "0", "total_s": int(os.environ["GPU_CHECK_SECONDS"]),
     "mode": os.environ["GPU_CHECK_ONLY"] or "full", "phases": []}
for line in (out / "phases.tsv").read_text().splitlines():
    name, status, took, limit = line.split("\t")
    s["phases"].append({"name": name, "status": status, "seconds": int(took), "limit_s": int(limit)})
if (out / "versions.json").exists():
    s["versions"] = json.loads((out / "versions.json").read_text())
for key, name in (("pytest", "pytest.xml"), ("pytest_quantized", "pytest_quantized.xml")):
    if (out / name).exists():
        suites = ET.parse(out / name).getroot()
        suite = suites if suites.tag == "testsuite" else suites[0]
        s[key] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
if (out / "benchmark.json").exists():
    s["benchmark"] = json.loads((out / "benchmark.json").read_text())
if (out / "graph_decode.json").exists():
    s["graph_decode"] = json.loads((out / "graph_decode.json").read_text())
elif (out / "graph_decode.partial.json").exists():  # the phase timed out midway
    s["graph_decode"] = {"partial": True, **json.loads((out / "graph_decode.partial.json").read_text())}
(out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
print(f"summary.json written to {out}")
PY
if [[ $FAILED -ne 0 ]]; then
  echo "GPU CHECK${ONLY:+ ($ONLY only)}: FAILED"
else
  echo "GPU CHECK${ONLY:+ ($ONLY only)}: PASSED"
fi
exec 1>&3 2>&4
wait "$TEE_PID" 2>/dev/null
exit "$FAILED"
