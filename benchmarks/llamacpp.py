"""llama.cpp's ``llama-server`` as a benchmark baseline, on the benchmark's own weights.

``scripts/setup_llamacpp.sh`` builds ``llama-server`` from the llama.cpp source that
the ``llama-cpp-python`` sdist vendors and calls the helpers here (``python -m
benchmarks.llamacpp ...``) to write and convert the checkpoint:

- ``make-checkpoint``: the LLaVA-1.5 benchmark checkpoint (``mmserve make-model``'s
  size and seed, hence the same weights) with the SentencePiece tokenizer that the
  real LLaVA-1.5 has and that llama.cpp's converter accepts (it refuses our byte-level
  BPE). mmserve's default ``small`` checkpoint is not changed: this one lives in the
  setup folder, and ``benchmarks.serve`` serves it on every server when it exists.
- ``export-lm``: the language model alone (``LlamaForCausalLM`` + tokenizer) for
  ``convert_hf_to_gguf.py``.
- ``vit-dir``: after ``llava_surgery_v2.py``, the CLIP tower as a ``CLIPVisionModel``
  directory for the legacy ``convert_image_encoder_to_gguf.py --clip-model-is-vision``.

:func:`find_setup` reads ``<dir>/setup.json`` (written by the script) and
:class:`LlamaServer` runs the server with the benchmark's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".llamacpp"
CHAT_TEMPLATE = ROOT / "mmserve" / "model" / "assets" / "chat_template.jinja"
#: llama.cpp's media marker (pinned through ``LLAMA_MEDIA_MARKER``; random otherwise): the
#: server turns each image part into this text, and ``/completion`` prompts use it.
MEDIA_MARKER = "<__media__>"


@dataclass
class LlamaCppSetup:
    """What ``scripts/setup_llamacpp.sh`` left in its folder.

    Attributes:
        dir: the setup folder.
        server: the ``llama-server`` binary.
        model_gguf: the language model (f32 GGUF).
        mmproj_gguf: CLIP tower + projector (legacy llava GGUF).
        hf_dir: the Hugging Face checkpoint both were converted from (mmserve serves it).
        chat_template: the Jinja template given to ``llama-server --chat-template-file``.
        info: the rest of ``setup.json`` (versions, seconds per step).
    """

    dir: Path
    server: Path
    model_gguf: Path
    mmproj_gguf: Path
    hf_dir: Path
    chat_template: Path
    info: dict = field(default_factory=dict)


def find_setup(path: str | Path | None = None) -> tuple[LlamaCppSetup | None, str]:
    """The llama.cpp setup in ``path`` (default ``.llamacpp``, or ``$MMSERVE_LLAMACPP_DIR``).

    Returns:
        ``(setup, "")``, or ``(None, why)`` when it is absent or incomplete.
    """
    d = Path(path or os.environ.get("MMSERVE_LLAMACPP_DIR") or DEFAULT_DIR)
    meta = d / "setup.json"
    if not meta.is_file():
        return None, f"no llama.cpp setup in {d} (run scripts/setup_llamacpp.sh; not done in CI)"
    info = json.loads(meta.read_text(encoding="utf-8"))
    s = LlamaCppSetup(
        dir=d,
        server=d / info["server"],
        model_gguf=d / info["model_gguf"],
        mmproj_gguf=d / info["mmproj_gguf"],
        hf_dir=d / info["hf_dir"],
        chat_template=d / info["chat_template"],
        info=info,
    )
    missing = [
        str(p) for p in (s.server, s.model_gguf, s.mmproj_gguf, s.hf_dir, s.chat_template)
        if not p.exists()
    ]  # fmt: skip
    if missing:
        return None, f"llama.cpp setup in {d} is incomplete (missing {', '.join(missing)})"
    return s, ""


# ---- checkpoint and conversion helpers (called by scripts/setup_llamacpp.sh) --------


def make_sp_checkpoint(out: Path, size: str = "small", seed: int = 0) -> Path:
    """``make_checkpoint(out, size, seed)`` with a SentencePiece tokenizer.

    The weights are those of the default checkpoint of the same size and seed (the
    re-initialisation is seeded by parameter name and the vocabulary has the same
    2,000 ids); only the tokenizer differs. Written through a temporary sibling that is
    renamed into place.
    """
    from mmserve.model import make_checkpoint as mc

    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    original = mc.build_tokenizer
    try:
        mc.build_tokenizer = lambda *a, **k: mc.build_sentencepiece_tokenizer(tmp)
        mc.make_checkpoint(tmp, size=size, seed=seed, family="llava")
        os.rename(tmp, out)
    finally:
        mc.build_tokenizer = original
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_language_model(hf_dir: Path, out: Path) -> Path:
    """The checkpoint's Llama language model (with ``lm_head``) and tokenizer in ``out``."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers import LlavaForConditionalGeneration as Llava

    model = Llava.from_pretrained(hf_dir, dtype=torch.float32).eval()
    lm = LlamaForCausalLM(model.config.text_config)
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.save_pretrained(out)
    shutil.copy(Path(hf_dir) / "tokenizer.model", out / "tokenizer.model")
    return out


def write_vit_dir(hf_dir: Path, surgery_dir: Path, out: Path) -> Path:
    """A ``CLIPVisionModel`` directory for ``convert_image_encoder_to_gguf.py``.

    ``llava.clip`` (from ``llava_surgery_v2.py -C``) becomes ``pytorch_model.bin`` (keys
    renamed ``vision_tower.*`` -> ``vision_model.*``); the
    config is the checkpoint's ``vision_config`` plus ``vision_feature_layer`` (so the
    converter keeps the layers up to the one LLaVA reads, -2) and the projector file is
    copied beside it.
    """
    cfg = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    vision = dict(cfg["vision_config"])
    vision["model_type"] = "clip_vision_model"
    vision["architectures"] = ["CLIPVisionModel"]
    vision["vision_feature_layer"] = cfg.get("vision_feature_layer", -2)
    import torch

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vision, indent=2), encoding="utf-8")
    clip = torch.load(surgery_dir / "llava.clip", map_location="cpu")
    # this checkpoint's layout names the tower "vision_tower.<...>" (no "vision_model."
    # inside, so the surgery keeps the name); CLIPVisionModel wants "vision_model.<...>"
    clip = {
        "vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k: v
        for k, v in clip.items()
    }
    torch.save(clip, out / "pytorch_model.bin")
    shutil.copy(surgery_dir / "llava.projector", out / "llava.projector")
    return out


# ---- running the server -------------------------------------------------------------


@dataclass
class LlamaServerConfig:
    """Flags of one ``llama-server`` run.

    Attributes:
        threads: ``-t`` and ``-tb`` (generation and batch threads; also the CLIP encoder).
        slots: ``-np``: requests decoded together (continuous batching).
        ctx_per_slot: context tokens per slot (``-c`` = slots x this).
        batch: ``-b``/``-ub``: tokens per prompt-processing batch.
        cache_prompt: reuse a slot's previous prompt prefix (llama.cpp's prompt cache).
        cache_ram_mib: ``--cache-ram`` host-memory prompt cache across slots (MiB; 0 off).
        extra: more flags.
    """

    threads: int = 1
    slots: int = 4
    ctx_per_slot: int = 4096
    batch: int = 2048
    cache_prompt: bool = True
    cache_ram_mib: int = 1024
    extra: list[str] = field(default_factory=list)


def server_command(setup: LlamaCppSetup, port: int, cfg: LlamaServerConfig) -> list[str]:
    """The ``llama-server`` command line for ``setup`` on 127.0.0.1:``port``."""
    cmd = [
        str(setup.server),
        "-m", str(setup.model_gguf),
        "--mmproj", str(setup.mmproj_gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(cfg.threads),
        "-tb", str(cfg.threads),
        "-np", str(cfg.slots),
        "-c", str(cfg.slots * cfg.ctx_per_slot),
        "-b", str(cfg.batch),
        "-ub", str(cfg.batch),
        "-ctk", "f32",
        "-ctv", "f32",
        "--jinja",
        "--chat-template-file", str(setup.chat_template),
        "--no-warmup",
        "-a", setup.hf_dir.name,
    ]  # fmt: skip
    cmd += ["--cache-ram", str(cfg.cache_ram_mib if cfg.cache_prompt else 0)]
    if not cfg.cache_prompt:
        cmd += ["--no-cache-prompt"]
    return cmd + list(cfg.extra)


@contextmanager
def llama_server(
    setup: LlamaCppSetup, cfg: LlamaServerConfig, log_path: Path | None = None, timeout: float = 120
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``llama-server``; yields ``(base url, process)`` once ``/health`` answers 200."""
    from benchmarks.servers import free_port, stop_process, wait_healthy

    port = free_port()
    log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(
        server_command(setup, port, cfg), stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "LLAMA_MEDIA_MARKER": MEDIA_MARKER},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log)
        yield url, proc
    finally:
        stop_process(proc)
        log.close()


def props(url: str) -> dict:
    """``GET /props`` of a running llama-server (build info, slots, chat template)."""
    with urllib.request.urlopen(f"{url}/props", timeout=10) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    """Setup helpers: ``make-checkpoint OUT``, ``export-lm HF OUT``, ``vit-dir HF SURGERY OUT``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("make-checkpoint")
    a.add_argument("out", type=Path)
    a.add_argument("--size", default="small")
    a.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("export-lm")
    b.add_argument("hf_dir", type=Path)
    b.add_argument("out", type=Path)
    c = sub.add_parser("vit-dir")
    c.add_argument("hf_dir", type=Path)
    c.add_argument("surgery_dir", type=Path)
    c.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.cmd == "make-checkpoint":
        print(make_sp_checkpoint(args.out, args.size, args.seed))
    elif args.cmd == "export-lm":
        print(export_language_model(args.hf_dir, args.out))
    else:
        print(write_vit_dir(args.hf_dir, args.surgery_dir, args.out))
    print(f"{args.cmd}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
