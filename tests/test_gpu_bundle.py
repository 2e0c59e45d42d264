"""The offline GPU-check bundle, checked on CPU with no network.

``scripts/gpu_bundle.txt`` pins the wheels that ``scripts/gpu_bundle.sh`` downloads and
``scripts/gpu_check.sh`` installs offline on a GPU machine, and lists what that
machine's image already has. These tests check that

* every third-party package imported by what ``gpu_check.sh`` runs (``tests/gpu``, the
  FlashInfer backend, ``tests/test_reference.py``, the many-questions benchmark, and
  every project module they import, found with ``ast``) is on a line of the list;
* both scripts take their packages from that list (run with a stand-in Python);
* ``gpu_check.sh``'s offline install and environment report work end to end, on a
  bundle of small stand-in wheels with the same names and versions;
* the bundle, its install target and the check's output are git-ignored.
"""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "scripts" / "gpu_bundle.txt"
BUNDLE_SH = ROOT / "scripts" / "gpu_bundle.sh"
CHECK_SH = ROOT / "scripts" / "gpu_check.sh"
LOCAL_PACKAGES = {"mmserve", "api", "tests", "benchmarks"}

#: What gpu_check.sh runs: the modules whose imports must all be there on the GPU machine.
GPU_CHECK_ROOTS = [
    *sorted((ROOT / "tests" / "gpu").glob("*.py")),
    ROOT / "tests" / "conftest.py",
    ROOT / "tests" / "test_reference.py",
    ROOT / "benchmarks" / "in_process.py",
    ROOT / "benchmarks" / "graph_decode.py",
    ROOT / "benchmarks" / "spec.py",
    ROOT / "mmserve" / "kernels" / "flashinfer_backend.py",
    ROOT / "mmserve" / "kernels" / "select.py",
    ROOT / "mmserve" / "kernels" / "warmup.py",
]
_VIDEOS_ONLY = "only requests with videos (the front end decodes them)"
#: Imports inside functions that the GPU check never calls: (file, package) -> why.
NOT_ON_THE_GPU_PATH = {
    ("tests/cases.py", "av"): "only the cases_dir fixture, which tests/gpu does not use",
    ("mmserve/structured/spec.py", "xgrammar"): "only requests with structured output",
    ("mmserve/vision/video/decode.py", "av"): _VIDEOS_ONLY,
    ("mmserve/vision/video/orientation.py", "av"): _VIDEOS_ONLY,
    ("mmserve/vision/video/probe.py", "av"): _VIDEOS_ONLY,
    ("mmserve/testing/tokenizer.py", "sentencepiece"): "only --family llava-next",
    ("tests/helpers.py", "hypothesis"): "only page_layout, which tests/gpu does not use",
    ("tests/helpers.py", "starlette"): "only websocket_refusal, which tests/gpu does not use",
    ("tests/conftest.py", "tests.live_server"): (
        "only with MMSERVE_TEST_ENGINE_PROCESS=1 (the process-split API run), never set by "
        "the GPU check"
    ),
    ("tests/conftest.py", "api"): "likewise: the split run's create_app",
}


def read_list() -> tuple[dict[str, tuple[str, list[str]]], dict[str, list[str]]]:
    """``(wheels, image)``: ``{dist: (version, imports)}`` and ``{dist: imports}``."""
    wheels: dict[str, tuple[str, list[str]]] = {}
    image: dict[str, list[str]] = {}
    for n, line in enumerate(LIST.read_text().splitlines(), 1):
        fields = line.split("#")[0].split()
        if not fields:
            continue
        kind, dist, imports = fields[0], fields[1], fields[2:]
        assert imports, f"gpu_bundle.txt:{n}: no import names"
        if kind == "wheel":
            name, sep, version = dist.partition("==")
            assert sep and re.fullmatch(r"[\w.+!-]+", version), f"gpu_bundle.txt:{n}: not pinned"
            assert name.lower() not in wheels, f"gpu_bundle.txt:{n}: {name} twice"
            wheels[name.lower()] = (version, imports)
        else:
            assert kind == "image", f"gpu_bundle.txt:{n}: kind {kind!r} is not wheel or image"
            assert "=" not in dist, f"gpu_bundle.txt:{n}: the image's versions are not ours to pin"
            image[dist.lower()] = imports
    return wheels, image


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported anywhere in ``path`` (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts if rel.name == "__init__" else rel.parts[:-1])
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for sub in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package[: len(package) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def third_party_imports(roots: list[Path]) -> dict[str, list[str]]:
    """Top-level third-party packages imported by ``roots`` and the project modules they
    import, transitively: ``{package: ["file:line", ...]}``."""
    seen: set[Path] = set()
    todo = list(roots)
    found: dict[str, list[str]] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        rel = path.relative_to(ROOT).as_posix()
        for module, line in _imports(path):
            top = module.split(".")[0]
            if top in LOCAL_PACKAGES:
                if any(
                    module == m or module.startswith(m + ".")
                    for f, m in NOT_ON_THE_GPU_PATH
                    if f == rel
                ):
                    continue  # a project import in code the GPU check never runs
                parts = module.split(".")
                for i in range(1, len(parts) + 1):  # the packages' __init__ files run too
                    if (file := _module_file(".".join(parts[:i]))) is not None:
                        todo.append(file)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                if (rel, top) not in NOT_ON_THE_GPU_PATH:
                    found.setdefault(top, []).append(f"{rel}:{line}")
    return found


def test_list_pins_every_wheel_and_names_flashinfer() -> None:
    wheels, image = read_list()
    assert "flashinfer-python" in wheels
    assert {"torch", "transformers"} <= set(image)
    provided = [m for _, mods in wheels.values() for m in mods] + [
        m for mods in image.values() for m in mods
    ]
    assert len(provided) == len(set(provided)), "an import name is on two lines"
    assert not set(wheels) & set(image), "a package is both bundled and in the image"


def test_everything_the_gpu_check_imports_is_bundled_or_in_the_image() -> None:
    wheels, image = read_list()
    bundled = {m for _, mods in wheels.values() for m in mods}
    in_image = {m for mods in image.values() for m in mods}
    found = third_party_imports(GPU_CHECK_ROOTS)
    assert {"flashinfer", "torch", "transformers", "pytest"} <= set(found)  # the scan works
    missing = {pkg: where for pkg, where in found.items() if pkg not in bundled | in_image}
    assert not missing, (
        f"imported by what scripts/gpu_check.sh runs, but neither a `wheel` nor an `image` "
        f"line of scripts/gpu_bundle.txt: {missing}"
    )
    # the GPU image has no fastapi, pydantic or decord: the GPU check must not need them
    assert not {"fastapi", "pydantic", "decord", "uvicorn"} & set(found)


def test_roots_are_what_gpu_check_runs() -> None:
    script = CHECK_SH.read_text()
    targets = ("tests/gpu", "tests/test_reference.py", "in_process.cache_on_off", "kernels.warmup")
    targets += ("benchmarks.graph_decode", "benchmarks.spec")
    for target in targets:
        assert target in script


def _stand_in_python(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that records its arguments and fails, in place of Python."""
    record = tmp_path / "args.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {record}\nexit 3\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake, record


def test_bundle_script_downloads_exactly_the_list(tmp_path: Path) -> None:
    wheels, _ = read_list()
    fake, record = _stand_in_python(tmp_path)
    env = {**os.environ, "PYTHON": str(fake), "GPU_BUNDLE": str(tmp_path / "bundle")}
    proc = subprocess.run(
        ["bash", str(BUNDLE_SH)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr  # stopped by the stand-in's pip download
    args = record.read_text().split()
    assert args[:3] == ["-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:", "--implementation", "--abi"):
        assert flag in args
    assert args[args.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in args
    pins = [a for a in args if "==" in a]
    assert pins == [f"{name}=={version}" for name, (version, _) in wheels.items()]
    assert not (tmp_path / "bundle").exists()
    assert not re.search(r"==\d", BUNDLE_SH.read_text()), "versions belong in gpu_bundle.txt"


def _stand_in_wheel(folder: Path, dist: str, version: str, imports: list[str]) -> None:
    """A small wheel with ``dist``'s name and version; ``ninja`` gets an executable script."""
    stem = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as z:
        for module in imports:
            z.writestr(f"{module}/__init__.py", f'__version__ = "{version}"\n')
        if dist == "ninja":
            info = zipfile.ZipInfo(f"{stem}.data/scripts/ninja")
            info.external_attr = (stat.S_IFREG | 0o755) << 16
            z.writestr(info, "#!/bin/sh\necho 1.13.2\n")
        z.writestr(
            f"{stem}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        )
        z.writestr(
            f"{stem}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{stem}.dist-info/RECORD", "")


def test_gpu_check_installs_the_bundle_offline(tmp_path: Path) -> None:
    """gpu_check.sh's install + environment phases (GPU_CHECK_ONLY=setup) on stand-in wheels."""
    wheels, _ = read_list()
    bundle, site, out = tmp_path / "bundle", tmp_path / "site", tmp_path / "out"
    bundle.mkdir()
    for dist, (version, imports) in wheels.items():
        _stand_in_wheel(bundle, dist, version, imports)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_BUNDLE": str(bundle),
        "GPU_SITE": str(site),
        "GPU_CHECK_ONLY": "setup",
        "PIP_NO_INDEX": "1",
    }
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(CHECK_SH), str(out)], env=env, capture_output=True, text=True, timeout=240
    )
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["mode"] == "setup"
    assert [(p["name"], p["status"]) for p in summary["phases"]] == [
        ("install (offline)", "ok"),
        ("environment", "ok"),
    ]
    versions = summary["versions"]
    assert versions["flashinfer-python"] == wheels["flashinfer-python"][0]
    assert versions["flashinfer_file"].startswith(str(site))
    assert versions["ninja"] == str(site / "bin" / "ninja")
    assert versions["auto_backend_cuda_bf16"] == "torch"  # no GPU here
    assert "--no-index --no-deps" in log


def test_bundle_and_outputs_are_git_ignored() -> None:
    paths = [".gpu_bundle/x.whl", ".gpu_bundle.tmp.1/x.whl", ".gpu_site/x.py", "gpu_check_out/x"]
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.stdout.split() == paths


def test_real_bundle_imports_flashinfer_without_a_gpu(tmp_path: Path) -> None:
    """The real bundle (``scripts/gpu_bundle.sh``, from the package index: needs the
    network, as CI's installs do): its pure-Python wheels, flashinfer among them, installed
    with ``pip install --no-index --no-deps --target`` as gpu_check.sh does, and ``import
    flashinfer`` (plus the submodules ``mmserve.kernels.ops`` imports) from there with no
    GPU. Its two CPython 3.12 wheels (apache-tvm-ffi, charset-normalizer) do not load on
    other Pythons: the running environment's are used, apache-tvm-ffi at the bundle's pin."""
    wheels, _ = read_list()
    bundle, site = tmp_path / "bundle", tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BUNDLE": str(bundle)}
    proc = subprocess.run(
        ["bash", str(BUNDLE_SH)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = sorted(p.name for p in bundle.glob("*.whl"))
    assert len(got) == len(wheels)
    pure = [p for p in got if "-py3-none-" in p]
    assert any(p.startswith("flashinfer_python-0.6.18.post1-") for p in pure)
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
           "--target", str(site), *(str(bundle / p) for p in pure)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    from importlib.metadata import version

    assert version("apache-tvm-ffi") == wheels["apache-tvm-ffi"][0]
    probe = (
        "import json, flashinfer, flashinfer.norm, flashinfer.rope, flashinfer.activation, torch\n"
        "print(json.dumps([flashinfer.__version__, flashinfer.__file__,"
        " torch.cuda.is_available()]))"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    ver, file, _cuda = json.loads(out.stdout.splitlines()[-1])
    assert ver == wheels["flashinfer-python"][0] == "0.6.18.post1"
    assert file == str(site / "flashinfer" / "__init__.py")
