"""Shared fixtures: the tiny checkpoints (built once), loaded models, engines, images.

Fixtures only: tests import nothing from here (their helpers are in ``tests/helpers.py``).
"""

from __future__ import annotations

import io
import os
from functools import cached_property
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model.loader import load_model
from mmserve.testing.checkpoints import make_checkpoint
from tests.cases import write_cases
from tests.helpers import ROOT, SAMPLES, TINY_FAMILIES, png_bytes

GPU_TESTS = ROOT / "tests" / "gpu"

# Two cores shared by a server and the tests: OpenMP spinning across processes
# makes small attention calls 100x slower, so the tests use one thread each.
torch.set_num_threads(1)


class TinyFamily:
    """One model family's tiny checkpoint and what the tests build on it, each made on
    first use and kept for the session: ``model_dir`` (``make_checkpoint(..., "tiny")``),
    ``loaded`` (our model; engines share it, the weights are read-only), ``ref``
    (transformers' model and processor) and :meth:`make_engine`."""

    #: family -> transformers' model class (the processor is ``AutoProcessor``'s, except
    #: OneVision's: transformers' processor class without torchvision)
    REFERENCE_CLASSES = {
        "llava": "LlavaForConditionalGeneration",
        "llava-next": "LlavaNextForConditionalGeneration",
        "llava-onevision": "LlavaOnevisionForConditionalGeneration",
    }

    def __init__(self, family: str, root: Path) -> None:
        self.family, self.root = family, root

    @cached_property
    def model_dir(self) -> Path:
        return make_checkpoint(self.root / f"{self.family}-tiny", "tiny", family=self.family)

    @cached_property
    def loaded(self):  # noqa: ANN201
        return load_model(self.model_dir)

    def make_engine(self, **kw) -> Engine:
        """A fresh Engine on the shared model; ``kw`` are EngineConfig fields."""
        return Engine(EngineConfig(model_path=str(self.model_dir), **kw), model=self.loaded)

    @cached_property
    def ref(self):  # noqa: ANN201
        import transformers

        model_class = getattr(transformers, self.REFERENCE_CLASSES[self.family])
        model = model_class.from_pretrained(self.model_dir).eval()
        if self.family == "llava-onevision":
            from mmserve.model.families.llava_onevision import load_onevision_processor

            return model, load_onevision_processor(self.model_dir)
        return model, transformers.AutoProcessor.from_pretrained(self.model_dir)


@pytest.fixture(scope="session")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyFamily]:
    """:class:`TinyFamily` by family name (``tests.helpers.TINY_FAMILIES``)."""
    root = tmp_path_factory.mktemp("model")
    return {name: TinyFamily(name, root) for name in TINY_FAMILIES}


@pytest.fixture(scope="session")
def model_dir(families: dict[str, TinyFamily]) -> Path:
    """The tiny LLaVA-1.5 checkpoint, built once per test session."""
    return families["llava"].model_dir


@pytest.fixture(scope="session")
def loaded(families: dict[str, TinyFamily]):  # noqa: ANN201
    """Our tiny LLaVA-1.5 model loaded once; engines share it (weights are read-only)."""
    return families["llava"].loaded


@pytest.fixture(scope="session")
def make_engine(families: dict[str, TinyFamily]):  # noqa: ANN201
    """Factory: ``make_engine(**EngineConfig fields)`` -> a fresh Engine on the tiny LLaVA-1.5."""
    return families["llava"].make_engine


@pytest.fixture(scope="session")
def ref_model(families: dict[str, TinyFamily]):  # noqa: ANN201
    """transformers' LlavaForConditionalGeneration and processor on the tiny LLaVA-1.5."""
    return families["llava"].ref


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small LLaVA-1.5 checkpoint (8 query heads, 2 K/V heads), built once per session."""
    return make_checkpoint(tmp_path_factory.mktemp("model") / "llava-small", "small")


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """Encoded bytes of the sample photographs, by file name."""
    return {p.name: p.read_bytes() for p in sorted(SAMPLES.iterdir()) if p.suffix != ".md"}


@pytest.fixture(scope="session")
def shapes(photos: dict[str, bytes]) -> dict[str, bytes]:
    """PNGs of one photo in three aspect ratios ("square", "wide", "tall": three tile
    grids) and a "large" one (400 x 380: past OneVision's "anyres_max_9")."""
    im = Image.open(io.BytesIO(photos["astronaut.png"])).convert("RGB")
    sizes = {"square": (200, 190), "wide": (260, 130), "tall": (90, 270), "large": (400, 380)}
    return {name: png_bytes(im.resize(size)) for name, size in sizes.items()}


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
