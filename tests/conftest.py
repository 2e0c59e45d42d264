"""Shared fixtures: the tiny checkpoint (built once), a loaded model, engines, images."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmserve.config import EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import load_model
from mmserve.model.make_checkpoint import make_checkpoint
from tests.cases import write_cases

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples" / "images"
GPU_TESTS = ROOT / "tests" / "gpu"

# Two cores shared by a server and the tests: OpenMP spinning across processes
# makes small attention calls 100x slower, so the tests use one thread each.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, built once per test session."""
    return make_checkpoint(tmp_path_factory.mktemp("model") / "llava-tiny", "tiny")


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small LLaVA-1.5 checkpoint (8 query heads, 2 K/V heads), built once per session."""
    return make_checkpoint(tmp_path_factory.mktemp("model") / "llava-small", "small")


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
def next_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA-NeXT checkpoint (112-px tiles), built once per test session."""
    out = tmp_path_factory.mktemp("model") / "llava-next-tiny"
    return make_checkpoint(out, "tiny", family="llava-next")


@pytest.fixture(scope="session")
def next_loaded(next_model_dir: Path):  # noqa: ANN201
    """Our LLaVA-NeXT model loaded once."""
    return load_model(next_model_dir)


@pytest.fixture(scope="session")
def make_next_engine(next_loaded, next_model_dir):  # noqa: ANN001, ANN201
    """Factory: ``make_next_engine(**EngineConfig fields)`` -> an Engine on the NeXT model."""

    def make(**kw) -> Engine:
        return Engine(EngineConfig(model_path=str(next_model_dir), **kw), model=next_loaded)

    return make


@pytest.fixture(scope="session")
def next_ref_model(next_model_dir: Path):  # noqa: ANN201
    """transformers' LlavaNextForConditionalGeneration and processor on the NeXT checkpoint."""
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    model = LlavaNextForConditionalGeneration.from_pretrained(next_model_dir).eval()
    return model, AutoProcessor.from_pretrained(next_model_dir)


@pytest.fixture(scope="session")
def ov_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA-OneVision checkpoint (98-px tiles, Qwen2), built once per session."""
    out = tmp_path_factory.mktemp("model") / "llava-onevision-tiny"
    return make_checkpoint(out, "tiny", family="llava-onevision")


@pytest.fixture(scope="session")
def ov_loaded(ov_model_dir: Path):  # noqa: ANN201
    """Our LLaVA-OneVision model loaded once."""
    return load_model(ov_model_dir)


@pytest.fixture(scope="session")
def make_ov_engine(ov_loaded, ov_model_dir):  # noqa: ANN001, ANN201
    """Factory: ``make_ov_engine(**EngineConfig fields)`` -> an Engine on the OneVision model."""

    def make(**kw) -> Engine:
        return Engine(EngineConfig(model_path=str(ov_model_dir), **kw), model=ov_loaded)

    return make


@pytest.fixture(scope="session")
def ov_ref_model(ov_model_dir: Path):  # noqa: ANN201
    """transformers' LlavaOnevisionForConditionalGeneration and its processor (without
    torchvision: transformers' processor class holding the tokenizer and PIL image
    processor) on the OneVision checkpoint."""
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmserve.model.families.llava_onevision import load_onevision_processor

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(ov_model_dir).eval()
    return model, load_onevision_processor(ov_model_dir)


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """Encoded bytes of the sample photographs, by file name."""
    return {p.name: p.read_bytes() for p in sorted(SAMPLES.iterdir()) if p.suffix != ".md"}


@pytest.fixture(scope="session")
def cases_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The odd and broken input files of ``tests/cases.py``, written into a temporary folder."""
    return write_cases(tmp_path_factory.mktemp("cases"))


class SkipGuard:
    """Plugin for ``MMSERVE_FAIL_ON_SKIP=1`` (set by ``.ci/run``): any test or module skipped
    outside ``tests/gpu`` fails the run, and the summary lists them."""

    def __init__(self, rootpath: Path) -> None:
        self.rootpath = rootpath
        self.skips: list[str] = []

    def note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        """Remember ``report`` if it is a skip (not an xfail) outside ``tests/gpu``."""
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        path = (self.rootpath / report.nodeid.split("::")[0]).resolve()
        if path.is_relative_to(GPU_TESTS):
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        self.skips.append(f"{report.nodeid}: {reason}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module skipped while collecting (``importorskip`` at its top)."""
        self.note(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A test skipped in setup or in its body."""
        self.note(report)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """List the skips that fail the run."""
        if self.skips:
            terminalreporter.section("skipped outside tests/gpu (MMSERVE_FAIL_ON_SKIP=1)", red=True)
            for line in self.skips:
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Turn an otherwise passing run with such skips into a failing one."""
        if self.skips and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    """Register :class:`SkipGuard` when ``MMSERVE_FAIL_ON_SKIP=1``."""
    if os.environ.get("MMSERVE_FAIL_ON_SKIP") == "1":
        config.pluginmanager.register(SkipGuard(config.rootpath), "mmserve-skip-guard")


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


# ---- engine workloads shared by cache and scheduling tests ----------------------
QUESTIONS = ["What is this?", "What colour is it?", "Is it indoors or outdoors?"]


def workload(imgs):  # noqa: ANN001, ANN201
    """Requests that share images, a system prompt and a chat history."""
    system = {"role": "system", "content": "You are a careful visual assistant."}
    out = []
    for k, img in enumerate(imgs[:3]):
        for q in QUESTIONS[: 3 - k]:
            out.append(([system, *user(None, q)], [img]))
    history = user(None, "What is this?") + [
        {"role": "assistant", "content": "A photo."},
        {"role": "user", "content": "Tell me more."},
    ]
    out.append((history, imgs[:1]))
    out.append((user("No image here, just text."), []))
    return out


def run(make_engine, cases, max_tokens: int = 6, **cfg):  # noqa: ANN001, ANN201
    eng = make_engine(**cfg)
    reqs = [
        eng.processor.make_request(messages=m, images=i, params=greedy(max_tokens))
        for m, i in cases
    ]
    res = eng.generate(reqs)
    eng.scheduler.check_accounting()
    return eng, res


# ---- HTTP helpers for TestClient apps serving the tiny model as "llava-tiny" ----
MODEL = "llava-tiny"


def chat(client, content, **kw):  # noqa: ANN001, ANN201
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
        **kw,
    }
    return client.post("/v1/chat/completions", json=body)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def upload(client, data: bytes, name: str = "x.png"):  # noqa: ANN001, ANN201
    return client.post("/v1/images", files={"file": (name, data, "application/octet-stream")})


def assert_healthy(client) -> None:  # noqa: ANN001
    """A normal request is answered and the pool accounting holds at rest."""
    r = chat(client, "Say hello.")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    stats = client.get("/v1/cache/stats").json()
    assert stats["running_requests"] == 0 and stats["live_requests"] == 0
    acc = stats["accounting"]
    assert acc["ok"] and acc["running"] == 0, acc
    assert acc["free"] + acc["tree"] == acc["total"] == stats["pool_pages"]


def assert_error(r, status: int, words: str, code: str | None = None) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


@contextmanager
def tp_engine(model_dir: Path, tp: int = 2, **kw) -> Iterator[Engine]:
    """An Engine whose decoder runs on ``tp`` ranks (gloo on 127.0.0.1); its worker
    processes are stopped afterwards, whatever the test did."""
    eng = Engine(EngineConfig(model_path=str(model_dir), tp=tp, **kw))
    try:
        yield eng
    finally:
        eng.close()
