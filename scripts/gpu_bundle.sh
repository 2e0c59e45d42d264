#!/usr/bin/env bash
# Build .gpu_bundle/: the wheels scripts/gpu_check.sh installs, with no network, on a
# GPU machine whose image has CUDA (nvcc), Python 3.12, torch, transformers, pytest,
# numpy, pillow and xxhash but not FlashInfer. Run it here, where PyPI is reachable.
#
#   scripts/gpu_bundle.sh                 # download the `wheel` lines of scripts/gpu_bundle.txt
#   scripts/gpu_bundle.sh --check PYTHON  # ... then dry-run gpu_check.sh's offline install and
#                                         # environment report with PYTHON (a Python 3.12 with
#                                         # torch and transformers; no GPU needed)
#
# The versions live in scripts/gpu_bundle.txt only. Wheels are for CPython 3.12 on
# x86-64 Linux (manylinux_2_28 or older, or pure Python), without dependencies: the
# list names every one that is needed. The bundle gets a SHA256SUMS that
# gpu_check.sh verifies; the script prints the bundle's size and fails if bundle +
# work tree (the files git tracks or would add) exceed GPU_BUNDLE_LIMIT_MIB (60).
#
# Env: GPU_BUNDLE (folder, default .gpu_bundle, git-ignored), GPU_BUNDLE_LIMIT_MIB,
# PYTHON (the interpreter whose pip downloads; default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

LIST=scripts/gpu_bundle.txt
BUNDLE=${GPU_BUNDLE:-.gpu_bundle}
LIMIT_MIB=${GPU_BUNDLE_LIMIT_MIB:-60}
CHECK_PY=
case "${1:-}" in
  "") ;;
  --check) CHECK_PY=${2:?usage: scripts/gpu_bundle.sh --check PYTHON} ;;
  -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
esac
if [[ -n ${PYTHON:-} ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi

# `wheel  name==version  imports...  # why` -> name==version
mapfile -t PINS < <(sed 's/#.*//' "$LIST" | awk '$1 == "wheel" { print $2 }')
if [[ ${#PINS[@]} -eq 0 ]]; then
  echo "no wheel lines in $LIST" >&2
  exit 1
fi

TMP="$BUNDLE.tmp.$$"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP"
echo "downloading ${#PINS[@]} wheels for CPython 3.12 x86-64: ${PINS[*]}"
# glibc 2.28 or older (pip does not widen a --platform to the older tags); pure wheels
# always qualify.
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
  manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  "${platforms[@]}" --dest "$TMP" "${PINS[@]}"

# One wheel per pin and nothing else; checksums; sizes.
"$PY" - "$TMP" "$LIMIT_MIB" "${PINS[@]}" <<'PY'
import hashlib
import re
import subprocess
import sys
from pathlib import Path

tmp, limit_mib, pins = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


want = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
files = sorted(p for p in tmp.iterdir() if p.is_file())
got = {}
for f in files:
    if f.suffix != ".whl":
        sys.exit(f"unexpected file in the bundle: {f.name}")
    name, version = f.name.split("-")[:2]
    if norm(name) in got:
        sys.exit(f"two wheels for {name}: {got[norm(name)]} and {f.name}")
    if want.get(norm(name)) != version:
        sys.exit(f"{f.name} is not one of the pins {pins}")
    got[norm(name)] = f.name
if missing := sorted(set(want) - set(got)):
    sys.exit(f"no wheel downloaded for {missing}")
sums = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)
(tmp / "SHA256SUMS").write_text(sums)

mib = 1024 * 1024
bundle = sum(f.stat().st_size for f in tmp.iterdir())
listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    capture_output=True, check=True,
).stdout.decode().split("\0")
tree = sum(Path(p).stat().st_size for p in listed if p and Path(p).is_file())
for f in files:
    print(f"  {f.stat().st_size / mib:7.2f} MiB  {f.name}")
print(f"bundle {bundle / mib:.1f} MiB + work tree {tree / mib:.1f} MiB "
      f"= {(bundle + tree) / mib:.1f} MiB (limit {limit_mib:g} MiB)")
if bundle + tree > limit_mib * mib:
    sys.exit("too large to travel to the GPU machine")
PY

rm -rf "$BUNDLE"
mv "$TMP" "$BUNDLE"
echo "bundle ready: $BUNDLE/ (copy it with the work tree; then run scripts/gpu_check.sh there)"

if [[ -n $CHECK_PY ]]; then
  site=$(mktemp -d)
  out=${GPU_CHECK_OUT:-gpu_check_out/bundle-check}
  echo
  echo "dry run of the offline install with $CHECK_PY (site $site, output $out)"
  rc=0
  GPU_CHECK_ONLY=setup PYTHON="$CHECK_PY" GPU_BUNDLE="$BUNDLE" GPU_SITE="$site" \
    scripts/gpu_check.sh "$out" || rc=$?
  rm -rf "$site"
  exit "$rc"
fi
