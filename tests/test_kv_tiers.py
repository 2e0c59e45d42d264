"""Host and disk KV tiers behind the radix tree: the tiers against brute-force models,
outputs with tiers equal outputs without, restarts, bad files, foreign namespaces."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import urllib.request
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.cache.kv_tiers import (
    HEADER_BYTES,
    DiskTier,
    PageKeyChain,
    host_tier,
    kv_namespace,
)
from tests.helpers import TINY_FAMILIES, assert_same_generation, greedy, user
from tests.live_server import get_json, live_server_process, metric

NS = kv_namespace(b"f" * 16, torch.float32, 2, ("NHD", 1, 1, 2))
PAGE_SHAPE = (2, 1, 2, 1, 2)  # [2, L, P, Hkv, D]
PAGE_BYTES = 2 * 2 * 2 * 4


def page(v: int) -> torch.Tensor:
    return torch.full(PAGE_SHAPE, float(v))


def key(k: int) -> bytes:
    return k.to_bytes(16, "little")


# ---- page keys --------------------------------------------------------------------
@given(
    a=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
    b=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
)
def test_key_chain_is_a_prefix_hash(a: list[int], b: list[int]) -> None:
    chain = PageKeyChain(NS, 2)
    a = a[: len(a) - len(a) % 2]
    whole = chain.chain(chain.root, a + b)
    head = chain.chain(chain.root, a)
    tail = chain.chain(head[-1] if head else chain.root, b)
    assert whole == head + tail
    assert len(set(whole)) == len(whole)  # a key names a whole prefix
    other = PageKeyChain(kv_namespace(b"g" * 16, torch.float32, 2, ("NHD", 1, 1, 2)), 2)
    assert not set(other.chain(other.root, a + b)) & set(whole)


# ---- host tier against an LRU dict ----------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "pop"]), st.integers(0, 9)), max_size=60)


@given(ops=OPS, cap_pages=st.integers(0, 5))
def test_host_tier_is_a_byte_bounded_lru(ops: list[tuple[str, int]], cap_pages: int) -> None:
    tier = host_tier(cap_pages * PAGE_BYTES, PAGE_BYTES)
    model: OrderedDict[bytes, int] = OrderedDict()
    for op, k in ops:
        if op == "put":
            dropped = [dk for dk, _ in tier.put(key(k), page(k))]
            if cap_pages:
                model[key(k)] = k
                model.move_to_end(key(k))
                expect = []
                while len(model) > cap_pages:
                    expect.append(model.popitem(last=False)[0])
                assert dropped == expect
        elif op == "get":
            got = tier.get(key(k))
            assert (got is None) == (key(k) not in model)
            if got is not None:
                assert got[0, 0, 0, 0, 0].item() == k
                model.move_to_end(key(k))
        else:
            got = tier.pop(key(k))
            assert (got is None) == (model.pop(key(k), None) is None)
        assert tier.keys() == list(model)
        assert tier.nbytes == len(model) * PAGE_BYTES <= cap_pages * PAGE_BYTES


# ---- disk tier against an LRU dict ------------------------------------------------------
FEATURE_HEADER_BYTES = 80


def feats(k: int) -> torch.Tensor:
    """Image ``k``'s features: ``k % 3 + 1`` tokens of width 2 (feature files vary in size)."""
    return torch.full((k % 3 + 1, 2), float(k))


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["write", "read", "feat", "read_feat"]), st.integers(0, 7)),
        max_size=40,
    ),
    cap=st.integers(0, 5 * (HEADER_BYTES + PAGE_BYTES)),
)
def test_disk_tier_is_a_byte_bounded_lru(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], cap: int
) -> None:
    """Pages and image features share one least-recently-used order and one byte bound."""
    root = tmp_path_factory.mktemp("disk")
    tier = DiskTier(str(root), NS, cap, PAGE_SHAPE, torch.float32, 3600)
    model: OrderedDict[tuple[str, int], int] = OrderedDict()  # (kind, k) -> file bytes
    try:
        for op, k in ops:
            if op in ("write", "feat"):
                if op == "write":
                    assert tier.write_now(key(k), page(k))
                    kk, size = ("kv", k), HEADER_BYTES + PAGE_BYTES
                else:
                    assert tier.write_features_now(key(k), feats(k))
                    kk, size = ("feat", k), FEATURE_HEADER_BYTES + feats(k).numel() * 4
                if size > cap:  # larger than the whole tier: deleted at once
                    model.pop(kk, None)
                else:
                    model[kk] = size
                    model.move_to_end(kk)
                    while sum(model.values()) > cap:
                        model.popitem(last=False)
            else:
                kk = ("kv" if op == "read" else "feat", k)
                if op == "read":
                    got = tier.read(key(k))
                else:
                    got = tier.read_features(key(k), k % 3 + 1, 2)
                assert (got is None) == (kk not in model)
                if got is not None:
                    assert torch.equal(got, page(k) if op == "read" else feats(k))
                    model.move_to_end(kk)
            files = sorted(p.name for p in Path(tier.dir).iterdir())
            assert files == sorted(f"{key(k).hex()}.{kind}" for kind, k in model)
            assert tier.bytes_used == sum(model.values()) <= cap
            assert len(tier) == sum(kind == "kv" for kind, _ in model)
            assert tier.feature_files == sum(kind == "feat" for kind, _ in model)
        # a fresh index over the same directory (a restart) finds the same files
        again = DiskTier(str(root), NS, 1 << 30, PAGE_SHAPE, torch.float32, 3600)
        assert {k for k in range(8) if key(k) in again} == {k for kind, k in model if kind == "kv"}
        assert {k for k in range(8) if again.has_features(key(k))} == {
            k for kind, k in model if kind == "feat"
        }
        assert again.bytes_used == sum(model.values())
        again.close()
    finally:
        tier.close()


def _tier(root: Path) -> DiskTier:
    return DiskTier(str(root), NS, 1 << 20, PAGE_SHAPE, torch.float32, 3600)


def _write_kind(tier: DiskTier, kind: str, k: int) -> None:
    """Write file ``k`` of ``kind``: a page, or 3 x 4 image features."""
    if kind == "kv":
        assert tier.write_now(key(k), page(k))
    else:
        assert tier.write_features_now(key(k), torch.arange(12.0).reshape(3, 4) + k)


def _read_kind(tier: DiskTier, kind: str, k: int, rows: int = 3) -> torch.Tensor | None:
    if kind == "kv":
        return tier.read(key(k))
    return tier.read_features(key(k), rows, 4)


DAMAGES = ["truncate", "flip", "foreign", "empty", "version"]


# "shape": a whole, checked feature file that does not fit the prompt's run of the image
@pytest.mark.parametrize(
    ("kind", "damage"), [("kv", d) for d in DAMAGES] + [("feat", d) for d in [*DAMAGES, "shape"]]
)
def test_bad_files_are_misses_and_deleted(tmp_path: Path, kind: str, damage: str, caplog) -> None:
    """Pages and features go through one checked reader: a damaged, foreign or (features)
    wrongly shaped file is a miss, counted and deleted; a rewrite reads back whole."""
    tier = _tier(tmp_path)
    _write_kind(tier, kind, 1)
    path = Path(tier.dir) / f"{key(1).hex()}.{kind}"
    data = bytearray(path.read_bytes())
    rows = 3
    if damage == "truncate":
        data = data[:-3]
    elif damage == "flip":
        data[-1] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    elif damage == "version":
        data[8] += 1
    elif damage == "shape":
        rows = 2
    else:  # the same file written under another namespace (another model or dtype)
        other = DiskTier(str(tmp_path / "o"), key(7), 1 << 20, PAGE_SHAPE, torch.float32, 3600)
        _write_kind(other, kind, 1)
        data = bytearray((Path(other.dir) / path.name).read_bytes())
        other.close()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert _read_kind(tier, kind, 1, rows) is None
    assert not path.exists() and key(1) not in tier and not tier.has_features(key(1))
    assert tier.read_failures == 1 and tier.bytes_used == 0 and tier.deleted == 1
    _write_kind(tier, kind, 1)  # rewritten, read back whole
    expect = page(1) if kind == "kv" else torch.arange(12.0).reshape(3, 4) + 1
    assert torch.equal(_read_kind(tier, kind, 1), expect)
    tier.close()


def test_feature_files_keep_their_dtype(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    half = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    assert tier.write_features_now(key(2), half)
    got = tier.read_features(key(2), 3, 4)
    assert got.dtype == torch.bfloat16 and torch.equal(got, half)
    assert not tier.write_features(key(3), half.reshape(-1))  # other shapes: refused
    assert not tier.write_features(key(3), half.to(torch.int32).reshape(3, 4))
    tier.close()


def test_unwritable_directory_turns_the_tier_off(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(str(blocker), NS, 1 << 20, PAGE_SHAPE, torch.float32)
    assert not tier.enabled and not tier.writable
    assert not tier.write(key(1), page(1)) and tier.read(key(1)) is None
    assert sum("KV disk tier off" in r.message for r in caplog.records) == 1


def test_write_error_turns_writing_off_once(tmp_path: Path, caplog, monkeypatch) -> None:
    import errno

    tier = _tier(tmp_path)
    assert tier.write_now(key(1), page(1))

    def full(*_a: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING):
        assert not tier.write_now(key(2), page(2))
        assert not tier.write(key(3), page(3))  # off: nothing queued
    assert not tier.writable
    assert sum("writing off" in r.message for r in caplog.records) == 1
    assert not [p for p in Path(tier.dir).iterdir() if p.name.endswith(".tmp")]
    assert torch.equal(tier.read(key(1)), page(1))  # reads go on
    tier.close()


def test_concurrent_writers_leave_whole_files(tmp_path: Path) -> None:
    tiers = [_tier(tmp_path) for _ in range(2)]
    pages = {k: page(k) for k in range(20)}

    def writer(t: DiskTier) -> None:
        for k, p in pages.items():
            t.write_now(key(k), p)

    threads = [threading.Thread(target=writer, args=(t,)) for t in tiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    reader = _tier(tmp_path)
    for k, p in pages.items():
        assert torch.equal(reader.read(key(k)), p)
    assert not [p for p in Path(reader.dir).iterdir() if p.name.endswith(".tmp")]
    for t in [*tiers, reader]:
        t.close()


# ---- the engine with tiers ----------------------------------------------------------------
@pytest.fixture(scope="module")
def imgs(make_engine, photos):
    eng = make_engine()
    return [eng.processor.prepare_image(b) for b in list(photos.values())[:3]]


def _rounds(eng, imgs, rounds: int = 2):
    """Each image asked about in turn, ``rounds`` times: a pool holding about two images
    evicts each one before its next question."""
    out = []
    for r in range(rounds):
        for img in imgs:
            req = eng.processor.make_request(
                messages=user(None, f"Question {r}?"), images=[img], params=greedy(5)
            )
            out.append(eng.generate([req])[0])
            eng.scheduler.check_accounting()
    return out


POOL = 1400  # tokens: two 576-token images and their prompts, not three


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_pages_come_back_from_a_tier(
    make_engine, imgs, tmp_path: Path, page_size: int, tier: str
) -> None:
    base = _rounds(make_engine(page_size=page_size, max_total_tokens=POOL), imgs)
    kw = {"kv_host_bytes": 1 << 30} if tier == "host" else {"kv_disk_dir": str(tmp_path)}
    eng = make_engine(page_size=page_size, max_total_tokens=POOL, **kw)
    res = _rounds(eng, imgs)
    for k, (a, b) in enumerate(zip(res, base, strict=True)):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, f"{tier} #{k}")
    # without tiers the second round misses (the pool lost each image); with them every
    # image's pages come back: all whole pages up to the question
    assert all(r.cached_tokens < 576 for r in base[3:])
    stats = eng.cache_stats()
    loaded = stats[f"tier_{tier}_hit_tokens"]
    assert loaded > 0
    for r in res[3:]:
        assert r.cached_tokens >= 576 // page_size * page_size
    # cached tokens of the second round = device hits + tier loads
    assert sum(r.cached_tokens for r in res) - sum(r.cached_tokens for r in base) <= loaded
    if page_size == 1:
        assert all(r.vision_tower_runs == 0 for r in res[3:])
        assert eng.runner.vision_tower_images == 3
    eng.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_fp8_pages_round_trip_through_a_tier(make_engine, imgs, tmp_path: Path, tier: str) -> None:
    """fp8 KV pages go to a tier and come back as the same bytes: the same tokens as fp8
    without tiers; they live in their own namespace, one byte per element on disk."""
    fp8 = {"page_size": 16, "max_total_tokens": POOL, "kv_cache_dtype": "fp8_e4m3"}
    base = _rounds(make_engine(**fp8), imgs)
    kw = {"kv_host_bytes": 1 << 30} if tier == "host" else {"kv_disk_dir": str(tmp_path)}
    eng = make_engine(**fp8, **kw)
    res = _rounds(eng, imgs)
    for k, (a, b) in enumerate(zip(res, base, strict=True)):
        assert a.output_ids == b.output_ids, f"{tier} #{k}"
    assert eng.cache_stats()[f"tier_{tier}_hit_tokens"] > 0
    assert all(r.cached_tokens >= 576 // 16 * 16 for r in res[3:])
    assert all(r.cached_tokens < 576 for r in base[3:])
    if tier == "disk":
        eng.close()
        auto = make_engine(page_size=16, kv_disk_dir=str(tmp_path))
        assert auto.tiers.disk.dir != eng.tiers.disk.dir  # bf16/fp32 pages never mix
        files = list(Path(eng.tiers.disk.dir).glob("*.kv"))
        shape = eng.pool.k_buffers[0].shape  # [pages, P, Hkv, D]
        page = 2 * eng.pool.num_layers * shape[1] * shape[2] * shape[3]  # 1 byte each
        assert files and all(f.stat().st_size == 64 + page for f in files)
        auto.close()
    eng.close()


def test_closing_an_engine_twice_returns_at_once(make_engine, imgs, tmp_path: Path) -> None:
    """A second ``close`` (and a disk tier's ``flush`` after its ``close``) does not wait out
    its timeout on a writer thread that has stopped: it used to cost 2 x 60 s."""
    eng = make_engine(kv_disk_dir=str(tmp_path))
    _rounds(eng, imgs, rounds=1)
    assert eng.close() > 0
    done: list[object] = []
    second = threading.Thread(
        target=lambda: done.append((eng.close(timeout=3600), eng.tiers.disk.flush(3600))),
        daemon=True,  # a failure here must not hold the test run for an hour
    )
    second.start()
    second.join(30)
    assert not second.is_alive(), "a second close waits on a stopped writer"
    assert done == [(0, True)]


def test_restart_reuses_disk_pages(make_engine, imgs, tmp_path: Path) -> None:
    first = make_engine(kv_disk_dir=str(tmp_path))
    before = _rounds(first, imgs, rounds=1)
    assert first.cache_stats()["tier_disk_pages"] == 0  # nothing evicted: nothing written yet
    assert first.close() > 0  # shutdown writes the tree's pages
    second = make_engine(kv_disk_dir=str(tmp_path))
    after = _rounds(second, imgs, rounds=1)
    for a, b in zip(after, before, strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "restart")
        prompt = a.prompt_tokens
        assert a.cached_tokens == prompt - 1  # everything but the token that gives logits
    assert second.runner.vision_tower_images == 0
    # the chat template's leading text is shared: later images hit it in the pool
    loaded = second.cache_stats()["tier_disk_hit_tokens"]
    assert 3 * 576 <= loaded <= sum(r.cached_tokens for r in after)
    second.close()
    # another page size is another namespace: a miss, never wrong KV
    other = make_engine(kv_disk_dir=str(tmp_path), page_size=16)
    res = _rounds(other, imgs[:1], rounds=1)
    assert res[0].cached_tokens == 0 and other.cache_stats()["tier_disk_hit_tokens"] == 0
    other.close()


def test_another_checkpoint_never_reads_the_pages(
    make_engine, families, imgs, tmp_path: Path
) -> None:
    eng = make_engine(kv_disk_dir=str(tmp_path))
    _rounds(eng, imgs[:1], rounds=1)
    eng.close()
    nxt = families["llava-next"].make_engine(kv_disk_dir=str(tmp_path))
    assert nxt.tiers.disk.dir != eng.tiers.disk.dir
    assert len(nxt.tiers.disk) == 0 and len(eng.tiers.disk) > 0
    nxt.close()


def test_corrupted_disk_pages_are_recomputed(make_engine, imgs, tmp_path: Path) -> None:
    first = make_engine(kv_disk_dir=str(tmp_path))
    before = _rounds(first, imgs[:1], rounds=1)
    first.close()
    files = sorted(Path(first.tiers.disk.dir).iterdir())
    for p in files[::7]:  # damage some pages: truncated or flipped
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2] if len(data) % 2 else data[:-1] + b"\x00")
    second = make_engine(kv_disk_dir=str(tmp_path))
    after = _rounds(second, imgs[:1], rounds=1)
    a, b = after[0], before[0]
    assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "damaged")
    assert second.tiers.disk.read_failures >= 1
    assert a.cached_tokens < a.prompt_tokens - 1  # the chain stops at the first bad page
    second.scheduler.check_accounting()
    second.close()


def test_disk_loads_do_not_block_other_requests(
    make_engine, imgs, tmp_path: Path, monkeypatch
) -> None:
    first = make_engine(kv_disk_dir=str(tmp_path))
    before = _rounds(first, imgs[:1], rounds=1)
    first.close()
    eng = make_engine(kv_disk_dir=str(tmp_path))
    gate = threading.Event()
    read = eng.tiers.disk.read
    img_req = eng.processor.make_request(
        messages=user(None, "Question 0?"), images=[imgs[0]], params=greedy(5)
    )
    text_req = eng.processor.make_request(messages=user("Only text."), params=greedy(5))
    # the chat template's first tokens are shared: only the image's pages wait on the gate
    chain = eng.tiers.chain
    free = set(chain.chain(chain.root, list(text_req.input_ids)))
    monkeypatch.setattr(eng.tiers.disk, "read", lambda k: (k in free or gate.wait(60)) and read(k))
    img_col, text_col = eng.track(img_req), eng.track(text_req)  # queued
    for _ in range(200):
        eng.step()
        if text_col.finished:
            break
    # the text request ran to the end while the image request waited for its pages
    assert text_col.finished and not img_col.finished
    assert eng.cache_stats()["tier_loading_requests"] == 1
    gate.set()
    for _ in range(2000):
        if img_col.finished:
            break
        eng.step()
    a, b = img_col.result, before[0]
    assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "after load")
    assert a.cached_tokens == a.prompt_tokens - 1
    eng.close()


def test_flush_clears_memory_tiers(make_engine, imgs) -> None:
    eng = make_engine(max_total_tokens=POOL, kv_host_bytes=1 << 30)
    _rounds(eng, imgs, rounds=1)
    assert eng.cache_stats()["tier_host_pages"] > 0
    eng.flush_cache()
    assert eng.cache_stats()["tier_host_pages"] == 0
    res = _rounds(eng, imgs[:1], rounds=1)
    assert res[0].cached_tokens == 0


# ---- through a live server ------------------------------------------------------------
def _ask(url: str, image: str, question: str = "What is this?") -> dict:
    body = {
        "model": "llava-tiny",
        "max_tokens": 5,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_server_restart_answers_from_disk(model_dir: Path, photos, tmp_path: Path) -> None:
    """SIGTERM writes the KV pages and the image's features; the restarted server answers
    the same question from disk pages, and another question about the image with its
    features from disk (the positions after the last whole page): no tower run."""
    import base64

    image = "data:image/png;base64," + base64.b64encode(photos["cat.png"]).decode()
    args = ("--kv-disk-dir", str(tmp_path), "--served-model-name", "llava-tiny")
    args += ("--page-size", "16")
    with live_server_process(model_dir, *args) as (url, proc):
        first = _ask(url, image)
        assert first["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    with live_server_process(model_dir, *args) as (url, _):
        again = _ask(url, image)
        stats = get_json(f"{url}/v1/cache/stats")
        other = _ask(url, image, "Where was it taken?")
        after = get_json(f"{url}/v1/cache/stats")
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            text = r.read().decode()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (again["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert stats["vision_tower_images"] == 0 and stats["tier_disk_hit_tokens"] == cached
    # the other question shares the template and image; the image's last page is recomputed
    assert after["vision_tower_images"] == 0 and after["tier_feature_loads"] == 1
    assert metric(text, "mmserve_kv_tier_feature_loads_total") == 1
    assert metric(text, "mmserve_kv_tier_disk_feature_files") == 1
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576 * 0.95


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_family_equal_after_loading_from_disk(
    families, photos, tmp_path: Path, family: str, page_size: int
) -> None:
    make = families[family].make_engine
    photo = photos["cat.png"]

    def ask(eng):
        img = eng.processor.prepare_image(photo)
        req = eng.processor.make_request(
            messages=user(None, "What is this?"), images=[img], params=greedy(5)
        )
        return eng.generate([req])[0]

    base = ask(make(page_size=page_size))
    first = make(page_size=page_size, kv_disk_dir=str(tmp_path))
    ask(first)
    first.close()
    eng = make(page_size=page_size, kv_disk_dir=str(tmp_path))
    res = ask(eng)
    assert_same_generation(res.output_ids, base.output_ids, res.logits, base.logits, family)
    whole = (res.prompt_tokens - 1) // page_size * page_size
    assert res.cached_tokens == whole == eng.cache_stats()["tier_disk_hit_tokens"]
    eng.scheduler.check_accounting()
    eng.close()


# ---- the feature tier ------------------------------------------------------------------
def test_features_load_from_disk_into_the_feature_cache(tmp_path: Path) -> None:
    """``features_to_load`` asks only for features the cache and request lack and the disk
    has; a load puts them in the cache; a file that does not fit the prompt is a miss."""
    from mmserve.cache.kv_pool import KVPool
    from mmserve.cache.kv_tiers import KVTiers
    from mmserve.vision.embedding_cache import EmbeddingCache

    cache = EmbeddingCache(1 << 20)
    pool = KVPool(4, 2, 1, 1, 2)
    tiers = KVTiers(pool, NS, disk_dir=str(tmp_path), feature_dim=4, feature_cache=cache)
    f = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tiers.features_to_load([(key(1), 3)]) == []  # nowhere yet
    tiers.save_features(key(1), f)
    tiers.disk.flush()
    assert tiers.disk.has_features(key(1))
    assert tiers.features_to_load([(key(1), 3), (key(1), 3), (key(2), 3)]) == [(key(1), 3)]
    assert tiers.start_load("r", [], [(key(1), 3)])
    assert not tiers.start_load("r", [], [(key(1), 3)])  # once per admission
    _wait_for(lambda: tiers.poll() or not tiers.pending(), "the load")
    assert torch.equal(cache.peek(key(1)), f) and tiers.feature_loads == 1
    assert tiers.features_to_load([(key(1), 3)]) == []  # cached now
    # another prompt run length for the same key: the file is refused and deleted
    cache.clear()
    tiers.forget("r")
    assert tiers.start_load("r", [], [(key(1), 2)])
    _wait_for(lambda: tiers.poll() or not tiers.pending(), "the load")
    assert key(1) not in cache and not tiers.disk.has_features(key(1))
    assert tiers.disk.read_failures == 1 and tiers.stats()["tier_feature_loads"] == 1
    tiers.close()


def _ask_each(eng, imgs, question: str):
    out = []
    for img in imgs:
        req = eng.processor.make_request(
            messages=user(None, question), images=[img], params=greedy(5)
        )
        out.append((req, eng.generate([req])[0]))
    return out


def _image_tokens_cached(req, res) -> tuple[int, int]:
    """(image tokens inside the cached prefix, image tokens) of one request."""
    total = sum(s.length for s in req.spans)
    cached = sum(max(0, min(s.end, res.cached_tokens) - s.start) for s in req.spans)
    return cached, total


def test_restart_at_page_16_runs_no_tower(make_engine, imgs, tmp_path: Path) -> None:
    """After a restart, another question about a seen image: its whole pages come from
    disk and its last partial page is recomputed from features read from disk, so the
    tower never runs; tokens equal a fresh engine's."""
    first = make_engine(page_size=16, kv_disk_dir=str(tmp_path))
    _ask_each(first, imgs, "What is this?")
    assert first.runner.vision_tower_images == len(imgs)
    first.close()
    assert first.tiers.disk.feature_files == len(imgs)
    base = _ask_each(make_engine(page_size=16), imgs, "Where was it taken?")
    second = make_engine(page_size=16, kv_disk_dir=str(tmp_path))
    after = _ask_each(second, imgs, "Where was it taken?")
    cached = total = 0
    for (req, a), (_, b) in zip(after, base, strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "restart p16")
        c, t = _image_tokens_cached(req, a)
        # the image's last partial page is outside the cache: it needs the features
        assert req.spans[-1].end > a.cached_tokens
        cached, total = cached + c, total + t
        assert a.vision_tower_runs == 0
    assert cached >= 0.95 * total
    assert second.runner.vision_tower_images == 0
    stats = second.cache_stats()
    assert stats["tier_feature_loads"] == len(imgs)
    assert stats["tier_disk_hit_tokens"] >= cached
    second.scheduler.check_accounting()
    second.close()
    # a damaged feature file is a miss: deleted, the tower runs, the same tokens
    path = Path(second.tiers.disk.dir) / (imgs[0].key.hex() + ".feat")
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    third = make_engine(page_size=16, kv_disk_dir=str(tmp_path))
    again = _ask_each(third, imgs, "Where was it taken?")
    for (_, a), (_, b) in zip(again, base, strict=True):
        assert_same_generation(a.output_ids, b.output_ids, a.logits, b.logits, "bad features")
    assert [a.vision_tower_runs for _, a in again] == [1] + [0] * (len(imgs) - 1)
    assert third.tiers.disk.read_failures == 1
    third.close()


# ---- replicas on one machine -------------------------------------------------------------
def _wait_for(cond, what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (bounded): the disk tier finds other processes' files on a rescan."""
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_stopping_replica_writes_pages_a_running_one_reads(
    model_dir: Path, make_engine, imgs, tmp_path: Path, monkeypatch
) -> None:
    """A replica Ray Serve stops (its ``__del__``) writes its tree to the shared disk
    tier; another replica, running all along on the same directory, then answers about
    the same image from disk: no tower run, the same tokens."""
    pytest.importorskip("ray.serve", reason='needs Ray Serve: pip install -e ".[replicas]"')
    import asyncio
    import types

    import ray
    from ray import serve

    from mmserve.config import EngineConfig
    from mmserve.fleet.replica import EngineReplica

    ctx = types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id="r0"))
    monkeypatch.setattr(serve, "get_replica_context", lambda: ctx)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    config = EngineConfig(
        model_path=str(model_dir), page_size=16, kv_disk_dir=str(tmp_path), dtype="float32"
    )
    replica = EngineReplica(config)
    other = make_engine(page_size=16, kv_disk_dir=str(tmp_path))  # the second replica
    msg = replica.engine.processor.make_request(
        messages=user(None, "What is this?"), images=[imgs[0]], params=greedy(5)
    )

    async def ask() -> list[int]:
        ids: list[int] = []
        async for delta in replica.aengine.deltas(msg):
            ids.extend(delta.token_ids)
        return ids

    first = asyncio.run(ask())
    assert len(other.tiers.disk) == 0  # nothing evicted: nothing on disk yet
    replica.__del__()  # what Ray Serve calls on a stopping replica
    assert replica.engine.tiers.disk.feature_files == 1
    written = len(replica.engine.tiers.disk)
    assert written >= (len(msg.input_ids) - 1) // 16
    assert replica.shutdown() == 0  # once only: a later __del__ (garbage collection) is a no-op
    _wait_for(lambda: len(other.tiers.disk) == written, "the other replica's rescan")
    res = other.generate([msg])[0]
    assert res.output_ids == first
    assert res.cached_tokens == (res.prompt_tokens - 1) // 16 * 16
    assert res.vision_tower_runs == 0 and other.runner.vision_tower_images == 0
    other.close()


def test_fleet_stats_count_the_shared_disk_once() -> None:
    """Replicas on one machine share one disk directory: the fleet's totals sum the hits
    and loads but report the store once, and its flags only if every replica has them."""
    pytest.importorskip("ray.serve", reason='needs Ray Serve: pip install -e ".[replicas]"')
    from api.replicas.ingress import aggregate

    def row(pages: int, writable: int, hits: int) -> dict:
        return {
            "prompt_tokens": 100,
            "cached_tokens": 50,
            "tier_disk_pages": pages,
            "tier_disk_bytes": pages * 10,
            "tier_disk_capacity_bytes": 1000,
            "tier_disk_feature_files": 2,
            "tier_disk_on": 1,
            "tier_disk_writable": writable,
            "tier_disk_hit_tokens": hits,
            "tier_feature_loads": 1,
            "accounting": {"ok": True},
        }

    total = aggregate({"a": row(36, 1, 576), "b": row(40, 0, 16)})
    assert total["tier_disk_pages"] == 40 and total["tier_disk_bytes"] == 400
    assert total["tier_disk_capacity_bytes"] == 1000 and total["tier_disk_feature_files"] == 2
    assert total["tier_disk_on"] == 1 and total["tier_disk_writable"] == 0
    assert total["tier_disk_hit_tokens"] == 592 and total["tier_feature_loads"] == 2
    assert total["cache_hit_rate"] == 0.5
