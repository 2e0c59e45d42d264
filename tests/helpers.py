"""Helpers the tests import: request builders, the output comparator and the
transformers reference, engine workloads, HTTP shortcuts for ``TestClient`` apps (chat,
uploads, video QA; the apps come from ``tests/live_server.py``'s ``app_client``), and
``mmserve serve --help``'s defaults.

Fixtures (checkpoints, loaded models, engines, photos) live in ``tests/conftest.py``
and are never imported. Three sibling helper modules hold the larger jobs:
``tests/live_server.py`` (a real ``mmserve serve`` process, or the app in-process),
``tests/videos.py`` (tiny test videos encoded with PyAV) and ``tests/cases.py`` (odd and
broken input files). No test imports another ``test_*.py`` module. This module is on the
GPU check's path: nothing here imports FastAPI (tests/test_gpu_bundle.py).
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmserve.cache.kv_pool import KVPool
from mmserve.config import EngineConfig
from mmserve.frontend.frontend import Engine
from mmserve.kernels.flashinfer_backend import flashinfer_import_problem
from mmserve.kernels.metadata import AttentionMetadata, build_metadata
from mmserve.kernels.torch_backend import TorchAttentionBackend
from mmserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples" / "images"
#: ``mmserve serve`` flags for any free port (serve checks its port before the model loads,
#: so an in-process ``main(["serve", ...])`` must not depend on what holds 8000)
ANY_PORT = ("--port", "0")
#: the model families with a tiny checkpoint (``families`` fixture in tests/conftest.py)
TINY_FAMILIES = ("llava", "llava-next", "llava-onevision")
#: Families tested in their own files only (tests/test_llava_next_video.py), not in every
#: cross-family parametrisation: LLaVA-NeXT-Video's images are LLaVA-NeXT's.
OWN_FILE_FAMILIES = ("llava-next-video",)

ENGINE_PROCESS_ENV = "MMSERVE_TEST_ENGINE_PROCESS"


def split_mode() -> bool:
    """Whether :func:`app_client` runs the engine in its own process
    (:data:`ENGINE_PROCESS_ENV`)."""
    return os.environ.get(ENGINE_PROCESS_ENV, "") == "1"


def failing_while(flag: Path, fn):
    """``fn`` that raises ``RuntimeError("injected /secret/path")`` while the file ``flag``
    exists (a fault a test turns on and off)."""

    def wrapped(*args, **kw):
        if flag.exists():
            raise RuntimeError("injected /secret/path")
        return fn(*args, **kw)

    return wrapped


def fail_prefill_engine_main(config, rx, tx, parent, log_level, flag: str) -> None:
    """``mmserve.engine.process.engine_main`` whose engine's prefills fail while the file
    ``flag`` exists (:func:`failing_while`): an engine process's entry point
    (``EngineProcessClient(target=functools.partial(this, flag=...))``)."""
    from mmserve.engine import process

    class FailingPrefill(process.EngineCore):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.runner.prefill = failing_while(Path(flag), self.runner.prefill)

    process.EngineCore = FailingPrefill  # type: ignore[misc]
    process.engine_main(config, rx, tx, parent, log_level)


# ---- requests ----------------------------------------------------------------------


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repository root (what a first import
    loads is only visible there); text output captured, ``timeout`` seconds at most."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def load_peak_rss(model_dir: Path, quantization: str, dtype: str = "bfloat16") -> dict:
    """Memory of ``load_model(model_dir, dtype, quantization)`` in a fresh interpreter
    (Linux): ``before`` (resident bytes once the config and processor are read), ``peak``
    (the peak resident bytes while loading: ``VmHWM``, reset through ``clear_refs`` just
    before, since ``ru_maxrss`` survives ``exec`` and would report the parent's) and
    ``delta`` (peak - before: what loading the weights took at its worst)."""
    code = f"""
import json
from pathlib import Path
import torch
from mmserve.model.loader import load_model, read_front_end
def status(key):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024
read_front_end(Path({str(model_dir)!r}))
Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
before = status("VmRSS:")
m = load_model({str(model_dir)!r}, dtype=torch.{dtype}, quantization={quantization!r})
peak = status("VmHWM:")
print(json.dumps({{"before": before, "peak": peak, "delta": peak - before}}))
"""
    proc = run_python(code, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def png_bytes(im: Image.Image, fmt: str = "PNG") -> bytes:
    """Encode a PIL image (PNG unless ``fmt`` names another Pillow format)."""
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


def safetensors_header(path: Path) -> tuple[int, dict]:
    """``(offset of the data section, header)`` of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def copy_with_flipped_byte(src: Path, dst: Path, tensor: str, byte: int) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` in which one byte of one weight differs:
    byte ``byte`` (negative: from the end) of tensor ``tensor``'s data has its lowest bit
    flipped (one element changes; every other byte, header and file is the same).

    Returns:
        ``dst``.
    """
    shutil.copytree(src, dst)
    for path in sorted(dst.glob("*.safetensors")):
        base, header = safetensors_header(path)
        if tensor not in header:
            continue
        start, end = header[tensor]["data_offsets"]
        at = base + (start + byte if byte >= 0 else end + byte)
        assert base + start <= at < base + end, (tensor, byte)
        with open(path, "r+b") as f:
            f.seek(at)
            old = f.read(1)[0]
            f.seek(at)
            f.write(bytes([old ^ 1]))
        return dst
    raise KeyError(f"{tensor} is in no safetensors file of {src}")


# ---- the comparator (invariant 4 in docs/architecture.md) ------------------------------
#
# Tokens must match, except at a near-tie of the reference: if at the first differing
# step the reference's gap between its top two logits is below ``TIE_EPS``, the two
# runs may legitimately pick different tokens; from there on only that step's logits
# are compared, within ``LOGIT_RTOL`` of the reference's largest logit.

TIE_EPS = 1e-3
LOGIT_RTOL = 1e-3  # of the reference's largest |logit|; fp32 kernels differ by ~1e-5
# Largest |logit difference| accepted between a bf16 and a reference run, as a
# fraction of the reference's largest |logit|. bf16 vs fp32 on the tiny model
# measures up to ~0.021 (tests/test_backends.py); two bf16 kernels should be closer.
BF16_LOGIT_RTOL = 4e-2


def _logits_close(ours: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    ours, ref = ours.float(), ref.float()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(ours)):
        return False, float("inf")
    diff = (ours[finite] - ref[finite]).abs().max().item()
    return diff <= LOGIT_RTOL * max(1.0, ref[finite].abs().max().item()), diff


def assert_same_generation(
    ours_ids: Sequence[int],
    ref_ids: Sequence[int],
    ours_logits: Sequence[torch.Tensor] | None = None,
    ref_logits: Sequence[torch.Tensor] | None = None,
    what: str = "",
) -> None:
    """Assert two greedy generations agree under the near-tie rule.

    Args:
        ours_ids, ref_ids: generated token ids.
        ours_logits, ref_logits: per-step fp32 logits ``[vocab]`` (needed to accept
            a divergence; without them any divergence fails).
        what: label for the failure message.
    """
    for step, (a, b) in enumerate(zip(ours_ids, ref_ids, strict=False)):
        if a == b:
            if ours_logits is not None and ref_logits is not None:
                ok, diff = _logits_close(ours_logits[step], ref_logits[step])
                assert ok, f"{what}: step {step} logits differ by {diff}"
            continue
        assert ours_logits is not None and ref_logits is not None, (
            f"{what}: token {step} differs ({a} vs {b}) and no logits to check a near-tie; "
            f"ours={list(ours_ids)} ref={list(ref_ids)}"
        )
        top2 = torch.topk(ref_logits[step].float(), 2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < TIE_EPS, (
            f"{what}: token {step} differs ({a} vs {b}) but the reference's top-2 gap is "
            f"{gap:.4g} >= {TIE_EPS}; ours={list(ours_ids)} ref={list(ref_ids)}"
        )
        ok, diff = _logits_close(ours_logits[step], ref_logits[step])
        assert ok, f"{what}: near-tie at step {step}, logits differ by {diff}"
        return
    assert len(ours_ids) == len(ref_ids), (
        f"{what}: lengths differ {len(ours_ids)} vs {len(ref_ids)}: {list(ours_ids)} / "
        f"{list(ref_ids)}"
    )


# ---- the transformers reference --------------------------------------------------------


def reference_generate(
    ref_model,
    text: str,
    images: list[Image.Image],
    never: list[int],
    max_new: int = 8,
    videos: list[list[Image.Image]] | None = None,
):
    """transformers' greedy ``generate`` on ``ref_model = (model, processor)``.

    The images of one prompt go in as one nested list (as a chat template hands them;
    LLaVA-OneVision takes its multi-image path only so). Videos (OneVision, NeXT-Video)
    go in as ``pixel_values_videos`` made by our frame preprocessing, each ``<video>``
    placeholder repeated as the processor's ``replace_video_token`` says; with images too
    (NeXT-Video) the processor then expands the image placeholders.

    Returns:
        ``(ids, logits, prompt_len)``: the generated ids, fp32 ``[vocab]`` logits per
        step on the CPU with the ``never`` ids at -inf (as our sampler masks them), and
        the prompt's length in tokens. The inputs go to the model's device.
    """
    model, processor = ref_model
    if videos:
        from mmserve.vision.frames import FramePrep, prepare_frames

        if hasattr(processor, "frame_pixels"):  # LLaVA-NeXT-Video: resize + centre crop
            pixels = [processor.frame_pixels(v)[None] for v in videos]
        else:
            prep = FramePrep.from_processor(processor.video_settings)
            pixels = [prepare_frames(v, prep)[None] for v in videos]  # [1, frames, 3, H, W]
        pieces = text.split(processor.video_token)
        assert len(pieces) == len(pixels) + 1
        text = pieces[0] + "".join(
            processor.replace_video_token({"pixel_values_videos": pv}, 0) + piece
            for pv, piece in zip(pixels, pieces[1:], strict=True)
        )
        extra = {"pixel_values_videos": torch.cat(pixels)}
        if images:  # each image placeholder repeated as ``replace_image_token`` says
            img = processor.image_processor(images=images, return_tensors="pt")
            pieces = text.split(processor.image_token)
            assert len(pieces) == len(images) + 1
            text = pieces[0] + "".join(
                processor.replace_image_token(img, i) + piece for i, piece in enumerate(pieces[1:])
            )
            extra.update(pixel_values=img["pixel_values"], image_sizes=img["image_sizes"])
        inputs = {**processor.tokenizer(text, return_tensors="pt"), **extra}
    else:
        inputs = processor(images=[images] if images else None, text=text, return_tensors="pt")
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new,
            do_sample=False,
            suppress_tokens=never,
            output_logits=True,
            return_dict_in_generate=True,
        )
    n = inputs["input_ids"].shape[1]
    logits = [step[0].float().cpu() for step in out.logits]
    # generate's logits are pre-processor; apply the same mask our sampler uses
    for lg in logits:
        lg[never] = float("-inf")
    return out.sequences[0, n:].tolist(), logits, n


def check_against_reference(
    engine: Engine,
    ref_model,
    messages: list[dict],
    images: list,
    what: str,
    max_new: int = 8,
    videos: list[list] | None = None,
) -> None:
    """Generate greedily on ``engine`` and assert the prompt length and the output equal
    :func:`reference_generate` on ``ref_model`` (under the near-tie rule).

    ``images`` are prepared ``ImageInput`` s; ``videos`` lists of prepared frames.
    """
    text = engine.processor.prompts.render_chat(messages)
    req = engine.processor.make_request(
        messages=messages, images=images, videos=videos or [], params=greedy(max_new)
    )
    (res,) = engine.generate([req])
    frames = [[f.image for f in v] for v in videos] if videos else None
    ref_ids, ref_logits, ref_len = reference_generate(
        ref_model,
        text,
        [i.image for i in images],
        engine.model.never_sample_ids,
        max_new,
        videos=frames,
    )
    assert res.prompt_tokens == ref_len, f"{what}: prompt length {res.prompt_tokens} vs {ref_len}"
    assert_same_generation(res.output_ids, ref_ids, res.logits, ref_logits, what)


# ---- attention kernels --------------------------------------------------------------


def random_batch(page_size: int, mode: str, hq: int, hkv: int, dtype, device="cpu", seed=0):
    """A pool filled with random K/V plus a batch of 4 requests over shuffled pages.

    ``mode``: "prefill" (no cached prefix), "partial" (a cached prefix that ends
    mid-page when ``page_size > 1``) or "decode" (one new token after a prefix).
    Returns ``(pool, meta, q, k, v)``; q/k/v are the new tokens' ``[T, H, 64]``.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    d, layers = 64, 2
    seqs = [rng.randint(2, 40) for _ in range(4)]
    if mode == "prefill":
        prefix = [0] * 4
    elif mode == "decode":
        prefix = [s - 1 for s in seqs]
    else:
        prefix = [rng.randint(1, s - 1) for s in seqs]
    n_pages = sum(-(-s // page_size) for s in seqs) + 3
    pool = KVPool(n_pages, page_size, layers, hkv, d, dtype=dtype, device=device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    ids = list(range(n_pages))
    rng.shuffle(ids)
    tables, at = [], 0
    for s in seqs:
        n = -(-s // page_size)
        tables.append(ids[at : at + n])
        at += n
    extend = [s - p for s, p in zip(seqs, prefix, strict=True)]
    meta = build_metadata(tables, prefix, extend, page_size, device)
    t = sum(extend)

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(t, h, d, generator=gen).to(dtype).to(device)

    return pool, meta, rnd(hq), rnd(hkv), rnd(hkv)


def page_layout(data, page_size: int):
    """Page tables for a batch: a shared prefix (some requests), contiguous or scattered
    own pages, so runs of every length (viewed, gathered, shared) occur."""
    from hypothesis import strategies as st

    n_req = data.draw(st.integers(1, 5), label="requests")
    shared_pages = data.draw(st.integers(0, 160 // page_size), label="shared pages")
    free = list(range(shared_pages, shared_pages + 4000 // page_size))
    if data.draw(st.booleans(), label="scatter"):
        data.draw(st.randoms(use_true_random=False)).shuffle(free)
    tables, prefix, extend = [], [], []
    for _ in range(n_req):
        share = data.draw(st.integers(0, shared_pages), label="shares") if shared_pages else 0
        own = data.draw(st.integers(1, 120), label="own tokens")
        seq = share * page_size + own
        # new tokens never land in shared pages (those hold a cached prefix)
        q_len = data.draw(
            st.one_of(st.just(1), st.integers(1, min(own, 64)), st.just(own)), label="q_len"
        )
        n_pages = -(-seq // page_size)
        tables.append(list(range(share)) + [free.pop() for _ in range(n_pages - share)])
        prefix.append(seq - q_len)
        extend.append(q_len)
    return tables, prefix, extend


# ---- engine workloads shared by cache, scheduling and tensor-parallel tests ---------------

#: EngineConfig fields for "cache on and off" tests: page sizes 1 and 16, radix cache on/off
CACHE_CONFIGS = [
    {"page_size": 1},
    {"page_size": 16},
    {"page_size": 1, "disable_radix_cache": True},
    {"page_size": 16, "disable_radix_cache": True},
]


QUESTIONS = ["What is this?", "What colour is it?", "Is it indoors or outdoors?"]


def workload(imgs: list) -> list[tuple[list[dict], list]]:
    """``(messages, images)`` pairs that share images, a system prompt and a chat history."""
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


def run_workload(make_engine, cases: list, max_tokens: int = 6, **cfg):
    """Generate ``cases`` greedily in one batch on ``make_engine(**cfg)``, check the pool
    accounting after, and return ``(engine, results)``."""
    eng = make_engine(**cfg)
    reqs = [
        eng.processor.make_request(messages=m, images=i, params=greedy(max_tokens))
        for m, i in cases
    ]
    res = eng.generate(reqs)
    eng.scheduler.check_accounting()
    return eng, res


@contextmanager
def tp_engine(model_dir: Path, tp: int = 2, **kw) -> Iterator[Engine]:
    """An Engine whose decoder runs on ``tp`` ranks (gloo on 127.0.0.1); its worker
    processes are stopped afterwards, whatever the test did. float32 unless ``dtype`` is
    given (the fixtures' models, which it is compared with, are float32)."""
    kw.setdefault("dtype", "float32")
    eng = Engine(EngineConfig(model_path=str(model_dir), tp=tp, **kw))
    try:
        yield eng
    finally:
        eng.close()


# ---- HTTP shortcuts for TestClient apps serving the tiny model as "llava-tiny" ----------

MODEL = "llava-tiny"


@dataclass(frozen=True)
class ChatDefaults:
    """Chat completions of one user message with fixed defaults: greedy, ``max_tokens``
    tokens, ``text`` as the message unless a call names another."""

    text: str = "Say hello."
    max_tokens: int = 3

    def body(self, text: str | list | None = None, **kw) -> dict:
        """The request body; ``kw`` adds or overrides fields (``None`` values are sent)."""
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.text if text is None else text}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            **kw,
        }

    def complete(self, client, text: str | list | None = None, **kw) -> dict:
        """POST :meth:`body`; assert a 200 and return the JSON body."""
        r = client.post("/v1/chat/completions", json=self.body(text, **kw))
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, client, text: str | list | None = None, **kw) -> list[dict]:
        """:meth:`body` streamed: the parsed chunks (:func:`stream_chunks`)."""
        return stream_chunks(client, self.body(text, **kw))


def chat(client, content, **kw):
    """POST one user message (``content``: a string or parts) to ``/v1/chat/completions``:
    greedy, 3 tokens unless ``kw`` says otherwise. Returns the response."""
    return client.post("/v1/chat/completions", json=ChatDefaults().body(content, **kw))


def chat_json(client, content, **kw) -> dict:
    """:func:`chat` that must be answered with 200; returns the JSON body."""
    r = chat(client, content, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(client, body: dict) -> list[dict]:
    """POST ``body`` with ``"stream": true`` to ``/v1/chat/completions``; assert a 200 event
    stream that ends with ``data: [DONE]``, and return the chunks before it, parsed."""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def image_part(url: str) -> dict:
    """An OpenAI ``image_url`` content part."""
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    """``data:`` URL of ``data``, base64-encoded."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def upload(client, data: bytes, name: str = "x.png"):
    """POST ``data`` to ``/v1/images`` as a multipart file; returns the response."""
    return client.post("/v1/images", files={"file": (name, data, "application/octet-stream")})


def upload_video(client, data: bytes, name: str = "v.mp4"):
    """POST ``data`` to ``/v1/videos`` as a multipart file; returns the response."""
    return client.post("/v1/videos", files={"file": (name, data, "video/mp4")})


def video_qa(client, vid: str, **body) -> list[dict]:
    """POST ``body`` (greedy unless it says otherwise) to ``/v1/videos/{vid}/qa``; assert
    a 200 whose NDJSON events start with ``frames`` and end with ``summary``; return them."""
    r = client.post(f"/v1/videos/{vid}/qa", json={"temperature": 0.0, **body})
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line]
    assert events[0]["type"] == "frames" and events[-1]["type"] == "summary", events
    return events


def post_stream_frames(client, sid: str, images: Sequence[bytes], timestamps=None, headers=None):
    """POST encoded ``images`` (with ``timestamps``, seconds, when given) to
    ``/v1/streams/{sid}/frames`` as multipart ``file`` / ``timestamp`` fields; returns
    the response."""
    parts: list[tuple] = [("file", (f"f{i}.png", im)) for i, im in enumerate(images)]
    parts += [("timestamp", (None, repr(float(t)))) for t in timestamps or ()]
    return client.post(f"/v1/streams/{sid}/frames", files=parts, headers=headers)


def stream_ask(client, sid: str, questions: Sequence[str], **body) -> dict:
    """POST ``questions`` (and ``body``) to ``/v1/streams/{sid}/ask``; assert a 200 and
    return its JSON."""
    r = client.post(f"/v1/streams/{sid}/ask", json={"questions": list(questions), **body})
    assert r.status_code == 200, r.text
    return r.json()


def wait_stream_held(client, sid: str, frames: int, timeout: float = 60.0) -> dict:
    """Wait until the engine holds stream ``sid``'s prefix over ``frames`` frames (its
    background prefill done); returns ``GET /v1/streams/{sid}``."""
    deadline = time.time() + timeout
    while True:
        info = client.get(f"/v1/streams/{sid}").json()
        held = info["cached"]
        if held["frames"] == frames and not held["pending"]:
            return info
        assert held["error"] is None, info
        assert time.time() < deadline, f"stream {sid} never held {frames} frames: {info}"
        time.sleep(0.05)


def engine_figures(client, headers: dict[str, str] | None = None) -> dict:
    """``GET /v1/cache/stats`` of the app behind ``client`` (a test client or an httpx
    client; ``headers``: its API key): the engine's figures (``vision_tower_images``,
    ``spec_accepted_tokens``...) the same way whether the engine runs in the API process
    or in its own."""
    r = client.get("/v1/cache/stats", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def tower_runs(client, headers: dict[str, str] | None = None) -> int:
    """Images the vision tower of the app behind ``client`` has encoded so far."""
    return int(engine_figures(client, headers)["vision_tower_images"])


def websocket_refusal(client, url: str):
    """The HTTP response that refuses the WebSocket handshake at ``url`` (a Starlette test
    client's ``WebSocketDenialResponse``: ``status_code``, ``headers``, ``json()``); fails
    the test when the handshake is accepted."""
    from starlette.testclient import WebSocketDenialResponse

    with pytest.raises(WebSocketDenialResponse) as got:
        with client.websocket_connect(url):
            pass
    return got.value


def assert_healthy(client) -> None:
    """A normal request is answered and the pool accounting holds at rest."""
    r = chat(client, "Say hello.")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    stats = client.get("/v1/cache/stats").json()
    assert stats["running_requests"] == 0 and stats["live_requests"] == 0
    acc = stats["accounting"]
    assert acc["ok"] and acc["running"] == 0, acc
    assert acc["free"] + acc["tree"] == acc["total"] == stats["pool_pages"]


def assert_error(r, status: int, words: str, code: str | None = None) -> dict:
    """Assert ``r`` is an OpenAI-shaped error with ``status`` whose message contains
    ``words`` (and whose code is ``code`` when given); returns the error object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- the command line ----------------------------------------------------------------


@cache
def serve_help_defaults() -> dict[str, str | None]:
    """``mmserve serve --help`` (run once per session): each option's first flag -> the
    default its help shows (``None`` where it shows none)."""
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    ).stdout
    body = out[out.index("\noptions:") :]
    # an option's entry starts on a line indented by two spaces and a dash
    entries = re.split(r"\n  (?=-)", body)[1:]
    found: dict[str, str | None] = {}
    for entry in entries:
        flat = " ".join(entry.split("\n\n")[0].split())  # not the next section's title
        flag = flat.split()[0].rstrip(",")
        head, sep, default = flat.rpartition("[default: ")
        found[flag] = default.removesuffix("]") if sep else None
    return found


# ---- GPU tests (tests/gpu) -----------------------------------------------------------------

#: whether torch sees a CUDA device
CUDA_AVAILABLE = torch.cuda.is_available()
#: why FlashInfer cannot run here, or None (the import is tried only where CUDA is)
FLASHINFER_PROBLEM = flashinfer_import_problem() if CUDA_AVAILABLE else "no CUDA GPU"
needs_cuda = pytest.mark.skipif(
    not CUDA_AVAILABLE, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
needs_flashinfer = pytest.mark.skipif(
    FLASHINFER_PROBLEM is not None, reason=f"flashinfer unavailable: {FLASHINFER_PROBLEM}"
)


def cuda_engine(model_dir: Path | str, **kw) -> Engine:
    """An engine that loads the checkpoint itself, on CUDA (no pre-loaded CPU model), with
    an 8192-token pool; ``kw`` are more EngineConfig fields."""
    return Engine(
        EngineConfig(model_path=str(model_dir), device="cuda", max_total_tokens=8192, **kw)
    )


class FakeFlashInfer:
    """A stand-in ``flashinfer`` module for the CPU: its decode wrapper keeps FlashInfer's
    CUDA-graph contract (``use_cuda_graph=True``: fixed ``[B + 1]`` / ``[B]`` indptr and
    last-page buffers, a page-index buffer at least as long as any plan's indices, ``plan``
    copies into them; ``run`` reads only those buffers, as a replayed graph would) and
    attends with the torch backend's literal path. Decode only (the prefill wrapper is
    built, never planned). ``plans`` records each plan's ``(wrapper, indptr device,
    last_page_len device)``."""

    def __init__(self) -> None:
        self.plans: list[tuple[object, str, str]] = []
        fake = self

        class Wrapper:
            def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **kw) -> None:
                self.graph = use_cuda_graph
                self.indptr = kw.get("paged_kv_indptr_buffer")
                self.indices = kw.get("paged_kv_indices_buffer")
                self.last = kw.get("paged_kv_last_page_len_buffer")
                if use_cuda_graph:
                    assert len(self.indptr) == len(self.last) + 1, "indptr must be [B + 1]"

            def plan(self, indptr, indices, last, hq, hkv, d, page_size, **kw) -> None:
                fake.plans.append((self, indptr.device.type, last.device.type))
                self.page_size = page_size
                if not self.graph:
                    self.indptr, self.indices, self.last = indptr, indices, last
                    return
                assert len(last) == len(self.last), "the batch size is fixed in graph mode"
                assert len(indices) <= len(self.indices), "indices exceed the buffer"
                self.indptr.copy_(indptr)
                self.last.copy_(last)
                self.indices[: len(indices)].copy_(indices)

            def run(self, q, kv, k_scale=None, v_scale=None) -> torch.Tensor:
                k_buf, v_buf = kv
                n = len(self.last)
                pages = (self.indptr[1:] - self.indptr[:-1]).tolist()
                seq = [
                    (p - 1) * self.page_size + int(x) for p, x in zip(pages, self.last, strict=True)
                ]
                meta = AttentionMetadata(
                    torch.arange(n + 1, dtype=torch.int32), self.indptr.clone(),
                    self.indices[: int(self.indptr[-1])].clone(), self.last.clone(),
                    self.page_size, torch.zeros(n, dtype=torch.int64),
                    torch.zeros(n, dtype=torch.int64), seq, [1] * n, True,
                )  # fmt: skip
                ref = TorchAttentionBackend(views=False)
                ref.plan(meta)
                flat = lambda b: b.view(-1, *b.shape[2:])  # noqa: E731
                scales = (k_scale or 1.0, v_scale or 1.0)  # what FlashInfer's run takes
                pool = types.SimpleNamespace(scales=lambda _layer: scales)
                return ref._attend(q, flat(k_buf), flat(v_buf), 0, pool)

        self.BatchDecodeWithPagedKVCacheWrapper = Wrapper
        self.BatchPrefillWithPagedKVCacheWrapper = Wrapper  # built, never planned here


# ---- documented commands (tests/test_doc_examples.py) ------------------------------------

#: the line that marks the fenced ```bash or ```python block right after it as run by
#: tests/test_doc_examples.py against a live server (CONTRIBUTING.md)
DOCTEST_MARKER = "<!-- doctest -->"
#: the pages whose marked examples are run (a missing page is skipped)
DOC_PAGES = (ROOT / "README.md", ROOT / "docs" / "api.md", ROOT / "docs" / "video.md")
#: the sample files every marked block may assume stored (uploaded again before each
#: block: a block may delete them), with the placeholder of their id in the docs
DOC_UPLOADS = (
    ("images", SAMPLES / "cat.png", "img-caf8…"),
    ("videos", ROOT / "samples" / "video" / "pans.mp4", "vid-48ba…"),
)
#: the server address the docs use (the first command's ``mmserve serve --port 8000``)
DOC_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class DocExample:
    """One marked fenced block of a documentation page.

    Attributes:
        path: the page.
        line: 1-based line of the opening fence.
        lang: "bash" or "python".
        code: the block's text, without the fences.
    """

    path: Path
    line: int
    lang: str
    code: str

    @property
    def where(self) -> str:
        """``README.md:123``: the page and the fence's line, for failure messages."""
        return f"{self.path.name}:{self.line}"


def doc_examples(paths: Sequence[Path] = DOC_PAGES) -> list[DocExample]:
    """The blocks marked with :data:`DOCTEST_MARKER` in ``paths``, in page order;
    pages that do not exist are skipped.

    Raises:
        ValueError: a marker not directly followed by a ```bash or ```python fence, or
            a fence never closed (the message names the page and line).
    """
    found = []
    for path in paths:
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != DOCTEST_MARKER:
                continue
            fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
            lang = fence.removeprefix("```").split(" ")[0]
            if not fence.startswith("```") or lang not in ("bash", "python"):
                want = "```bash or ```python"
                raise ValueError(f"{path.name}:{i + 1}: {DOCTEST_MARKER} must precede {want}")
            try:
                end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            except StopIteration:
                raise ValueError(f"{path.name}:{i + 2}: the fence is never closed") from None
            found.append(DocExample(path, i + 2, lang, "\n".join(lines[i + 2 : end]) + "\n"))
    return found


def upload_doc_samples(url: str) -> dict[str, str]:
    """Store :data:`DOC_UPLOADS` on the server at ``url`` (idempotent: same bytes, same
    id); returns ``{placeholder: id}``.

    Raises:
        AssertionError: an id does not start as its placeholder says (the docs'
            ``img-caf8…`` must be the sample photo's id).
    """
    import urllib.request

    ids = {}
    for route, path, placeholder in DOC_UPLOADS:
        body = json.dumps({"data": base64.b64encode(path.read_bytes()).decode()}).encode()
        req = urllib.request.Request(
            f"{url}/v1/{route}", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["id"]
        assert got.startswith(placeholder.removesuffix("…")), (placeholder, got)
        ids[placeholder] = got
    return ids


def shown_outputs(code: str) -> list[str]:
    """The JSON a bash block shows as a command's output: comments that start with
    ``{`` (``# {"id":"img-…",…}``), whole-line or after a command."""
    return [m.group(1) for m in re.finditer(r"#\s*(\{.*)$", code, re.M)]


def _json_documents(text: str) -> list[object]:
    """Every JSON object in ``text`` (curl prints one after another, NDJSON a line each)."""
    decoder, docs, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) != -1:
        try:
            doc, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        docs.append(doc)
        i = end
    return docs


def _pairs(doc: object) -> tuple[set[str], set[tuple[str, str]]]:
    """Every key in ``doc`` at any depth, and every ``(key, string value)`` pair."""
    keys, strings = set(), set()
    stack = [doc]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            for k, v in d.items():
                keys.add(k)
                if isinstance(v, str):
                    strings.add((k, v))
                stack.append(v)
        elif isinstance(d, list):
            stack.extend(d)
    return keys, strings


def output_shape_problems(code: str, stdout: str) -> list[str]:
    """How ``stdout`` of a bash block differs from the output its comments show: each
    shown object must match one JSON object printed, which has every key the comment
    names and the same value for each string the comment spells out (``…`` elides;
    numbers are not compared: ids, sizes and timings vary)."""
    printed = [_pairs(d) for d in _json_documents(stdout)]
    problems = []
    for shown in shown_outputs(code):
        keys = set(re.findall(r'"(\w+)"\s*:', shown))
        strings = {(k, v) for k, v in re.findall(r'"(\w+)"\s*:\s*"([^"…\\]*)"', shown)}
        if any(keys <= k and strings <= s for k, s in printed):
            continue
        # name what the closest printed object lacks
        lacks = min(
            (
                [*sorted(keys - k), *sorted(f"{a}={b!r}" for a, b in strings - s)]
                for k, s in printed
            ),
            key=len,
            default=["any JSON object"],
        )
        problems.append(f"the output lacks {', '.join(lacks)} of {shown[:80]}")
    return problems


def run_doc_examples(examples: Sequence[DocExample], url: str, timeout: float = 120) -> list[str]:
    """Run ``examples`` against the server at ``url`` as a reader would paste them, from the
    repository root, each within ``timeout`` seconds; returns one message per failure
    (empty: all passed).

    The docs' ``http://127.0.0.1:8000`` and sample ids (:data:`DOC_UPLOADS`) are replaced
    by ``url`` and the real ids, and the samples are uploaded again before each block.
    A bash block runs under ``set -eo pipefail`` with ``curl`` failing on an HTTP error
    (``--fail-with-body``), and its output must have the shape its comments show
    (:func:`output_shape_problems`). The Python blocks of a page run in order in one
    interpreter (later blocks use the names earlier ones define, as a reader's session
    does); each must not raise.
    """
    import os

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    failures = []
    python: list[tuple[str, str]] = []
    for ex in examples:
        subs = {DOC_URL: url, **upload_doc_samples(url)}
        code = ex.code
        for old, new in subs.items():
            code = code.replace(old, new)
        if ex.lang == "python":
            python.append((ex.where, code))
            continue
        script = 'set -eo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n' + code
        try:
            r = subprocess.run(
                ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            failures.append(f"{ex.where}: did not finish in {timeout} s")
            continue
        if r.returncode != 0:
            failures.append(f"{ex.where}: exit {r.returncode}: {(r.stdout + r.stderr)[-600:]}")
            continue
        failures += [f"{ex.where}: {p}" for p in output_shape_problems(code, r.stdout)]
    if python:
        failures += _run_python_blocks(python, url, env, timeout)
    return failures


#: the interpreter that runs a page's Python blocks: each block after the samples are
#: uploaded again, under an alarm; one JSON line per block
_PY_RUNNER = """
import json, signal, sys, traceback
from tests.helpers import upload_doc_samples
blocks, url, timeout = json.loads(sys.stdin.read())
def alarm(*_):
    raise TimeoutError(f"did not finish in {timeout} s")
signal.signal(signal.SIGALRM, alarm)
ns = {"__name__": "__main__"}
for where, code in blocks:
    try:
        upload_doc_samples(url)
        signal.alarm(int(timeout))
        exec(compile(code, where, "exec"), ns)
        signal.alarm(0)
        print(json.dumps({"where": where, "error": None}), file=sys.__stderr__)
    except BaseException:
        signal.alarm(0)
        error = traceback.format_exc(limit=-3)[-600:]
        print(json.dumps({"where": where, "error": error}), file=sys.__stderr__)
"""


def _run_python_blocks(
    blocks: list[tuple[str, str]], url: str, env: dict, timeout: float
) -> list[str]:
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PY_RUNNER], input=json.dumps([blocks, url, timeout]),
            cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
            timeout=timeout * (len(blocks) + 1),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return [f"{blocks[0][0]}...: the Python blocks did not finish"]
    results = {}
    for line in r.stderr.splitlines():
        if line.startswith('{"where"'):
            rec = json.loads(line)
            results[rec["where"]] = rec["error"]
    failures = []
    for where, _ in blocks:
        if where not in results:
            failures.append(f"{where}: never ran (exit {r.returncode}): {r.stderr[-600:]}")
        elif results[where] is not None:
            failures.append(f"{where}: {results[where]}")
    return failures


# ---- races: stores under concurrent calls on the same ids --------------------------------
@dataclass
class StoreOp:
    """One completed operation on one id of a store, for :func:`linearizable`.

    Attributes:
        kind: "put" (the id is stored afterwards), "delete" or "get".
        start, end: ``time.perf_counter_ns()`` before the call and after it returned.
        result: for "delete", whether it found the id (200, not 404); for "get", whether
            the id was found; ignored for "put".
        key: which id (or name of one) it was about.
    """

    kind: str
    start: int
    end: int
    result: bool = True
    key: str = ""


def linearizable(ops: Sequence[StoreOp], before: bool, after: bool) -> bool:
    """Whether some serial order of ``ops`` explains every result and leaves the id
    stored iff ``after``, starting stored iff ``before``, keeping real-time order (an
    operation that returned before another started comes first). Wing and Gong's search
    over (operations left, stored?) with a memo; fine for a few dozen operations."""
    ops = list(ops)

    @cache
    def search(left: frozenset[int], stored: bool) -> bool:
        if not left:
            return stored == after
        horizon = min(ops[i].end for i in left)
        for i in left:
            op = ops[i]
            if op.start > horizon:  # something left returned before this one started
                continue
            if op.kind != "put" and op.result != stored:
                continue
            nxt = True if op.kind == "put" else False if op.kind == "delete" else stored
            if search(left - {i}, nxt):
                return True
        return False

    return search(frozenset(range(len(ops))), before)


def hammer(plans: Sequence[Sequence[tuple]], call, timeout: float = 30.0) -> list[StoreOp]:
    """Run each plan (a list of ``(kind, key, *args)``) on its own thread, all starting
    together; ``call(kind, key, *args)`` does one operation and returns its result.
    Returns every operation as a :class:`StoreOp` (``list.append`` is atomic).

    Raises:
        the first exception a call raised; AssertionError if a thread is still running
        after ``timeout`` seconds.
    """
    done: list[StoreOp] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(len(plans))

    def worker(plan: Sequence[tuple]) -> None:
        try:
            gate.wait()
            for kind, key, *args in plan:
                t0 = time.perf_counter_ns()
                result = call(kind, key, *args)
                done.append(StoreOp(kind, t0, time.perf_counter_ns(), bool(result), key))
        except BaseException as e:  # noqa: BLE001 (raised again in the calling thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,), daemon=True) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a store operation hung"
    if errors:
        raise errors[0]
    return done


class PausingLock:
    """Wraps a store's lock: the thread ``who`` (None: any thread) pauses right after it
    releases the lock for the ``nth`` time (setting ``paused``), until ``resume`` is set
    or ``timeout`` seconds pass (a fixed store makes the other side wait for this
    thread, so the pause must end by itself)."""

    def __init__(self, inner, nth: int = 1, timeout: float = 0.5) -> None:
        self.inner = inner
        self.nth = nth
        self.timeout = timeout
        self.who: threading.Thread | None = None
        self.count = 0
        self.paused = threading.Event()
        self.resume = threading.Event()

    def acquire(self, *args, **kwargs) -> bool:
        return self.inner.acquire(*args, **kwargs)

    def release(self) -> None:
        self.inner.release()
        if self.who is None or threading.current_thread() is self.who:
            self.count += 1
            if self.count == self.nth:
                self.paused.set()
                self.resume.wait(self.timeout)

    def __enter__(self) -> PausingLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def decoder_key_prefix(model_dir: Path) -> str:
    """A checkpoint's key prefix before ``layers.`` of the decoder (where its KV scale
    tensors go), read from the safetensors headers."""
    from safetensors import safe_open

    from mmserve.model.weights import weight_files

    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if ".layers.0.self_attn.k_proj.weight" in key and "vision" not in key:
                    return key.split("layers.0.")[0]
    raise AssertionError("no decoder layer 0")


@contextmanager
def fake_hub(status: int, error_code: str) -> Iterator[str]:
    """A Hugging Face Hub endpoint on 127.0.0.1 that answers every request with ``status``
    and the ``X-Error-Code`` header ``error_code`` ("RepoNotFound", "RevisionNotFound",
    "GatedRepo"), as the Hub does; yields its URL (for ``HF_ENDPOINT``), stopped after."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = json.dumps({"error": f"{error_code} (fake hub)"}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", f"{error_code} (fake hub)")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = _answer  # http.server's method names

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


#: the passage the quoting checkpoints copy (tests/test_spec_decode.py, benchmarks spec)
QUOTE = "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat."


def quoting_loaded(loaded, model_dir: Path, passage: str = QUOTE):
    """``loaded`` edited by :func:`mmserve.testing.copying.quoting_model` so that its greedy
    answer to any chat prompt quotes ``passage`` (the start token is the chat template's
    last prompt token)."""
    from mmserve.testing.copying import quoting_model

    eng = Engine(EngineConfig(model_path=str(model_dir)), model=loaded)
    start = eng.processor.make_request(messages=user("x"), images=[]).input_ids[-1]
    ids = loaded.tokenizer.encode(passage, add_special_tokens=False)
    return quoting_model(loaded, ids, start)


def spy_on_submitted(app, seen) -> None:
    """Call ``seen(req)`` with every :class:`~mmserve.types.EngineRequest` the app hands
    its engine (``app.state.mm.aengine.stream``): the same in one process and with the
    engine in its own process (the request crosses as it is)."""
    aengine = app.state.mm.aengine
    stream = aengine.stream

    def spy(req, *args, **kw):
        seen(req)
        return stream(req, *args, **kw)

    aengine.stream = spy
