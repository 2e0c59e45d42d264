"""The model identity every persistent or shared cache is keyed on
(:mod:`mmserve.model.identity`): every weight byte, the tokenizer and processor files,
dtype, quantization and KV dtype; the per-file memo that spares a restart the reread."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.cache.kv_tiers import kv_namespace, model_fingerprint
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.model import identity
from mmserve.model.identity import checkpoint_digest, model_identity
from mmserve.model.loader import load_model
from tests.helpers import copy_with_flipped_byte, greedy, safetensors_header, user

#: One weight byte changed, at places a strided sample of the weights never reads: the
#: last byte of the largest tensor, an element of the LM head's last row, the last byte
#: of a vision tower weight, the second byte of the first layer's q projection.
FLIPS = [
    ("language_model.model.embed_tokens.weight", -1),
    ("language_model.lm_head.weight", 1999 * 128 * 4 + 4),
    ("vision_tower.embeddings.patch_embedding.weight", -1),
    ("language_model.model.layers.0.self_attn.q_proj.weight", 1),
]


@pytest.fixture
def memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh digest memo for the test (``$MMSERVE_CACHE_DIR``)."""
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "checkpoint-digests.json"


def test_one_weight_byte_anywhere_changes_the_checkpoint_digest(
    model_dir: Path, tmp_path: Path, memo: Path
) -> None:
    base = checkpoint_digest(model_dir).digest
    # the same bytes elsewhere are the same model: identity is content, not path
    assert checkpoint_digest(shutil.copytree(model_dir, tmp_path / "copy")).digest == base
    seen = {base}
    for i, (tensor, byte) in enumerate(FLIPS):
        other = copy_with_flipped_byte(model_dir, tmp_path / f"flip{i}", tensor, byte)
        d = checkpoint_digest(other).digest
        assert d not in seen, (tensor, byte)
        seen.add(d)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(pick=st.integers(0, 10_000), where=st.floats(0, 1))
def test_one_weight_byte_at_any_place_changes_the_checkpoint_digest(
    model_dir: Path, pick: int, where: float
) -> None:
    """Any tensor of the checkpoint, any byte of it (hypothesis picks both)."""
    base, header = safetensors_header(model_dir / "model.safetensors")
    names = sorted(k for k in header if k != "__metadata__")
    tensor = names[pick % len(names)]
    start, end = header[tensor]["data_offsets"]
    byte = min(end - start - 1, int(where * (end - start)))
    with tempfile.TemporaryDirectory() as tmp:
        memo = Path(tmp) / "memo.json"
        other = copy_with_flipped_byte(model_dir, Path(tmp) / "m", tensor, byte)
        assert checkpoint_digest(other, memo).digest != checkpoint_digest(model_dir, memo).digest


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 300), cols=st.integers(1, 64), data=st.data(), bump=st.sampled_from([1, -1])
)
def test_one_element_anywhere_changes_the_in_memory_fingerprint(
    rows: int, cols: int, data: st.DataObject, bump: int
) -> None:
    """A model built in memory (no files) is fingerprinted on all its bytes, not a sample."""
    w = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7
    i = data.draw(st.integers(0, rows - 1))
    j = data.draw(st.integers(0, cols - 1))
    v = w.clone()
    v[i, j] += bump
    named = [("embed.weight", w), ("bias", torch.zeros(3))]
    changed = [("embed.weight", v), ("bias", torch.zeros(3))]
    assert model_fingerprint("cfg", named) != model_fingerprint("cfg", changed)
    copied = [(n, t.clone()) for n, t in named]
    assert model_fingerprint("cfg", named) == model_fingerprint("cfg", copied)
    # bf16 too (no numpy dtype of its own)
    assert model_fingerprint("cfg", [("w", w.bfloat16())]) != model_fingerprint(
        "cfg", [("w", v.bfloat16())]
    ) or torch.equal(w.bfloat16(), v.bfloat16())


def _ask(eng: Engine, text: str):
    req = eng.processor.make_request(messages=user(text), params=greedy(4))
    return eng.generate([req])[0]


PROMPT = "Describe, in words a child would use, the colour of the sky on a clear summer day. " * 3


def test_checkpoints_one_byte_apart_never_share_a_disk_page(
    model_dir: Path, tmp_path: Path, memo: Path
) -> None:
    """Engine A fills the disk tier; engines on a checkpoint one weight byte apart (each
    place of FLIPS) on the same ``--kv-disk-dir`` get 0 tier hits; a byte-identical copy
    of A elsewhere gets them all."""
    disk = str(tmp_path / "kv")
    a_dir = shutil.copytree(model_dir, tmp_path / "a")
    a = Engine(EngineConfig(model_path=str(a_dir), kv_disk_dir=disk))
    first = _ask(a, PROMPT)
    assert a.close() > 0  # the tree's pages are on disk now
    copy = shutil.copytree(a_dir, tmp_path / "same")
    same = Engine(EngineConfig(model_path=str(copy), kv_disk_dir=disk))
    again = _ask(same, PROMPT)
    assert again.cached_tokens == again.prompt_tokens - 1
    assert same.cache_stats()["tier_disk_hit_tokens"] > 0
    assert again.output_ids == first.output_ids
    same.close()
    for i, (tensor, byte) in enumerate(FLIPS):
        b_dir = copy_with_flipped_byte(a_dir, tmp_path / f"b{i}", tensor, byte)
        b = Engine(EngineConfig(model_path=str(b_dir), kv_disk_dir=disk))
        res = _ask(b, PROMPT)
        assert res.cached_tokens == 0, tensor
        assert b.cache_stats()["tier_disk_hit_tokens"] == 0, tensor
        assert b.tiers is not None and a.tiers is not None and a.tiers.disk is not None
        assert b.tiers.disk is not None and b.tiers.disk.dir != a.tiers.disk.dir
        b.close()


def _root(model, **cfg) -> bytes:
    eng = Engine(EngineConfig(kv_host_bytes=1 << 20, **cfg), model=model)
    assert eng.tiers is not None
    root = eng.tiers.chain.root
    eng.close()
    return root


def _drop_last_merge(text: str) -> str:
    tok = json.loads(text)
    tok["model"]["merges"] = tok["model"]["merges"][:-1]
    return json.dumps(tok)


def test_tokenizer_processor_dtype_quantization_and_kv_dtype_change_the_namespace(
    model_dir: Path, tmp_path: Path, memo: Path
) -> None:
    roots = {"base": _root(load_model(model_dir))}
    assert _root(load_model(model_dir)) == roots["base"]  # stable across loads
    for name, edit in [
        ("tokenizer.json", _drop_last_merge),
        ("preprocessor_config.json", lambda t: t.replace("}", ', "note": 1}', 1)),
        ("chat_template.jinja", lambda t: t + " "),
        ("generation_config.json", lambda t: t.replace("}", ', "note": 1}', 1)),
    ]:
        d = shutil.copytree(model_dir, tmp_path / name)
        (d / name).write_text(edit((d / name).read_text()))
        assert (d / name).read_text() != (model_dir / name).read_text()
        roots[name] = _root(load_model(d))
    roots["bf16"] = _root(load_model(model_dir, dtype=torch.bfloat16), dtype="bfloat16")
    roots["int8"] = _root(load_model(model_dir, quantization="int8"))
    roots["fp8 kv"] = _root(load_model(model_dir), kv_cache_dtype="fp8_e4m3")
    roots["page 16"] = _root(load_model(model_dir), page_size=16)
    assert len(set(roots.values())) == len(roots), roots


def test_kv_scales_change_the_namespace() -> None:
    ident = bytes(16)
    layout = ("NHD", 2, 2, 32)
    a = kv_namespace(ident, torch.float8_e4m3fn, 16, (*layout, 1.0, 1.0, 1.0, 1.0))
    b = kv_namespace(ident, torch.float8_e4m3fn, 16, (*layout, 1.0, 0.5, 1.0, 1.0))
    assert a != b


def test_memo_spares_the_reread_and_notices_changes(
    model_dir: Path, tmp_path: Path, memo: Path
) -> None:
    d = shutil.copytree(model_dir, tmp_path / "m")
    weights = d / "model.safetensors"
    cold = checkpoint_digest(d)
    assert cold.bytes_read == cold.bytes_total > weights.stat().st_size and cold.memo_hits == 0
    assert memo.is_file()
    warm = checkpoint_digest(d)
    assert (warm.digest, warm.bytes_read, warm.memo_hits) == (cold.digest, 0, cold.files)

    # mtime moved: that file is read again (same bytes: same digest)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again = checkpoint_digest(d)
    assert (again.digest, again.bytes_read) == (cold.digest, st.st_size)
    assert checkpoint_digest(d).bytes_read == 0

    # a new inode (rewritten by copy and rename), same bytes
    shutil.copy2(weights, d / "w.tmp")
    os.replace(d / "w.tmp", weights)
    again = checkpoint_digest(d)
    assert (again.digest, again.bytes_read) == (cold.digest, st.st_size)

    # one byte changed in place, size and mtime put back: ctime still moves
    base, header = safetensors_header(weights)
    at = base + header["language_model.lm_head.weight"]["data_offsets"][0] + 4
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(at)
        old = f.read(1)[0]
        f.seek(at)
        f.write(bytes([old ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = checkpoint_digest(d)
    assert changed.bytes_read == st.st_size and changed.digest != cold.digest

    # a grown file
    with open(weights, "ab") as f:
        f.write(b"\0")
    assert checkpoint_digest(d).bytes_read == st.st_size + 1

    # an unreadable or damaged memo is only a reread
    memo.write_text("{not json")
    assert checkpoint_digest(d).bytes_read > 0


def test_identity_is_logged_once_with_its_cost(
    model_dir: Path, memo: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity, "_identities", {})  # as in a new process
    model = load_model(model_dir)
    with caplog.at_level(logging.INFO, logger="mmserve.model.identity"):
        ident = model_identity(model)
        assert model_identity(model) == ident
        Engine(EngineConfig(kv_host_bytes=1 << 20), model=model).close()
    lines = [r.getMessage() for r in caplog.records if "model identity" in r.getMessage()]
    assert len(lines) == 1, lines
    assert ident.hex() in lines[0] and "MB read" in lines[0] and " s" in lines[0]
    assert "0 from the memo" in lines[0]
    # a second load in this process is not digested (nor logged) again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmserve.model.identity"):
        assert model_identity(load_model(model_dir)) == ident
    assert not [r for r in caplog.records if "model identity" in r.getMessage()]
    # a restart (a new process: nothing remembered in memory) takes every file from the memo
    monkeypatch.setattr(identity, "_identities", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmserve.model.identity"):
        assert model_identity(load_model(model_dir)) == ident
    (line,) = [r.getMessage() for r in caplog.records if "model identity" in r.getMessage()]
    assert "0.0 MB read" in line and "0 from the memo" not in line


def test_a_model_built_in_memory_is_identified_by_all_its_tensors(
    model_dir: Path, memo: Path
) -> None:
    a, b = load_model(model_dir), load_model(model_dir)
    a.source = b.source = None  # as if built in memory
    assert model_identity(a) == model_identity(b)
    c = load_model(model_dir)
    c.source = None
    with torch.no_grad():
        c.decoder.lm_head.weight[-1, 1] += 1e-3
    assert model_identity(c) != model_identity(a)


def test_a_directory_of_links_is_the_same_checkpoint(
    model_dir: Path, tmp_path: Path, memo: Path
) -> None:
    """A Hugging Face cache snapshot links each file to a blob: named by the link, read
    through it; the same bytes under the same names are the same checkpoint."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snap.mkdir()
    for k, f in enumerate(sorted(model_dir.iterdir())):
        shutil.copy(f, blobs / f"blob{k}")
        (snap / f.name).symlink_to(blobs / f"blob{k}")
    linked = checkpoint_digest(snap)
    assert linked.digest == checkpoint_digest(model_dir).digest
    assert linked.bytes_total == sum(f.stat().st_size for f in model_dir.iterdir())
    assert checkpoint_digest(snap).bytes_read == 0  # remembered by the blobs' real paths


def test_a_servers_state_beside_the_weights_is_not_the_model(
    model_dir: Path, tmp_path: Path, memo: Path
) -> None:
    """A ``--kv-disk-dir`` or image store kept in the checkpoint's folder changes as the
    server runs: the identity (and so the tiers' namespace) must not change with it; a
    file transformers reads from ``additional_chat_templates/`` does change it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(model_dir, ckpt)
    before = checkpoint_digest(ckpt).digest
    state = ckpt / "kv-disk" / "ns"
    state.mkdir(parents=True)
    (state / "page.kv").write_bytes(b"\0" * 64)
    (ckpt / "images").mkdir()
    (ckpt / "images" / "img-1.img").write_bytes(b"x")
    assert checkpoint_digest(ckpt).digest == before
    extra = ckpt / "additional_chat_templates"
    extra.mkdir()
    (extra / "tools.jinja").write_text("{{ messages }}")
    assert checkpoint_digest(ckpt).digest != before
