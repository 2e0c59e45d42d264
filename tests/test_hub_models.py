"""``--model org/name``: Hub ids resolved from a local Hub cache, offline, and their errors.

No network: the tiny checkpoint is laid out as ``huggingface_hub`` lays out its cache
(``models--org--name/{blobs,snapshots/<commit>,refs/main}``) under a temporary
``HF_HOME`` (:func:`mmserve.testing.hub_cache.write_hub_cache`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub.utils import filter_repo_objects

from api.cli import main as cli_main
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model import hub
from mmserve.testing.hub_cache import write_hub_cache
from tests.helpers import fake_hub, greedy, user
from tests.live_server import free_port, live_server_process

REPO = "mmserve-tests/llava-tiny"


@pytest.fixture
def hub_home(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary ``HF_HOME`` whose Hub cache holds the tiny LLaVA as :data:`REPO`,
    offline (``HF_HUB_OFFLINE=1``); returns the snapshot directory."""
    home = tmp_path / "hf"
    snapshot = write_hub_cache(model_dir, home / "hub", REPO)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_hub_cache_layout_is_the_libraries(hub_home: Path) -> None:
    repo = hub_home.parents[1]
    assert repo.name == "models--mmserve-tests--llava-tiny"
    assert (repo / "refs" / "main").read_text() == hub_home.name
    weights = hub_home / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent == repo / "blobs"
    # huggingface_hub itself finds it by id
    from huggingface_hub import snapshot_download

    assert snapshot_download(REPO, cache_dir=str(repo.parent), local_files_only=True) == str(
        hub_home
    )


def test_engine_by_hub_id_equals_the_directory(hub_home: Path, model_dir: Path) -> None:
    cfg = EngineConfig(model_path=REPO, dtype="float32")
    by_id = Engine(cfg)
    assert cfg.model_path == str(hub_home)  # resolved in place: other processes get the path
    source = hub.source_of(cfg.model_path)
    assert REPO in source and "revision main" in source and hub_home.name in source
    by_path = Engine(EngineConfig(model_path=str(model_dir), dtype="float32"))
    out = []
    for eng in (by_id, by_path):
        req = eng.processor.make_request(messages=user("what is this?"), params=greedy(6))
        out.append(eng.generate([req])[0].output_ids)
    assert out[0] == out[1] and len(out[0]) == 6


def test_allow_patterns_fetch_only_what_the_loader_reads() -> None:
    listing = [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
        "chat_template.jinja", "chat_template.json", "additional_chat_templates/tool.jinja",
        "merges.txt", "vocab.json",
        # never fetched: pickles, other formats, sub-folder copies, the model card
        "pytorch_model.bin", "pytorch_model.bin.index.json".replace(".json", ".pkl"),
        "training_args.bin", "model.ckpt", "onnx/model.safetensors", "onnx/config.json",
        "README.md", "model.gguf", "flax_model.msgpack",
    ]  # fmt: skip
    got = set(
        filter_repo_objects(
            listing,
            allow_patterns=list(hub.ALLOW_PATTERNS),
            ignore_patterns=list(hub.IGNORE_PATTERNS),
        )
    )
    assert got == set(listing[:17])


def _serve_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``mmserve serve *args`` in-process: its exit code is 2 and stderr is one line."""
    rc = cli_main(["serve", "--port", str(free_port()), *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_id_offline_is_one_line(hub_home: Path, capsys, monkeypatch) -> None:
    def no_weights(*_a, **_k):  # nothing may be read for a model that does not resolve
        raise AssertionError("weights read")

    monkeypatch.setattr("mmserve.model.loader.read_weights", no_weights)
    line = _serve_error(capsys, "--model", "mmserve-tests/no-such-model")
    assert "mmserve-tests/no-such-model" in line and "HF_HUB_OFFLINE" in line
    assert "not in the Hub cache" in line


def test_missing_revision_offline_is_one_line(hub_home: Path, capsys) -> None:
    line = _serve_error(capsys, "--model", REPO, "--revision", "v9")
    assert "revision 'v9'" in line and REPO in line


def test_revision_with_a_path_is_refused(model_dir: Path, capsys) -> None:
    line = _serve_error(capsys, "--model", str(model_dir), "--revision", "main")
    assert "--revision" in line and "local path" in line


def test_unreachable_hub_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", closed)
    line = _serve_error(capsys, "--model", REPO)
    assert "cannot reach the Hugging Face Hub" in line and closed in line and REPO in line


@pytest.mark.parametrize(
    ("status", "code", "words"),
    [
        (404, "RepoNotFound", "was not found on the Hub"),
        (404, "RevisionNotFound", "revision 'main' of mmserve-tests/llava-tiny does not exist"),
        (403, "GatedRepo", "is a gated repository"),
        (401, "RepoNotFound", "was not found on the Hub"),
        (500, "InternalError", "answered HTTP 500"),
    ],
)
def test_hub_answers_are_one_line(tmp_path, capsys, monkeypatch, status, code, words) -> None:
    """Online, the Hub's refusals (a fake Hub on loopback answering as the Hub does)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    with fake_hub(status, code) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        line = _serve_error(capsys, "--model", REPO)
    assert words in line and REPO in line, line


def test_not_a_path_nor_an_id_is_one_line(tmp_path: Path, capsys) -> None:
    line = _serve_error(capsys, "--model", str(tmp_path / "no" / "such" / "dir"))
    assert "no such directory" in line


def test_download_dir_is_the_cache(hub_home: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    cache = hub_home.parents[2]
    got = hub.resolve_model(REPO, "main", download_dir=str(cache))
    assert got.path == hub_home and got.commit == hub_home.name and got.repo_id == REPO


def test_serve_by_hub_id_logs_where_from(hub_home: Path, tmp_path: Path) -> None:
    """A real ``mmserve serve --model org/name`` (offline) answers under the id and logs
    the id, revision, commit and snapshot path."""
    import os

    env = {k: os.environ[k] for k in ("HF_HOME", "HF_HUB_OFFLINE")}
    log = tmp_path / "serve.log"
    with live_server_process(REPO, env=env, log_path=log) as (url, _):
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        body = {"model": REPO, "messages": user("hi"), "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    text = log.read_text()
    want = f"from Hugging Face Hub {REPO} (revision main, commit {hub_home.name}) at {hub_home}"
    assert want in text, text[-3000:]


def test_make_model_hub_cache(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mmserve.cli", "make-model", str(tmp_path / "ck"),
         "--hub-cache", str(tmp_path / "hub"), "--repo-id", "org/name"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    snapshot = Path(out.stdout.strip().splitlines()[-1])
    assert snapshot.parent == tmp_path / "hub" / "models--org--name" / "snapshots"
    assert (snapshot / "config.json").is_file()
    assert (tmp_path / "hub" / "models--org--name" / "refs" / "main").read_text() == snapshot.name


def test_make_model_hub_cache_without_dir(tmp_path: Path, capsys) -> None:
    from mmserve.cli import main as make_main

    assert make_main(["make-model", "--hub-cache", str(tmp_path), "--repo-id", "o/n"]) == 0
    snapshot = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert snapshot.parent == tmp_path / "models--o--n" / "snapshots"
    assert (snapshot / "model.safetensors").resolve().parent == tmp_path / "models--o--n" / "blobs"
    assert make_main(["make-model"]) == 2
    assert "--hub-cache" in capsys.readouterr().err
