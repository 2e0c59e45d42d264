"""Every store commits one id in one critical section (api/commit.py): uploads, deletes
and reads of the same ids from many threads leave the listing, GET and the files on
disk in agreement, a restart (a new store on the same directory) shows the same, and
the outcome is that of some serial order of the operations that returned (issue 45)."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash
from PIL import Image

from api.batch import runner
from api.batch.store import FileStore
from api.commit import IdLocks
from api.errors import APIError
from api.image_store import ImageStore
from api.video_store import VideoStore, video_id
from mmserve.vision.inputs import ImageInput
from mmserve.vision.video import VideoInfo
from tests.helpers import PausingLock, hammer, linearizable, png_bytes
from tests.live_server import app_client

ROUNDS = 60
THREADS = 4
OPS_PER_THREAD = 3


@pytest.fixture(autouse=True)
def fast_switching():
    """Switch threads every 10 us, so the operations interleave at many points."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def fake_prepare(data: bytes) -> ImageInput:
    """An image whose key is its file's first byte: two files with the same first byte
    are one image (as two containers of the same pixels are)."""
    time.sleep(0)  # let another thread in, as a real decode would
    return ImageInput(key=xxhash.xxh3_128_digest(data[:1]), width=1, height=1)


def image_id(name: str) -> str:
    return fake_prepare(name.encode()).id


def plans(rng: random.Random, kinds: tuple[str, ...], keys: tuple[str, ...]) -> list[list]:
    return [
        [(rng.choice(kinds), rng.choice(keys), rng.randrange(3)) for _ in range(OPS_PER_THREAD)]
        for _ in range(THREADS)
    ]


def check_serial(ops, keys, before: dict[str, bool], after: set[str]) -> None:
    for key in keys:
        mine = [op for op in ops if op.key == key]
        assert linearizable(mine, before[key], key in after), (key, before[key], mine)


def image_files(directory: Path) -> set[str]:
    assert not list(directory.glob(".*.tmp")), "a temporary file was left behind"
    return {p.name.removesuffix(".img") for p in directory.glob("img-*.img")}


# ---- images -----------------------------------------------------------------------------
def test_image_uploads_deletes_gets_of_the_same_ids_agree_across_a_restart(tmp_path) -> None:
    rng = random.Random(45)
    names = ("a", "b")
    ids = {n: image_id(n) for n in names}
    store = ImageStore(fake_prepare, max_images=64, directory=tmp_path)
    stored = {n: False for n in names}

    def call(kind: str, name: str, variant: int) -> bool:
        if kind == "put":  # variant: another file of the same image (memo hit or decode)
            return store.put(name.encode() + bytes([variant])).id == ids[name]
        if kind == "delete":
            return store.delete(ids[name])
        return store.get(ids[name]) is not None

    for _ in range(ROUNDS):
        ops = hammer(plans(rng, ("put", "delete", "get"), names), call)
        listed = {e.image.id for e in store.list()}
        gettable = {i for i in ids.values() if store.info(i) is not None}
        assert listed == gettable == image_files(tmp_path)
        after = {n for n in names if ids[n] in listed}
        check_serial(ops, names, stored, after)
        stored = {n: n in after for n in names}
        store = ImageStore(fake_prepare, max_images=64, directory=tmp_path)  # a restart
        assert {e.image.id for e in store.list()} == listed
        assert all(
            store.get(i).source[:1] == i_name.encode() for i_name, i in ids.items() if i in listed
        )


def test_image_evictions_racing_uploads_and_deletes_leave_no_stray_file(tmp_path) -> None:
    """With a bound smaller than the ids, evictions unlink files of other ids: each in
    that id's own section, never a file of an image that an upload stored again."""
    rng = random.Random(7)
    names = ("a", "b", "c", "d")
    ids = {n: image_id(n) for n in names}
    store = ImageStore(fake_prepare, max_images=2, directory=tmp_path)

    def call(kind: str, name: str, variant: int) -> bool:
        if kind == "put":
            return bool(store.put(name.encode() + bytes([variant])))
        return store.delete(ids[name])

    for _ in range(ROUNDS // 2):
        hammer(plans(rng, ("put", "put", "delete"), names), call)
        listed = {e.image.id for e in store.list()}
        assert len(listed) <= 2
        assert listed == image_files(tmp_path)
        store = ImageStore(fake_prepare, max_images=2, directory=tmp_path)
        assert {e.image.id for e in store.list()} == listed


def test_a_delete_between_an_uploads_check_and_its_commit_is_not_lost(tmp_path) -> None:
    """The issue's interleaving: the upload finds the image stored (its snapshot), a
    delete then removes entry and file, and the upload carries on. Both answer; after
    both, the listing and the file agree (the delete took effect before the upload),
    also after a restart."""
    store = ImageStore(fake_prepare, directory=tmp_path)
    iid = store.put(b"a0").id
    lock = store._lock = PausingLock(store._lock, nth=1, timeout=2.0)
    results: dict[str, object] = {}

    def upload() -> None:
        lock.who = threading.current_thread()
        results["put"] = store.put(b"a0").id  # the same file: the memo says "stored"

    t = threading.Thread(target=upload)
    t.start()
    assert lock.paused.wait(5)  # right after the upload's snapshot
    results["delete"] = store.delete(iid)
    lock.resume.set()
    t.join(5)
    assert results == {"put": iid, "delete": True}
    listed = {e.image.id for e in store.list()}
    assert listed == image_files(tmp_path) == {iid}  # the upload came last: stored
    assert store.get(iid) is not None
    assert {e.image.id for e in ImageStore(fake_prepare, directory=tmp_path).list()} == {iid}


def test_an_upload_during_a_deletes_unlink_is_not_undone(tmp_path, monkeypatch) -> None:
    """A delete that has unlisted the image but not yet unlinked its file, and an upload
    of the same image that answers meanwhile: the delete must not remove the file the
    upload answered for (nor may the upload answer before the delete commits)."""
    store = ImageStore(fake_prepare, directory=tmp_path)
    iid = store.put(b"a0").id
    deleter: list[threading.Thread] = []
    paused, resume = threading.Event(), threading.Event()
    unlink = Path.unlink

    def slow_unlink(self: Path, *args, **kwargs) -> None:
        if threading.current_thread() in deleter and self.name.endswith(".img"):
            paused.set()
            resume.wait(2.0)
        unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", slow_unlink)
    results: dict[str, object] = {}
    t = threading.Thread(target=lambda: results.update(delete=store.delete(iid)))
    deleter.append(t)
    t.start()
    assert paused.wait(5)
    up = threading.Thread(target=lambda: results.update(put=store.put(b"a1").id))
    up.start()
    up.join(0.5)  # a fixed store makes the upload wait for the delete's section
    resume.set()
    t.join(5)
    up.join(5)
    assert results == {"delete": True, "put": iid}
    assert {e.image.id for e in store.list()} == image_files(tmp_path) == {iid}
    assert {e.image.id for e in ImageStore(fake_prepare, directory=tmp_path).list()} == {iid}


def test_http_uploads_deletes_gets_of_one_image_agree_across_a_restart(
    make_engine, tmp_path
) -> None:
    """The routes: POST, DELETE and GET of the same two images from four clients at once
    answer 200 or 404 only, and the answers are those of a serial order; after each
    round the listing, GET and the files agree, and a restarted server lists the same."""
    engine = make_engine(max_total_tokens=4096)
    directory = tmp_path / "images"
    files = {
        n: png_bytes(Image.new("RGB", (8, 8), c))
        for n, c in (("r", (200, 0, 0)), ("g", (0, 200, 0)))
    }
    rng = random.Random(48)
    with app_client(engine, image_store_dir=str(directory)) as c:
        ids = {
            n: c.post("/v1/images", files={"file": ("x.png", f)}).json()["id"]
            for n, f in files.items()
        }
        stored = {n: True for n in files}

        def call(kind: str, name: str, _variant: int) -> bool:
            if kind == "put":
                r = c.post("/v1/images", files={"file": ("x.png", files[name])})
                assert r.status_code == 200 and r.json()["id"] == ids[name], r.text
                return True
            r = (
                c.delete(f"/v1/images/{ids[name]}")
                if kind == "delete"
                else c.get(f"/v1/images/{ids[name]}")
            )
            assert r.status_code in (200, 404), r.text
            return r.status_code == 200

        for _ in range(8):
            ops = hammer(plans(rng, ("put", "delete", "get"), tuple(files)), call)
            listed = {o["id"] for o in c.get("/v1/images").json()["data"]}
            gettable = {i for i in ids.values() if c.get(f"/v1/images/{i}").status_code == 200}
            assert listed == gettable == image_files(directory)
            after = {n for n in files if ids[n] in listed}
            check_serial(ops, tuple(files), stored, after)
            stored = {n: n in after for n in files}
    with app_client(engine, image_store_dir=str(directory)) as c:
        assert {o["id"] for o in c.get("/v1/images").json()["data"]} == listed


def test_http_vision_file_uploads_deletes_gets_agree_with_the_image_store(
    make_engine, tmp_path
) -> None:
    """``/v1/files`` with purpose vision is the image store's section too: uploads,
    deletes and GETs of one picture through ``/v1/files`` and ``/v1/images`` at once answer
    those of a serial order, and the file listing, both GETs and the files on disk agree
    after each round and after a restart."""
    engine = make_engine(max_total_tokens=4096)
    directory = tmp_path / "images"
    data = png_bytes(Image.new("RGB", (8, 8), (10, 20, 30)))
    rng = random.Random(45)
    with app_client(engine, image_store_dir=str(directory)) as c:
        up = c.post("/v1/files", data={"purpose": "vision"}, files={"file": ("a.png", data)})
        iid = up.json()["id"]
        stored = {"a": True}

        def call(kind: str, _name: str, variant: int) -> bool:
            if kind == "put":
                r = (
                    c.post("/v1/files", data={"purpose": "vision"}, files={"file": ("a.png", data)})
                    if variant
                    else c.post("/v1/images", files={"file": ("a.png", data)})
                )
                assert r.status_code == 200 and r.json()["id"] == iid, r.text
                return True
            route = "/v1/files" if variant else "/v1/images"
            r = c.delete(f"{route}/{iid}") if kind == "delete" else c.get(f"{route}/{iid}")
            assert r.status_code in (200, 404), r.text
            return r.status_code == 200

        for _ in range(6):
            ops = hammer(plans(rng, ("put", "delete", "get"), ("a",)), call)
            files = {o["id"] for o in c.get("/v1/files?purpose=vision").json()["data"]}
            gettable = {iid} if c.get(f"/v1/files/{iid}").status_code == 200 else set()
            images = {iid} if c.get(f"/v1/images/{iid}").status_code == 200 else set()
            assert files == gettable == images == image_files(directory)
            after = {"a"} if files else set()
            check_serial(ops, ("a",), stored, after)
            stored = {"a": bool(files)}
    with app_client(engine, image_store_dir=str(directory)) as c:
        assert {o["id"] for o in c.get("/v1/files?purpose=vision").json()["data"]} == files


def test_http_a_delete_between_an_uploads_check_and_its_commit_both_200(
    make_engine, tmp_path
) -> None:
    """The issue's report over HTTP: an upload of a stored image finds it stored, a
    DELETE of it answers 200, then the upload answers 200; the image must then be
    listed, GET-able and on disk (the upload came last), also after a restart."""
    engine = make_engine(max_total_tokens=4096)
    directory = tmp_path / "images"
    png = png_bytes(Image.new("RGB", (8, 8), (0, 0, 200)))
    with app_client(engine, image_store_dir=str(directory)) as c:
        iid = c.post("/v1/images", files={"file": ("x.png", png)}).json()["id"]
        store = c.app.state.mm.store
        lock = store._lock = PausingLock(store._lock, nth=1, timeout=2.0)
        answers: dict[str, int] = {}

        def upload() -> None:
            answers["upload"] = c.post("/v1/images", files={"file": ("x.png", png)}).status_code

        t = threading.Thread(target=upload)
        t.start()
        assert lock.paused.wait(10)  # the upload has taken its snapshot
        answers["delete"] = c.delete(f"/v1/images/{iid}").status_code
        lock.resume.set()
        t.join(10)
        assert answers == {"upload": 200, "delete": 200}
        listed = {o["id"] for o in c.get("/v1/images").json()["data"]}
        assert listed == image_files(directory) == {iid}
        assert c.get(f"/v1/images/{iid}").status_code == 200
    with app_client(engine, image_store_dir=str(directory)) as c:
        assert {o["id"] for o in c.get("/v1/images").json()["data"]} == {iid}


# ---- videos (memory only: no restart) ----------------------------------------------------
def test_video_uploads_deletes_gets_of_the_same_ids_are_serial() -> None:
    rng = random.Random(46)
    names = ("a", "b")
    data = {n: n.encode() * 16 for n in names}
    info = VideoInfo(1, 1.0, 1.0, 2, 2, (0.0,))
    store = VideoStore(max_videos=8)
    stored = {n: False for n in names}

    def call(kind: str, name: str, _variant: int) -> bool:
        if kind == "put":
            return store.put(data[name], info).id == video_id(data[name])
        if kind == "delete":
            return store.delete(video_id(data[name]))
        return store.get(video_id(data[name])) is not None

    for _ in range(ROUNDS):
        ops = hammer(plans(rng, ("put", "delete", "get"), names), call)
        listed = {e.id for e in store.list()}
        assert listed == {video_id(d) for d in data.values() if store.get(video_id(d))}
        after = {n for n in names if video_id(data[n]) in listed}
        check_serial(ops, names, stored, after)
        stored = {n: n in after for n in names}


# ---- /v1/files: uploads, batch outputs, reads, deletes -----------------------------------
def stored_files(directory: Path) -> set[str]:
    assert not list(directory.glob(".*.tmp")), "a temporary file was left behind"
    objects = {p.stem for p in directory.glob("file-*.json")}
    assert objects == {p.stem for p in directory.glob("file-*.jsonl")}, "object xor bytes"
    return objects


def test_files_and_batch_outputs_of_the_same_ids_agree_across_a_restart(tmp_path) -> None:
    rng = random.Random(47)
    fids = ("file-" + "a" * 24, "file-" + "b" * 24)
    big = 1 << 20
    store = FileStore(tmp_path, big)
    stored = {f: False for f in fids}
    sources = tmp_path / "outputs"
    sources.mkdir()

    def call(kind: str, fid: str, variant: int, src: Path | None = None) -> bool:
        try:
            if kind == "put":
                if src is not None:  # a batch output moved into the store
                    return store.publish(fid, src, "out.jsonl")
                return store.add(b'{"n": %d}\n' % variant, "in.jsonl", "batch", fid) != {}
            if kind == "delete":
                store.delete(fid)
                return True
            return store.read(fid).startswith(b'{"n": ')
        except APIError as e:
            assert e.status == 404, e
            return False

    for r in range(ROUNDS):
        work = plans(rng, ("put", "delete", "get"), fids)
        for i, plan in enumerate(work):  # half the puts publish a batch's output file
            for j, (kind, fid, variant) in enumerate(plan):
                if kind == "put" and variant == 0:
                    src = sources / f"{r}-{i}-{j}.jsonl"
                    src.write_bytes(b'{"n": 9}\n')
                    plan[j] = (kind, fid, variant, src)
        ops = hammer(work, call)
        listed = {o["id"] for o in store.list()}
        gettable = set()
        for fid in fids:
            try:
                store.get(fid)
                gettable.add(fid)
            except APIError:
                pass
        assert listed == gettable == stored_files(store.dir)
        after = {f for f in fids if f in listed}
        check_serial(ops, fids, stored, after)
        stored = {f: f in after for f in fids}
        contents = {f: store.read(f) for f in listed}
        store = FileStore(tmp_path, big)  # a restart
        assert {o["id"] for o in store.list()} == listed
        assert {f: store.read(f) for f in listed} == contents
        assert all(store.get(f)["bytes"] == len(contents[f]) for f in listed)


def test_a_read_racing_a_delete_answers_the_bytes_or_404(tmp_path) -> None:
    """The read finds the file listed, a delete then removes it: the read must answer the
    bytes (it came first) or a 404, never a crash on the missing file."""
    store = FileStore(tmp_path, 1 << 20)
    fid = store.add(b'{"a": 1}\n', "in.jsonl", "batch")["id"]
    lock = store._lock = PausingLock(store._lock, nth=1, timeout=2.0)
    results: dict[str, object] = {}

    def read() -> None:
        lock.who = threading.current_thread()
        try:
            results["read"] = store.read(fid)
        except APIError as e:
            results["read"] = e.status
        except OSError as e:
            results["read"] = e

    t = threading.Thread(target=read)
    t.start()
    assert lock.paused.wait(5)  # the read has found the file listed
    done = threading.Thread(target=lambda: results.update(delete=store.delete(fid)))
    done.start()
    done.join(0.5)
    lock.resume.set()
    t.join(5)
    done.join(5)
    assert results["read"] in (b'{"a": 1}\n', 404)
    assert "delete" in results and stored_files(store.dir) == set()
    assert FileStore(tmp_path, 1 << 20).list() == []


def test_a_delete_racing_a_batch_create_on_its_input_is_serial(
    make_engine, tmp_path, monkeypatch
) -> None:
    """A DELETE of a batch's input file while the batch is being created (after the
    create checked the file): both answering 200 fits no serial order (a delete first
    makes the create fail; a create first makes the delete a 409)."""
    engine = make_engine(max_total_tokens=4096)
    paused, resume = threading.Event(), threading.Event()
    check = runner.check_lines

    def slow_check(*args, **kwargs):
        paused.set()
        resume.wait(2.0)
        return check(*args, **kwargs)

    monkeypatch.setattr(runner, "check_lines", slow_check)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "llava-tiny", "messages": [{"role": "user", "content": "Hi"}]},
    }
    with app_client(engine, data_dir=str(tmp_path)) as c:
        fid = c.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", json.dumps(line).encode())},
        ).json()["id"]
        answers: dict[str, int] = {}
        body = {
            "input_file_id": fid,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }

        def create() -> None:
            answers["create"] = c.post("/v1/batches", json=body).status_code

        t = threading.Thread(target=create)
        t.start()
        assert paused.wait(10)  # the create has read its input
        d = threading.Thread(
            target=lambda: answers.update(delete=c.delete(f"/v1/files/{fid}").status_code)
        )
        d.start()
        d.join(0.5)  # a fixed server makes the delete wait for the create's section
        resume.set()
        t.join(10)
        d.join(10)
        assert answers in ({"create": 200, "delete": 409}, {"create": 404, "delete": 200})
        listed = {o["id"] for o in c.get("/v1/files").json()["data"]}
        assert (fid in listed) == (answers["delete"] == 409)


def test_concurrent_uploads_never_pass_the_byte_bound_together(tmp_path) -> None:
    data = b'{"n": 1}\n' * 100
    store = FileStore(tmp_path, 3 * len(data))

    def call(kind: str, _key: str, *_args) -> bool:
        try:
            store.add(data, "in.jsonl", "batch")
            return True
        except APIError as e:
            assert e.code == "file_store_full"
            return False

    ops = hammer([[("put", "x", 0)] * 2 for _ in range(6)], call)
    assert sum(op.result for op in ops) == 3
    assert (
        store.total_bytes()
        == 3 * len(data)
        == sum(p.stat().st_size for p in store.dir.glob("*.jsonl"))
    )


# ---- the primitive -----------------------------------------------------------------------
def test_id_locks_serialise_one_id_run_others_in_parallel_and_forget_idle_ids() -> None:
    locks = IdLocks()
    inside: dict[str, int] = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}
    both = threading.Event()
    guard = threading.Lock()
    ready = threading.Barrier(4)  # all four loop together: a slow thread start is no miss

    def work(key: str) -> None:
        ready.wait(10)
        for _ in range(50):
            with locks.hold(key):
                with guard:
                    inside[key] += 1
                    most[key] = max(most[key], inside[key])
                    if inside["a"] and inside["b"]:
                        both.set()
                time.sleep(0)
                with guard:
                    inside[key] -= 1

    threads = [threading.Thread(target=work, args=(k,)) for k in "abab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most == {"a": 1, "b": 1}  # one thread at a time per id
    assert both.is_set()  # different ids at the same time
    assert len(locks) == 0  # no entry left for ids nobody holds
    with locks.hold("c"):
        assert len(locks) == 1
    assert len(locks) == 0
