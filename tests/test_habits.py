"""The inner-loop subset: the ``slow`` marker is registered, and ``tests/conftest.py``'s
table of slow tests names only tests that exist (so it cannot rot when tests are renamed,
moved or deleted), and marks exactly those."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT


def _test_modules() -> dict[str, Path]:
    """Test module basename -> path, ``tests/`` and ``tests/gpu/``."""
    paths = [*(ROOT / "tests").glob("test_*.py"), *(ROOT / "tests" / "gpu").glob("test_*.py")]
    return {p.stem: p for p in paths}


def _test_names(path: Path) -> set[str]:
    """``name``, ``Class`` and ``Class::name`` of every test function and class in ``path``."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names.add(node.name)
            names |= {
                f"{node.name}::{f.name}"
                for f in node.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                and f.name.startswith("test")
            }
    return names


def test_the_slow_marker_is_registered(pytestconfig: pytest.Config) -> None:
    markers = pytestconfig.getini("markers")
    assert any(line.startswith("slow:") for line in markers), markers


def test_the_slow_table_names_only_tests_that_exist(slow_tests: dict[str, str]) -> None:
    modules = _test_modules()
    assert len(modules) > 50 and "test_habits" in modules
    gone = _missing_tests(slow_tests)
    assert not gone, f"SLOW_TESTS names tests that do not exist: {gone}"
    # at least a module, a function and a class are in the table: each kind of key is checked
    assert any("::" not in k for k in slow_tests)
    assert any(k.count("::") == 1 and "::Test" in k for k in slow_tests)
    assert any(k.count("::") == 1 and "::test" in k for k in slow_tests)


def test_the_in_process_engine_table_names_only_tests_that_exist(
    in_process_engine_tests: dict[str, str],
) -> None:
    gone = _missing_tests(in_process_engine_tests)
    assert not gone, f"IN_PROCESS_ENGINE_TESTS names tests that do not exist: {gone}"


def _missing_tests(table: dict[str, str]) -> list[str]:
    """The keys of ``table`` (``module`` or ``module::name``, each with a reason) that name
    no test module or test; asserts every key gives a reason."""
    modules = _test_modules()
    gone = []
    for key, reason in table.items():
        module, _, name = key.partition("::")
        assert reason.strip(), f"{key}: no reason given"
        if module not in modules or (name and name not in _test_names(modules[module])):
            gone.append(key)
    return gone


def test_slow_marks_exactly_the_tabled_tests(
    request: pytest.FixtureRequest, slow_tests: dict[str, str]
) -> None:
    # the items of this session (the whole suite, or the files asked for): an item is slow
    # when its module, or its class or function ("Class::" / "name" prefix), is tabled
    for item in request.session.items:
        module = item.path.stem
        test = item.nodeid.split("[")[0].split("::", 1)[1] + "::"  # "Class::name::", "name::"
        tabled = False
        for key in slow_tests:
            key_module, _, name = key.partition("::")
            tabled |= key_module == module and (not name or test.startswith(name + "::"))
        assert (item.get_closest_marker("slow") is not None) == tabled, item.nodeid
    assert request.node.get_closest_marker("slow") is None


#: Files that build an app but stay out of the process-split run, and why.
NOT_SPLIT = {
    "test_engine_process.py": "tests the split itself (both modes, by hand)",
    "test_engine_process_faults.py": "tests the split itself (engine process faults)",
    "test_engine_process_features.py": "tests the split itself (feature keys across it)",
}


def test_every_api_test_file_runs_against_the_process_split_server() -> None:
    """A test file that builds an app (``create_app``, ``app_client``, ``TestClient``) is
    in ``.ci/run``'s process-split run, unless :data:`NOT_SPLIT` says why not."""
    import re

    ci = (ROOT / ".ci" / "run").read_text()
    command = ci[ci.index("MMSERVE_TEST_ENGINE_PROCESS=1 python -m pytest") :]
    command = command[: command.index("\n\n")] if "\n\n" in command else command
    split = set(re.findall(r"tests/(test_\w+\.py)", command))
    builds = re.compile(r"create_app\(|app_client\(|TestClient\(")
    api = {
        path.name for path in (ROOT / "tests").glob("test_*.py") if builds.search(path.read_text())
    }
    missing = sorted(api - split - set(NOT_SPLIT))
    assert not missing, f"add {missing} to .ci/run's process-split run"
    assert not (set(NOT_SPLIT) - api), "NOT_SPLIT names a file that builds no app"
    assert not (set(NOT_SPLIT) & split)
