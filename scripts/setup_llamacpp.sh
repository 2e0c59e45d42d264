#!/usr/bin/env bash
# Set up llama.cpp's own server on the benchmark's weights, in an ignored folder.
#
#   scripts/setup_llamacpp.sh [DIR]        # default DIR: .llamacpp (git-ignored)
#
# Steps (each skipped when its output is already there, so a rerun is cheap):
#   1. pip download the llama-cpp-python sdist (LLAMACPP_PY_VERSION, pinned) and unpack
#      its vendor/llama.cpp into DIR/src
#   2. build the llama-quantize and llama-bench targets, then llama-server (CMake, Release,
#      no web UI: LLAMA_BUILD_UI=OFF and LLAMA_USE_PREBUILT_UI=OFF, so nothing is fetched at
#      build time), -j2 under nice
#   3. write the SentencePiece LLaVA-1.5 benchmark checkpoint DIR/model/hf (the `small`
#      size and seed of `mmserve make-model`, with the SentencePiece tokenizer that
#      llama.cpp's converter accepts; the default `small` checkpoint is not touched)
#   4. convert it at full precision (f32): the language model with convert_hf_to_gguf.py,
#      the CLIP tower and projector with the legacy llava scripts (llava_surgery_v2.py,
#      convert_image_encoder_to_gguf.py --use-f32)
#   5. the OneVision-0.5B-shape language model (issue 49's decode comparison): the Qwen2
#      decoder of `make-model --size onevision-0.5b` (seed 0, the checkpoint real-shapes
#      uses) as a Qwen2ForCausalLM folder, converted to f16 GGUF (our trained byte-level BPE
#      tokenizer is in no list of the converter's pre-tokenizer hashes, which it refuses;
#      `benchmarks llamacpp convert-lm` names it `gpt-2` from tokenizer.json, else refuses),
#      then llama-quantize --pure to Q4_0 and Q8_0 (every tensor, the tied head included,
#      as mmserve's int4/int8 quantize the head); LLAMACPP_SKIP_ONEVISION=1 skips this
#   6. write DIR/setup.json (versions, paths, seconds per step)
#
# Runs outside CI (never from .ci/ or the tests); `python -m benchmarks serve` and
# `python -m benchmarks llamacpp-decode` use DIR when it exists.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.llamacpp}"
DIR="$(mkdir -p "$DIR" && cd "$DIR" && pwd)"
VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
SIZE="${LLAMACPP_MODEL_SIZE:-small}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}"  # else the checkout's .venv
[ -n "$PY" ] || PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
SRC="$DIR/src"
LOG="$DIR/setup.log"
T0=$(date +%s)
declare -A SECS

step() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

# ---- 1. source -------------------------------------------------------------------
t=$(date +%s)
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  step "downloading llama-cpp-python==$VERSION sdist"
  mkdir -p "$DIR/sdist"
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR/sdist" >>"$LOG" 2>&1
  rm -rf "$DIR/unpack" && mkdir -p "$DIR/unpack"
  tar xzf "$DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/unpack"
  rm -rf "$SRC" && mv "$DIR/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
  rm -rf "$DIR/unpack"
fi
SECS[source]=$(($(date +%s) - t))

# ---- 2. build llama-quantize, llama-bench, llama-server -----------------------------
t=$(date +%s)
SERVER="$DIR/build/bin/llama-server"
BENCH="$DIR/build/bin/llama-bench"
QUANTIZE="$DIR/build/bin/llama-quantize"
if [ ! -f "$DIR/build/build.ninja" ]; then
  step "configuring (Release, no web UI, no tests/examples, static)"
  cmake -S "$SRC" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON >>"$LOG" 2>&1
fi
if [ ! -x "$BENCH" ] || [ ! -x "$QUANTIZE" ]; then
  step "building llama-quantize and llama-bench with -j$JOBS under nice"
  nice -n 10 cmake --build "$DIR/build" --target llama-quantize llama-bench -j "$JOBS" >>"$LOG" 2>&1
fi
if [ ! -x "$SERVER" ]; then
  step "building llama-server with -j$JOBS under nice (tens of minutes on 2 cores)"
  nice -n 10 cmake --build "$DIR/build" --target llama-server -j "$JOBS" >>"$LOG" 2>&1
fi
SECS[build]=$(($(date +%s) - t))
step "llama-server: $SERVER; llama-bench: $BENCH; llama-quantize: $QUANTIZE"

# ---- 3. the SentencePiece LLaVA-1.5 checkpoint -------------------------------------
t=$(date +%s)
HF="$DIR/model/hf"
if [ ! -f "$HF/model.safetensors" ]; then
  step "writing the $SIZE LLaVA-1.5 checkpoint with a SentencePiece tokenizer to $HF"
  (cd "$ROOT" && nice -n 10 "$PY" -m benchmarks llamacpp make-checkpoint "$HF" --size "$SIZE") >>"$LOG" 2>&1
fi
SECS[checkpoint]=$(($(date +%s) - t))

# ---- 4. convert at full precision --------------------------------------------------
t=$(date +%s)
export PYTHONPATH="$SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
LM_GGUF="$DIR/model/lm-f32.gguf"
if [ ! -f "$LM_GGUF" ]; then
  step "language model -> $LM_GGUF (convert_hf_to_gguf.py --outtype f32)"
  rm -rf "$DIR/model/lm"
  (cd "$ROOT" && nice -n 10 "$PY" -m benchmarks llamacpp export-lm "$HF" "$DIR/model/lm") >>"$LOG" 2>&1
  nice -n 10 "$PY" "$SRC/convert_hf_to_gguf.py" "$DIR/model/lm" --outtype f32 --outfile "$LM_GGUF" >>"$LOG" 2>&1
fi
MMPROJ="$DIR/model/vit/mmproj-model-f32.gguf"
if [ ! -f "$MMPROJ" ]; then
  step "CLIP tower + projector -> $MMPROJ (llava_surgery_v2.py, convert_image_encoder_to_gguf.py --use-f32)"
  SURG="$DIR/model/surgery"
  rm -rf "$SURG" "$DIR/model/vit" && mkdir -p "$SURG"
  # the surgery reads <dir>/model*.safetensors and writes llava.clip + llava.projector beside it
  cp "$HF/config.json" "$SURG/" && ln -s "$HF/model.safetensors" "$SURG/model.safetensors"
  nice -n 10 "$PY" "$SRC/tools/mtmd/legacy-models/llava_surgery_v2.py" -C -m "$SURG" >>"$LOG" 2>&1
  (cd "$ROOT" && "$PY" -m benchmarks llamacpp vit-dir "$HF" "$SURG" "$DIR/model/vit") >>"$LOG" 2>&1
  # a patched copy: --use-f32 still writes the projector and the patch-embedding conv in f16,
  # the copy keeps them f32 too (ggml's conv im2col input is f16 whatever the weight type);
  # and it runs under transformers 5 (see the shim below)
  CONV="$DIR/convert_image_encoder_to_gguf_f32.py"
  "$PY" - "$SRC/tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py" "$CONV" <<'PYEOF'
import sys
src, dst = sys.argv[1], sys.argv[2]
s = open(src, encoding="utf-8").read()
a = "data = data.squeeze().numpy().astype(np.float16)\n        else:"
b = "data = data.squeeze().numpy().astype(np.float32 if args.use_f32 else np.float16)\n        else:"
c = "    if n_dims == 4:\n"
d = "    if n_dims == 4 and not args.use_f32:\n"
# transformers 5's CLIPVisionModel has no .vision_model (its keys lost the prefix): wrap it so
# the script's model.vision_model.encoder.layers and "vision_model.*" names work as in 4.x
e = "    model = CLIPVisionModel.from_pretrained(dir_model)\n"
f = e + (
    "    if not hasattr(model, 'vision_model'):\n"
    "        _w = torch.nn.Module()\n"
    "        _w.vision_model = model\n"
    "        model = _w\n"
)
for x in (a, c, e):
    assert s.count(x) == 1, f"convert_image_encoder_to_gguf.py changed; update the patch ({x!r})"
open(dst, "w", encoding="utf-8").write(s.replace(a, b).replace(c, d).replace(e, f))
PYEOF
  nice -n 10 "$PY" "$CONV" -m "$DIR/model/vit" --llava-projector "$DIR/model/vit/llava.projector" \
    --output-dir "$DIR/model/vit" --clip-model-is-vision --use-f32 >>"$LOG" 2>&1
fi
SECS[convert]=$(($(date +%s) - t))

# ---- 5. the OneVision-0.5B-shape language model: f16, Q4_0, Q8_0 --------------------
t=$(date +%s)
OV="$DIR/onevision"
if [ "${LLAMACPP_SKIP_ONEVISION:-0}" != 1 ]; then
  if [ ! -f "$OV/lm-f16.gguf" ]; then
    step "OneVision-0.5B-shape Qwen2 decoder -> $OV/lm (make-model's seed-0 checkpoint)"
    rm -rf "$OV/lm"
    (cd "$ROOT" && nice -n 10 "$PY" -m benchmarks llamacpp export-qwen2 "$OV/lm" \
      --size onevision-0.5b) >>"$LOG" 2>&1
    step "-> $OV/lm-f16.gguf (convert_hf_to_gguf.py --outtype f16; pre-tokenizer from tokenizer.json)"
    (cd "$ROOT" && nice -n 10 "$PY" -m benchmarks llamacpp convert-lm "$SRC" "$OV/lm" \
      "$OV/lm-f16.gguf.part" --outtype f16) >>"$LOG" 2>&1
    mv "$OV/lm-f16.gguf.part" "$OV/lm-f16.gguf"
  fi
  for q in Q4_0 Q8_0; do
    if [ ! -f "$OV/lm-$q.gguf" ]; then
      step "llama-quantize --pure $q -> $OV/lm-$q.gguf"
      nice -n 10 "$QUANTIZE" --pure "$OV/lm-f16.gguf" "$OV/lm-$q.gguf.part" "$q" "$JOBS" >>"$LOG" 2>&1
      mv "$OV/lm-$q.gguf.part" "$OV/lm-$q.gguf"
    fi
  done
fi
SECS[onevision]=$(($(date +%s) - t))

# ---- 6. setup.json -------------------------------------------------------------------
cp "$ROOT/mmserve/testing/assets/chat_template.jinja" "$DIR/chat_template.jinja"
"$PY" - "$DIR" "$VERSION" "${SECS[source]}" "${SECS[build]}" "${SECS[checkpoint]}" "${SECS[convert]}" "${SECS[onevision]}" <<'PYEOF'
import json, os, subprocess, sys
d, version, *secs = sys.argv[1:]
info = {
    "llama_cpp_python_sdist": version,
    "server": "build/bin/llama-server",
    "bench": "build/bin/llama-bench",
    "quantize": "build/bin/llama-quantize",
    "onevision_gguf": {q: f"onevision/lm-{q}.gguf" for q in ("f16", "Q4_0", "Q8_0")
                       if os.path.exists(os.path.join(d, f"onevision/lm-{q}.gguf"))},
    "model_gguf": "model/lm-f32.gguf",
    "mmproj_gguf": "model/vit/mmproj-model-f32.gguf",
    "hf_dir": "model/hf",
    "chat_template": "chat_template.jinja",
    "seconds": dict(zip(("source", "build", "checkpoint", "convert", "onevision"),
                        map(int, secs))),
}
try:
    out = subprocess.run([os.path.join(d, info["server"]), "--version"], capture_output=True,
                         text=True, timeout=30)
    info["server_version"] = (out.stdout + out.stderr).strip().splitlines()[-2:]
except Exception as e:  # noqa: BLE001
    info["server_version"] = str(e)
prev = os.path.join(d, "setup.json")
if os.path.exists(prev):  # keep the first run's timings of steps a rerun skipped
    old = json.load(open(prev)).get("seconds", {})
    info["seconds"] = {k: max(v, old.get(k, 0)) for k, v in info["seconds"].items()}
json.dump(info, open(prev, "w"), indent=2)
print(json.dumps(info, indent=2))
PYEOF
step "done in $(($(date +%s) - T0)) s; python -m benchmarks serve picks up $DIR"
