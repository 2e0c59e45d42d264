"""Shared fixtures: the tiny checkpoint (built once), a loaded model, engines, images."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import load_model
from mmserve.model.make_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples" / "images"
SHARED_CASES = ROOT.parent / "shared" / "cases"

# Two cores shared by a server and the tests: OpenMP spinning across processes
# makes small attention calls 100x slower, so the tests use one thread each.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, built once per test session."""
    return make_checkpoint(tmp_path_factory.mktemp("model") / "llava-tiny", "tiny")


@pytest.fixture(scope="session")
def loaded(model_dir: Path):  # noqa: ANN201
    """Our model loaded once; engines share it (weights are read-only)."""
    return load_model(model_dir)


@pytest.fixture(scope="session")
def make_engine(loaded, model_dir):  # noqa: ANN001, ANN201
    """Factory: ``make_engine(**EngineConfig fields)`` -> a fresh Engine on the shared model."""

    def make(**kw) -> Engine:
        return Engine(EngineConfig(model_path=str(model_dir), **kw), model=loaded)

    return make


@pytest.fixture(scope="session")
def ref_model(model_dir: Path):  # noqa: ANN201
    """transformers' LlavaForConditionalGeneration and processor on the same checkpoint."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """Encoded bytes of the sample photographs, by file name."""
    return {p.name: p.read_bytes() for p in sorted(SAMPLES.iterdir()) if p.suffix != ".md"}


@pytest.fixture(scope="session")
def cases_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared bad-input cases, generated into a temporary folder."""
    script = SHARED_CASES / "make_cases.py"
    if not script.exists():
        pytest.skip(f"shared cases not found at {script}")
    out = tmp_path_factory.mktemp("cases")
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    return out


def png_bytes(im: Image.Image, fmt: str = "PNG") -> bytes:
    """Encode a PIL image."""
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    """Greedy sampling params that keep logits for the comparator."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, return_logits=True, **kw)


def user(*parts: str | None) -> list[dict]:
    """One user message: ``None`` parts are images, strings are text."""
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]
