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
from tests.helpers import OWN_FILE_FAMILIES, ROOT, SAMPLES, TINY_FAMILIES, png_bytes, split_mode

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
        "llava-next-video": "LlavaNextVideoForConditionalGeneration",
    }

    def __init__(self, family: str, root: Path) -> None:
        self.family, self.root = family, root

    @cached_property
    def model_dir(self) -> Path:
        return make_checkpoint(self.root / f"{self.family}-tiny", "tiny", family=self.family)

    @cached_property
    def loaded(self):
        return load_model(self.model_dir)

    def make_engine(self, **kw) -> Engine:
        """A fresh Engine on the shared model; ``kw`` are EngineConfig fields."""
        return Engine(EngineConfig(model_path=str(self.model_dir), **kw), model=self.loaded)

    @cached_property
    def ref(self):
        import transformers

        model_class = getattr(transformers, self.REFERENCE_CLASSES[self.family])
        model = model_class.from_pretrained(self.model_dir).eval()
        if self.family == "llava-onevision":
            from mmserve.model.families.llava_onevision import load_onevision_processor

            return model, load_onevision_processor(self.model_dir)
        if self.family == "llava-next-video":
            from mmserve.model.families.llava_next_video import load_next_video_processor

            return model, load_next_video_processor(self.model_dir)
        return model, transformers.AutoProcessor.from_pretrained(self.model_dir)


@pytest.fixture(scope="session")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyFamily]:
    """:class:`TinyFamily` by family name (``tests.helpers.TINY_FAMILIES`` and
    ``OWN_FILE_FAMILIES``; each built on first use)."""
    root = tmp_path_factory.mktemp("model")
    return {name: TinyFamily(name, root) for name in (*TINY_FAMILIES, *OWN_FILE_FAMILIES)}


@pytest.fixture(scope="session")
def model_dir(families: dict[str, TinyFamily]) -> Path:
    """The tiny LLaVA-1.5 checkpoint, built once per test session."""
    return families["llava"].model_dir


@pytest.fixture(scope="session")
def loaded(families: dict[str, TinyFamily]):
    """Our tiny LLaVA-1.5 model loaded once; engines share it (weights are read-only)."""
    return families["llava"].loaded


@pytest.fixture(scope="session")
def make_engine(families: dict[str, TinyFamily]):
    """Factory: ``make_engine(**EngineConfig fields)`` -> a fresh Engine on the tiny LLaVA-1.5."""
    return families["llava"].make_engine


@pytest.fixture(scope="session")
def ref_model(families: dict[str, TinyFamily]):
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


#: Tests left out of the inner loop (``python -m pytest -q -m "not slow"``; CI runs them):
#: a module (``"test_fuzz"``), a test or a test class (``"test_cli::test_serve_..."``,
#: ``"test_replicas::TestEncoders"``; every parametrization) -> why it is slow. Marked
#: here, in one place, by :func:`pytest_collection_modifyitems`; ``tests/test_habits.py``
#: checks that every entry names a test that exists.
SLOW_TESTS: dict[str, str] = {
    # servers in subprocesses, killed and restarted
    "test_batches_api::test_sigkill_mid_batch_resumes_without_running_a_line_twice": (
        "a server subprocess killed and restarted mid-batch"
    ),
    "test_chat_prompts::test_serve_shows_the_end_user_line": "a server subprocess",
    "test_hub_models::test_serve_by_hub_id_logs_where_from": "a server subprocess",
    "test_hub_models::test_make_model_hub_cache": "make-model in a subprocess",
    "test_engine_process::test_engine_process_killed_mid_stream_restarts": (
        "a server subprocess whose engine process is killed and started again"
    ),
    "test_engine_process::test_engine_process_killed_idle_without_restarts_left_exits_nonzero": (
        "a server subprocess whose engine process is killed"
    ),
    "test_engine_process::test_api_process_killed_the_engine_process_exits": (
        "a server subprocess killed"
    ),
    "test_engine_process::test_batch_job_resumes_after_an_engine_restart": (
        "a server subprocess running a batch while its engine process is killed and restarted"
    ),
    "test_engine_process_faults": "starts an engine process per test (model load, warm-up)",
    "test_engine_process_features::test_a_repeated_image_crosses_by_key_and_answers_the_same": (
        "an engine process (model load) and image requests against the in-process answers"
    ),
    "test_engine_process_features::test_a_video_asked_again_sends_its_frames_by_key": (
        "video questions to an engine process, asked twice"
    ),
    "test_engine_process_features::test_a_key_the_engine_dropped_still_answers_correctly": (
        "image requests to an engine process, a flush and a resend with pixels"
    ),
    "test_engine_process::test_split_server_gives_the_in_process_tokens": (
        "an engine process loads the model; every answer twice"
    ),
    "test_cli::test_serve_logs_its_choices_by_default": "a server subprocess",
    "test_concurrency": "32 clients against a live server",
    "test_streams::test_idle_streams_expire_and_release": (
        "waits out a 3 s stream idle expiry (an app of its own)"
    ),
    "test_streams::test_a_stream_belongs_to_its_tenant": "an app of its own (--api-keys)",
    "test_streams::test_a_hold_lost_with_the_engine_process_is_reported_and_prefilled_again": (
        "a server subprocess whose engine process is killed and restarted"
    ),
    "test_fuzz": "hypothesis inputs against a live server",
    "test_graceful_shutdown": "a server subprocess stopped by SIGTERM mid-stream",
    "test_kv_tiers::test_server_restart_answers_from_disk": "two server subprocesses in turn",
    "test_server_e2e": "the sample client against a server subprocess",
    "test_tracing::test_off_by_default_imports_no_opentelemetry_sdk": (
        "a fresh interpreter imports the whole server"
    ),
    # every documented example against a live server (~3 min each)
    "test_doc_examples::test_documented_examples_run_against_a_live_server": (
        "runs every documented example against a live server"
    ),
    "test_doc_examples::test_a_broken_copy_of_the_api_reference_fails": (
        "runs the API reference's examples again, on a broken copy"
    ),
    # Ray Serve replicas (the router, prefix tree and flags stay in the inner loop)
    "test_replicas::TestRoundRobin": "a Ray Serve fleet",
    "test_replicas::TestCacheRouter": "a Ray Serve fleet",
    "test_replicas::TestEncoders": "a Ray Serve fleet with encoders",
    "test_replicas::TestDeterministicBf16": "a Ray Serve fleet and a server in bf16",
    (
        "test_replicas::test_a_sigkill_of_the_whole_process_mid_batch_"
        "resumes_without_rerunning_lines"
    ): "a Ray Serve server killed and restarted mid-batch",
    # tensor-parallel process groups (the layout and one tp=2 equality stay)
    "test_tensor_parallel::test_server_tp2_answers_then_a_dead_rank_ends_it_cleanly": (
        "a tp=2 server subprocess"
    ),
    "test_tensor_parallel::test_tp2_equals_tp1_per_family": "a tp=2 group per family",
    "test_tensor_parallel::test_tp2_cache_on_equals_cache_off": "two tp=2 groups",
    "test_int4::test_tp2_equals_tp1_int4": "a tp=2 group on an int4 checkpoint",
    "test_deterministic::test_tp2_equals_tp1_bit_for_bit_cached_chunked_and_batched": (
        "a tp=2 group in bf16"
    ),
    "test_tensor_parallel::test_workers_exit_when_rank_0_is_killed": "a tp=2 group killed",
    "test_tensor_parallel::test_a_hung_worker_times_out_and_is_killed": "waits out a timeout",
    # long runs of the engine or the tokenizer
    "test_engine_core::test_per_step_work_does_not_grow_with_the_answer": (
        "1,600-token answers, one per page size"
    ),
    "test_kv_tiers::test_fp8_pages_round_trip_through_a_tier": (
        "fp8 pages of 576-token images through each tier (~1 min per tier on the CPU)"
    ),
    "test_detokenizer::test_stop_strings_match_one_shot_cut": "hypothesis over the tokenizers",
    "test_detokenizer::test_incremental_text_equals_one_shot_decode": (
        "hypothesis over the tokenizers"
    ),
    # clients hanging up on a real socket, eight 2400x2400 pictures per request
    "test_disconnect::test_hang_up_while_pictures_are_prepared_stops_the_work": (
        "eight hang-ups, each with eight large pictures to prepare (~3 s each)"
    ),
    "test_disconnect::test_hang_up_mid_prefill_aborts_before_the_next_step": (
        "two requests prefilled in 64-token chunks until the hang-up (~10 s)"
    ),
    "test_quant_loading::test_int8_load_peaks_at_most_where_bf16_does": (
        "two fresh interpreters each load a 135 MB checkpoint (~30 s on two cores)"
    ),
    # benchmarks and installs
    "test_benchmarks::test_tracing_benchmark_tiny": "server subprocesses with and without tracing",
    "test_benchmarks::test_image_repeat_benchmark_tiny": "a server subprocess and its engine",
    "test_benchmarks::test_engine_process_benchmark_tiny": (
        "two server subprocesses (one with its engine process)"
    ),
    "test_benchmarks::test_batch_api_benchmark_tiny": "a server subprocess under load",
    "test_benchmarks::test_spec_benchmark_tiny": "six engines on two models, timed rounds",
    "test_benchmarks::test_determinism_benchmark_tiny": "twelve engines on two models in bf16",
    "test_spec_decode::test_greedy_output_and_logprobs_equal_without_speculation": (
        "two models x five engines per family, each run twice"
    ),
    "test_benchmarks::test_host_benchmark_tiny": "a server subprocess against the engine alone",
    "test_benchmarks::test_conversation_benchmark_tiny": "a server subprocess, cache flushes",
    "test_benchmarks::test_live_video_benchmark_tiny": (
        "two server subprocesses, a stream fed in real time for the frames/s ramp"
    ),
    "test_kv_fp8::test_kv_fp8_benchmark_tiny": "a benchmark run",
    "test_checkpoint::test_make_model_choices_come_from_the_registry_when_used": (
        "command-line subprocesses writing checkpoints"
    ),
    "test_gpu_bundle::test_gpu_check_installs_the_bundle_offline": (
        "pip installs the bundle into a fresh virtual environment"
    ),
    "test_kernel_warmup::test_prebuild_runs_each_distinct_module_once_in_worker_processes": (
        "the prebuild command line, twice, with spawned worker processes"
    ),
    "test_gpu_bundle::test_real_bundle_imports_flashinfer_without_a_gpu": (
        "downloads the real bundle (~22 MiB) and imports flashinfer from it"
    ),
    # a browser
    "test_web_page": "drives Chromium against a live server",
}


@pytest.fixture(scope="session")
def slow_tests() -> dict[str, str]:
    """:data:`SLOW_TESTS` (for the test that checks its entries)."""
    return SLOW_TESTS


def _slow_keys(item: pytest.Item) -> list[str]:
    """The :data:`SLOW_TESTS` keys that would cover ``item``: its module, then each of
    its classes and its function (parametrization dropped)."""
    module = item.path.stem
    parts = item.nodeid.split("::")[1:]
    parts[-1] = parts[-1].split("[")[0]
    return [module] + [f"{module}::{'::'.join(parts[: i + 1])}" for i in range(len(parts))]


#: Tests that reach into the in-process engine's objects on purpose (patch its runner,
#: read its pool or tree), keyed as :data:`SLOW_TESTS` -> why. Marked
#: ``in_process_engine``; the process-split run (``MMSERVE_TEST_ENGINE_PROCESS=1``,
#: ``.ci/run``) deselects them (they run in the ordinary run), never skips them.
IN_PROCESS_ENGINE_TESTS: dict[str, str] = {
    "test_fault_containment::test_a_failing_batch_fails_only_its_requests": (
        "poisons the in-process engine's model; an engine process loads its own"
    ),
    "test_fault_containment::test_three_failed_steps_in_a_row_turn_health_503": (
        "poisons the in-process engine's model; an engine process loads its own"
    ),
    "test_fault_containment::test_a_failure_while_sampling_fails_only_that_request": (
        "poisons the in-process engine's sampler; an engine process has its own"
    ),
    "test_kernel_warmup::test_health_is_not_ok_until_the_warm_up_is_done": (
        "holds the in-process engine thread's warm-up with a hook in this process"
    ),
    "test_spec_decode::test_api_answers_equal_and_metrics_report_speculation": (
        "serves quoting weights set on this process's model; an engine process loads the "
        "checkpoint's random weights, which never quote"
    ),
}


@pytest.fixture(scope="session")
def in_process_engine_tests() -> dict[str, str]:
    """:data:`IN_PROCESS_ENGINE_TESTS` (for the test that checks its entries)."""
    return IN_PROCESS_ENGINE_TESTS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`SLOW_TESTS` ``slow`` and those of
    :data:`IN_PROCESS_ENGINE_TESTS` ``in_process_engine``; in the process-split run
    deselect the latter."""
    deselected = []
    for item in items:
        keys = _slow_keys(item)
        if any(key in SLOW_TESTS for key in keys):
            item.add_marker(pytest.mark.slow)
        if any(key in IN_PROCESS_ENGINE_TESTS for key in keys):
            item.add_marker(pytest.mark.in_process_engine)
            deselected.append(item)
    if deselected and split_mode():
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if i.get_closest_marker("in_process_engine") is None]


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
    """Register :class:`SkipGuard` when ``MMSERVE_FAIL_ON_SKIP=1``; with
    ``MMSERVE_TEST_ENGINE_PROCESS=1`` every app the tests build serves from an engine
    process (before the test modules import ``create_app``)."""
    if os.environ.get("MMSERVE_FAIL_ON_SKIP") == "1":
        config.pluginmanager.register(SkipGuard(config.rootpath), "mmserve-skip-guard")
    if split_mode():
        import api.app
        from tests import live_server

        api.app.create_app = live_server.split_create_app  # type: ignore[assignment]
