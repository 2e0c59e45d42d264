#!/usr/bin/env bash
# GPU check in one command, for a machine with one NVIDIA GPU and no network.
#
#   scripts/gpu_check.sh [OUT_DIR]     # from anywhere; exit status 0 only if every phase passed
#   GPU_CHECK_DRY_RUN=1 scripts/gpu_check.sh OUT_DIR   # here, no GPU: the plan, every GPU
#                                      # phase "skipped: no GPU", files and time limits counted
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
# Time: the phases' limits add up to at most GPU_CHECK_BUDGET (480 s; the script refuses
# to start over it), leaving 120 s of a 600 s command for start-up and the copy back
# (the --tp 2 phase, only on a machine with two GPUs, comes on top). The speculation
# phase's 40 s came from the prebuild's and pytest's limits (180 -> 165, 115 -> 90 s:
# 116-130 s and 36 s measured on an H200).
# FlashInfer compiles its kernels on first use (JIT, into ~/.cache/flashinfer) and a lent
# machine is fresh every time, so the first GPU phase builds every module the later ones
# use (`python -m mmserve.kernels.warmup`), each module in its own process so that their
# compiles overlap on all cores (ninja runs each module's files in parallel too). Module
# sizes are estimates from a CPU machine, not GPU measurements: the FA3 prefill module is
# ~10 files of ~2 min of one core each, the FA2 prefill module (tensor-core decode, fp8
# KV) about half that, decode modules ~10 s a file, norm/RoPE/activation ~30 s each:
# ~3,000-4,000 core-seconds for bf16 + fp8 KV, ~3-4 min on 16 cores. A prebuild cut off
# by its limit is not lost (ninja keeps the finished objects; the next phase resumes).
# fp16 doubles the attention modules, so its tests run only where the kernels are
# precompiled (the flashinfer-jit-cache wheel importable); otherwise `-k "not fp16"`.
#   install      20 s: checksums, then the offline install of .gpu_bundle/ (skipped without it)
#   environment  20 s: nvidia-smi; python, torch, CUDA, GPU, nvcc, ninja, flashinfer,
#                transformers versions; import flashinfer; what backend "auto" picks; what
#                --deterministic runs (the torch backend: it refuses FlashInfer, so there
#                are no FlashInfer deterministic settings to time; asked of the code)
#   prebuild    165 s: every FlashInfer module of the shapes below (bf16; fp16 when
#                precompiled; fp8 KV), one log line per module with its seconds
#   pytest       90 s: tests/gpu (FlashInfer vs the torch backend, both engines, greedy
#                equality with transformers in fp32 on CUDA, CUDA-graph decode vs eager,
#                FlashInfer's fused ops vs mmserve/kernels/ops.py's torch versions,
#                --deterministic in bf16 on CUDA: "auto" runs the torch backend, and
#                bit-identity across cache states and batches, recorded as XPASS or
#                XFAIL: it is claimed on the CPU only) and
#                tests/test_reference.py, with MMSERVE_REQUIRE_GPU=1 (a missing GPU or
#                flashinfer fails, not skips)
#   quantized    40 s: tests/gpu/test_kv_fp8_gpu.py and tests/gpu/test_quant*_gpu.py
#                (int4 included: tinygemm against the dequantized weight)
#   qmm timing   15 s: benchmarks/quant_cuda.py: int8 / fp8 / int4 layers against bf16,
#                eager and replayed from a CUDA graph (quant_cuda.json)
#   benchmark    25 s: benchmarks/in_process.py cache_on_off, small model on CUDA
#   graph decode 65 s: benchmarks/graph_decode.py at OneVision-0.5B shapes (checkpoint
#                built on first use, ~25 s): decode tokens/s, CUDA graphs on/off, torch
#   speculation  40 s: benchmarks/spec.py at OneVision-0.5B shapes (the checkpoint above,
#                edited to quote its prompt): n-gram speculation off / on / forced on the
#                prompt-copying document QA, batch 1 and 8, 3 rounds of 64 tokens:
#                accepted length and the speed-up over off (its figures go into
#                summary.json's "spec": spec.json and spec.md stay out of OUT_DIR, which
#                holds 8 files already)
#   --tp 2      150 s, only with two GPUs (else a "skipped" row with the reason):
#                tests/gpu/test_tp_gpu.py, tp 2 over NCCL against tp 1 (fp32 and bf16)
#
# Output, in OUT_DIR (the argument, else $GPU_CHECK_OUT, else $OUT, else gpu_check_out/),
# at most 8 files, summary.json first:
#   summary.json  written before the first phase (every phase "pending", the limits and
#                their total, the files a full run writes) and rewritten as each phase
#                ends, so a run cut off midway still leaves its finished phases; then
#                versions (torch, transformers, flashinfer it ran with), pytest counts,
#                benchmark, graph-decode and speculation figures, "complete" and "passed";
#   gpu_check.log all output;  pytest.xml, pytest_quantized.xml (JUnit);  benchmark.json;
#   graph_decode.json + graph_decode.md (graph_decode.partial.json if cut off);
#   quant_cuda.json.
#
# Env: PYTHON (default: the active venv's python, else the first of python, python3,
# python3.12 that has torch), GPU_BUNDLE (.gpu_bundle), GPU_SITE (.gpu_site),
# GPU_CHECK_ONLY=setup (install + environment only, no GPU needed; used by
# `scripts/gpu_bundle.sh --check PYTHON`), GPU_CHECK_DRY_RUN=1, GPU_CHECK_BUDGET (480),
# INSTALL_TIMEOUT, ENV_TIMEOUT, PREBUILD_TIMEOUT, PYTEST_TIMEOUT, QUANT_TIMEOUT,
# QMM_TIMEOUT, BENCH_TIMEOUT, GRAPH_TIMEOUT, SPEC_TIMEOUT, TP_TIMEOUT (seconds).
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD
abspath() { case $1 in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac }
export PYTHONUNBUFFERED=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

OUT_DIR=$(abspath "${1:-${GPU_CHECK_OUT:-${OUT:-$ROOT/gpu_check_out}}}")
mkdir -p "$OUT_DIR" || exit 2
# the first file written: a run killed before its first phase still says so
printf '{"complete": false, "passed": false, "phases": []}\n' >"$OUT_DIR/summary.json"
LOG=$OUT_DIR/gpu_check.log
exec 3>&1 4>&2
exec > >(tee "$LOG") 2>&1
TEE_PID=$!

BUNDLE=$(abspath "${GPU_BUNDLE:-$ROOT/.gpu_bundle}")
SITE=$(abspath "${GPU_SITE:-$ROOT/.gpu_site}")
ONLY=${GPU_CHECK_ONLY:-}
DRY=${GPU_CHECK_DRY_RUN:-0}
DRY_NOTE=
[[ $DRY == 1 ]] && DRY_NOTE=" (dry run)"
BUDGET=${GPU_CHECK_BUDGET:-480}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-20}
ENV_TIMEOUT=${ENV_TIMEOUT:-20}
PREBUILD_TIMEOUT=${PREBUILD_TIMEOUT:-165}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-90}
QUANT_TIMEOUT=${QUANT_TIMEOUT:-40}
QMM_TIMEOUT=${QMM_TIMEOUT:-15}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-25}
GRAPH_TIMEOUT=${GRAPH_TIMEOUT:-65}
SPEC_TIMEOUT=${SPEC_TIMEOUT:-40}
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
# phases.tsv, plan.tsv and versions.json live outside OUT_DIR: only the files listed in
# the header's "Output" are written there
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
export GPU_CHECK_PY=$PY GPU_CHECK_OUT_DIR=$OUT_DIR GPU_CHECK_ONLY=$ONLY GPU_SITE=$SITE \
  GPU_BUNDLE=$BUNDLE GPU_CHECK_HAVE_BUNDLE=$HAVE_BUNDLE GPU_CHECK_DRY_RUN=$DRY \
  GPU_CHECK_WORK=$WORK GPU_CHECK_BUDGET=$BUDGET


PLAN_TSV=$WORK/plan.tsv
PHASES_TSV=$WORK/phases.tsv
: >"$PLAN_TSV"
: >"$PHASES_TSV"
FAILED=0
export GPU_CHECK_FAILED=0 GPU_CHECK_COMPLETE=0 GPU_CHECK_FP16_NOTE=

write_summary() { # summary.json from the plan, the phases run so far and their outputs
  export GPU_CHECK_FAILED=$FAILED GPU_CHECK_SECONDS=$SECONDS
  timeout 30 "$PY" - <<'PY' || echo "(summary.json not written)"
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

env = os.environ
out, work = Path(env["GPU_CHECK_OUT_DIR"]), Path(env["GPU_CHECK_WORK"])
ran = {}
for line in (work / "phases.tsv").read_text().splitlines():
    name, status, took, limit = line.split("\t")
    ran[name] = {"name": name, "status": status, "seconds": int(took), "limit_s": int(limit)}
phases, files = [], {"summary.json", "gpu_check.log"}
for line in (work / "plan.tsv").read_text().splitlines():
    name, limit, outputs = line.split("\t")
    files.update(outputs.split())
    phases.append(ran.get(name, {"name": name, "status": "pending", "seconds": 0,
                                 "limit_s": int(limit)}))
complete = env["GPU_CHECK_COMPLETE"] == "1"
mode = "dry run" if env["GPU_CHECK_DRY_RUN"] == "1" else env["GPU_CHECK_ONLY"] or "full"
s = {
    "complete": complete,
    "passed": complete and env["GPU_CHECK_FAILED"] == "0",
    "mode": mode,
    "total_s": int(env["GPU_CHECK_SECONDS"]),
    "total_limit_s": sum(p["limit_s"] for p in phases),
    "budget_s": int(env["GPU_CHECK_BUDGET"]),
    "phases": phases,
    "fp16": env["GPU_CHECK_FP16_NOTE"] or None,
    "files_planned": sorted(files),
    "files": sorted({p.name for p in out.iterdir() if p.is_file()} | {"summary.json"}),
}
if (work / "versions.json").exists():
    v = s["versions"] = json.loads((work / "versions.json").read_text())
    s["ran_with"] = {"torch": v.get("torch"), "transformers": v.get("transformers"),
                     "flashinfer": v.get("flashinfer") or v.get("flashinfer-python")}
for key, name in (("pytest", "pytest.xml"), ("pytest_quantized", "pytest_quantized.xml")):
    if (out / name).exists():
        try:
            suites = ET.parse(out / name).getroot()
        except ET.ParseError:  # cut off while pytest wrote it
            continue
        suite = suites if suites.tag == "testsuite" else suites[0]
        s[key] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
for key, name in (("benchmark", "benchmark.json"), ("graph_decode", "graph_decode.json"),
                  ("quant_cuda", "quant_cuda.json")):
    if (out / name).exists():
        s[key] = json.loads((out / name).read_text())
if (work / "spec" / "spec.json").exists():  # in the work folder: OUT_DIR holds 8 files
    spec = json.loads((work / "spec" / "spec.json").read_text())
    s["spec"] = {k: spec.get(k) for k in ("size", "device", "dtype", "prompt_tokens", "tokens",
                                          "k", "rounds", "rows")}
if "graph_decode" not in s and (out / "graph_decode.partial.json").exists():
    s["graph_decode"] = {"partial": True,
                         **json.loads((out / "graph_decode.partial.json").read_text())}
(out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
PY
}

record() { # record NAME STATUS SECONDS LIMIT; then rewrite summary.json
  [[ $2 == ok || $2 == skipped* ]] || FAILED=1
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$PHASES_TSV"
  write_summary
}

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
  record "$name" "$status" "$took" "$limit"
}

gpu_phase() { # gpu_phase NAME TIMEOUT CMD...: a phase, or its "skipped: no GPU" row in a dry run
  if [[ $DRY == 1 ]]; then
    echo "=== $1 (limit $2s): skipped: no GPU (dry run) ==="
    record "$1" "skipped: no GPU" 0 "$2"
  else
    phase "$@"
  fi
}

# ---- the plan: phases in order, their limits and the files they write --------------------
plan() { printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >>"$PLAN_TSV"; }
if [[ $DRY == 1 || $ONLY == setup ]]; then
  NGPU=0
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
plan "install (offline)" "$INSTALL_TIMEOUT"  # counted without a bundle too: the GPU run has one
plan "environment" "$ENV_TIMEOUT"
if [[ $ONLY != setup ]]; then
  plan "prebuild FlashInfer kernels" "$PREBUILD_TIMEOUT"
  plan "pytest tests/gpu + reference" "$PYTEST_TIMEOUT" pytest.xml
  plan "pytest quantized" "$QUANT_TIMEOUT" pytest_quantized.xml
  plan "quantized matmul timing" "$QMM_TIMEOUT" quant_cuda.json
  plan "pytest --tp 2 (2 GPUs)" "$([[ ${NGPU:-0} -ge 2 ]] && echo "$TP_TIMEOUT" || echo 0)"
  plan "benchmark many_questions" "$BENCH_TIMEOUT" benchmark.json
  plan "graph decode (onevision-0.5b)" "$GRAPH_TIMEOUT" "graph_decode.json graph_decode.md"
  plan "speculation (onevision-0.5b)" "$SPEC_TIMEOUT"
fi
TOTAL_LIMIT=$(awk -F'\t' '{ s += $2 } END { print s + 0 }' "$PLAN_TSV")
[[ ${NGPU:-0} -ge 2 ]] && TOTAL_LIMIT=$((TOTAL_LIMIT - TP_TIMEOUT)) # two GPUs: --tp 2 on top
echo "gpu_check: python $PY, bundle ${BUNDLE} ($([[ $HAVE_BUNDLE -eq 1 ]] && echo present || echo absent)), output $OUT_DIR$DRY_NOTE"
echo "gpu_check: phase limits add up to ${TOTAL_LIMIT}s (budget ${BUDGET}s)"
write_summary
if [[ $TOTAL_LIMIT -gt $BUDGET ]]; then
  echo "gpu_check: the limits exceed the budget: not starting (lower the *_TIMEOUT variables)"
  exec 1>&3 2>&4
  wait "$TEE_PID" 2>/dev/null
  rm -rf "$WORK"
  exit 2
fi

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
else
  echo "=== install (offline): skipped (no bundle at $BUNDLE) ==="
  record "install (offline)" "skipped: no bundle" 0 "$INSTALL_TIMEOUT"
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
if [[ $ONLY != setup && $DRY != 1 ]]; then
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

setup_only = os.environ["GPU_CHECK_ONLY"] == "setup" or os.environ["GPU_CHECK_DRY_RUN"] == "1"
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

    v["flashinfer"], v["flashinfer_file"] = flashinfer.__version__, flashinfer.__file__
    print(f"import flashinfer: ok ({flashinfer.__version__} from {flashinfer.__file__})")
except Exception as e:  # noqa: BLE001
    problems.append(f"import flashinfer failed ({type(e).__name__}: {e})")
from mmserve.kernels.select import resolve_attention_backend  # noqa: E402

v["auto_backend_cuda_bf16"] = resolve_attention_backend("auto", "cuda", torch.bfloat16)
from mmserve.kernels.select import make_attention_backend  # noqa: E402

try:  # refused before FlashInfer is touched: the same answer with or without a GPU
    make_attention_backend("flashinfer", "cuda", 8, 2, 64, torch.bfloat16, deterministic=True)
    v["deterministic"] = "FlashInfer accepted under --deterministic (no step times it yet)"
except ValueError as e:
    v["deterministic"] = f"torch backend only: --deterministic refuses FlashInfer ({e})"
if not setup_only and v["auto_backend_cuda_bf16"] != "flashinfer":
    problems.append(f"backend 'auto' on cuda/bf16 is {v['auto_backend_cuda_bf16']!r}")
leaked = sorted(m for m in ("fastapi", "pydantic", "decord") if m in sys.modules)
if leaked:
    print(f"note: importing the backend pulled in {leaked}")
v["problems"] = problems
for key, val in v.items():
    print(f"{key:24} {val}")
out = Path(os.environ["GPU_CHECK_WORK"]) / "versions.json"
out.write_text(json.dumps(v, indent=2) + "\n")
if problems and os.environ["GPU_CHECK_DRY_RUN"] == "1":
    print("dry run: noted, not failed:", *problems, sep="\n  ")
    sys.exit(0)
sys.exit(1 if problems else 0)
PY

if [[ $ONLY != setup ]]; then
  # fp16 doubles FlashInfer's attention modules: tested only where they are precompiled
  FP16=0
  if "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("flashinfer_jit_cache") is None)' 2>/dev/null; then
    FP16=1
    GPU_CHECK_FP16_NOTE="tested (flashinfer-jit-cache: precompiled kernels)"
  else
    GPU_CHECK_FP16_NOTE="dropped: no precompiled kernels (flashinfer-jit-cache absent); bf16 only"
  fi
  echo "fp16: $GPU_CHECK_FP16_NOTE"
  K_FP16=()
  [[ $FP16 -eq 1 ]] || K_FP16=(-k "not fp16")

  # every module the phases below use, built first, in parallel: the test shapes (GQA 8/2
  # and 2/1 share modules: head dim 64, FA2 decode), OneVision-0.5B's 14/2 (tensor-core
  # decode), each with fp8 KV too
  SHAPES=(8/2/64/bfloat16 14/2/64/bfloat16 8/2/64/bfloat16/float8_e4m3fn
    14/2/64/bfloat16/float8_e4m3fn)
  [[ $FP16 -eq 1 ]] && SHAPES+=(8/2/64/float16)
  gpu_phase "prebuild FlashInfer kernels" "$PREBUILD_TIMEOUT" \
    "$PY" -m mmserve.kernels.warmup --jobs "$(nproc 2>/dev/null || echo 4)" "${SHAPES[@]}"

  # -rsxX lists every skip, xfail and xpass with its reason; MMSERVE_REQUIRE_GPU=1 makes a
  # missing GPU or flashinfer a failure (a skipped GPU test is not a pass).
  gpu_phase "pytest tests/gpu + reference" "$PYTEST_TIMEOUT" env MMSERVE_REQUIRE_GPU=1 \
    "$PY" -m pytest -v -rsxX --durations=10 -p no:cacheprovider "${K_FP16[@]}" \
    --junitxml="$OUT_DIR/pytest.xml" --ignore=tests/gpu/test_tp_gpu.py \
    --ignore=tests/gpu/test_kv_fp8_gpu.py --ignore-glob='tests/gpu/test_quant*_gpu.py' \
    tests/gpu tests/test_reference.py

  # fp8 KV and quantized weights: their own phase and limit
  gpu_phase "pytest quantized" "$QUANT_TIMEOUT" env MMSERVE_REQUIRE_GPU=1 \
    "$PY" -m pytest -v -rs --durations=5 -p no:cacheprovider "${K_FP16[@]}" \
    --junitxml="$OUT_DIR/pytest_quantized.xml" tests/gpu/test_kv_fp8_gpu.py \
    $(compgen -G 'tests/gpu/test_quant*_gpu.py')

  # int8 / fp8 / int4 layers against bf16, eager and in a CUDA graph (benchmarks/quant_cuda.py)
  gpu_phase "quantized matmul timing" "$QMM_TIMEOUT" "$PY" -m benchmarks.quant_cuda \
    --out "$OUT_DIR/quant_cuda.json"

  # --tp 2 (NCCL, one rank per GPU) only where there are two GPUs; else a skip row
  if [[ $DRY == 1 ]]; then
    gpu_phase "pytest --tp 2 (2 GPUs)" 0 true
  elif [[ ${NGPU:-0} -ge 2 ]]; then
    phase "pytest --tp 2 (2 GPUs)" "$TP_TIMEOUT" "$PY" -m pytest -v -rs -p no:cacheprovider \
      tests/gpu/test_tp_gpu.py
  else
    echo "=== pytest --tp 2: skipped (needs 2 GPUs, ${NGPU:-0} visible) ==="
    record "pytest --tp 2 (2 GPUs)" "skipped: needs 2 GPUs, ${NGPU:-0} visible" 0 0
  fi

  gpu_phase "benchmark many_questions" "$BENCH_TIMEOUT" "$PY" -c '
import json, sys
from benchmarks import in_process, workloads
wl = workloads.many_questions(4, 4, 16)
result = in_process.cache_on_off(in_process.model_dir("small"), wl, device="cuda")
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=2, default=str)
' "$OUT_DIR/benchmark.json"

  # CUDA graphs on/off, FlashInfer vs torch, at OneVision-0.5B shapes (checkpoint built once
  # into $MMSERVE_CACHE_DIR or ~/.cache/mmserve)
  rm -f "$OUT_DIR"/graph_decode*.json "$OUT_DIR"/graph_decode.md # no stale figures
  gpu_phase "graph decode (onevision-0.5b)" "$GRAPH_TIMEOUT" "$PY" -m benchmarks.graph_decode \
    --device cuda --size onevision-0.5b --family llava-onevision --batches 1,8,32 --tokens 32 \
    --images 2 --questions 2 --profile-tokens 16 --out "$OUT_DIR"

  # n-gram speculation on the prompt-copying document QA (issue 49): accepted length and
  # tokens/s against off at batch 1 and 8, the OneVision-0.5B checkpoint built above
  rm -rf "$WORK/spec"
  gpu_phase "speculation (onevision-0.5b)" "$SPEC_TIMEOUT" "$PY" -m benchmarks.spec \
    --device cuda --size onevision-0.5b --family llava-onevision --models quoting \
    --batches 1,8 --tokens 64 --rounds 3 --out "$WORK/spec"
fi

# ---- summary ------------------------------------------------------------------------------
echo
echo "=== summary (total ${SECONDS}s, limits ${TOTAL_LIMIT}s) ==="
while IFS=$'\t' read -r name status took limit; do
  printf '%-30s %-34s %4ss (limit %ss)\n' "$name" "$status" "$took" "$limit"
done <"$PHASES_TSV"
export GPU_CHECK_COMPLETE=1
write_summary
echo "summary.json written to $OUT_DIR ($(find "$OUT_DIR" -maxdepth 1 -type f | wc -l) files)"
rm -rf "$WORK"
if [[ $FAILED -ne 0 ]]; then
  echo "GPU CHECK${ONLY:+ ($ONLY only)}$DRY_NOTE: FAILED"
else
  echo "GPU CHECK${ONLY:+ ($ONLY only)}$DRY_NOTE: PASSED"
fi
exec 1>&3 2>&4
wait "$TEE_PID" 2>/dev/null
exit "$FAILED"
