"""Seeded benchmark workloads (same seed, same bytes), their sizes per scale, and the
offline-optimal hit rate (SGLang, arXiv 2312.07104, Theorem 3.1: each node of the token
trie of all prompts is computed once, so ``1 - trie nodes / prompt tokens``)."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_DIR = ROOT / "samples" / "images"
PHOTOS = ("astronaut.png", "cat.png", "coffee.png", "rocket.jpg")
SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
#: llava-bench-in-the-wild style questions (conversation, detail, reasoning).
QUESTIONS = (
    "What is the main object in this image?",
    "Describe this photo in detail.",
    "What colors dominate the picture?",
    "How many people or animals can you see?",
    "What time of day does it appear to be?",
    "What might have happened just before this photo was taken?",
    "Is there any text visible in the image? What does it say?",
    "What is unusual about this image?",
    "Where could this photo have been taken?",
    "What emotions does this scene evoke?",
    "Write a short caption for this image.",
    "What materials are the objects in the picture made of?",
    "Describe the background of the image.",
    "What would you do if you were in this scene?",
    "Explain the lighting in this photograph.",
    "Which object is closest to the camera?",
)
FOLLOW_UPS = (
    "Can you tell me more about that?",
    "Why do you think so?",
    "What else is in the picture?",
    "Is it safe? Explain briefly.",
    "Summarize our conversation so far.",
    "What would change at night?",
    "Give one more detail.",
    "Which part is the most interesting?",
)
#: Fixed assistant turns of multi_turn's history (by turn), so prompts never depend on
#: what a system generated.
CANNED_ANSWERS = (
    "The photo shows the main subject in the center, with a plain background.",
    "Because of the shapes and the colors, which are typical for this kind of scene.",
    "There are a few smaller objects near the edges of the frame.",
    "It looks safe; nothing in the picture suggests any danger.",
    "We talked about the subject, the colors and the details of the photo.",
    "At night the colors would be darker and the lights would stand out.",
    "The texture of the surface is visible in the lower part of the image.",
)
WORDS = (
    "apple river stone cloud garden window yellow quiet market bridge forest candle silver "
    "engine harbor pencil winter violin desert planet ladder mirror orange thunder basket "
    "marble jungle rocket saddle meadow tunnel falcon copper lantern island velvet canyon "
    "meteor pillow glacier trumpet compass blossom dragon puzzle feather horizon"
).split()


@dataclass
class Prompt:
    """One request: chat messages (an image is a ``{"type": "image"}`` part) and the names
    (keys of :attr:`Workload.images`) of the images filling those parts, in order."""

    messages: list[dict]
    images: list[str]


@dataclass
class Workload:
    """Requests in ``rounds`` (round ``r + 1`` starts when round ``r`` ends), the encoded
    ``images`` they use by name, ``max_tokens`` per answer (``ignore_eos``: exactly this
    many), the generator's ``params``, and ``sessions``: chains of indices into
    :attr:`prompts` that closed-loop drivers send in order (empty: an open workload)."""

    name: str
    description: str
    images: dict[str, bytes]
    rounds: list[list[Prompt]]
    max_tokens: int
    params: dict = field(default_factory=dict)
    sessions: list[list[int]] = field(default_factory=list)

    @property
    def prompts(self) -> list[Prompt]:
        """All requests in submission order."""
        return [p for r in self.rounds for p in r]

    @property
    def num_requests(self) -> int:
        """Number of requests."""
        return sum(len(r) for r in self.rounds)


def trie_size(seqs: Sequence[Sequence[int]]) -> int:
    """Nodes (root excluded) of the token trie of ``seqs``: ``sum(len) - sum(lcp)`` of
    lexicographic neighbours, O(total tokens)."""
    nodes, prev = 0, ()
    for s in sorted(tuple(s) for s in seqs):
        n = min(len(s), len(prev))
        i = next((j for j in range(n) if s[j] != prev[j]), n)
        nodes, prev = nodes + len(s) - i, s
    return nodes


def optimal_hit_rate(seqs: Sequence[Sequence[int]]) -> dict[str, float]:
    """``total_tokens``, ``distinct_tokens`` (trie nodes) and ``optimal_hit_rate`` (``1 -
    distinct / total``, 0 for no tokens) of prompts ``seqs`` (image pseudo-ids included)."""
    total, distinct = sum(len(s) for s in seqs), trie_size(seqs)
    rate = 1.0 - distinct / total if total else 0.0
    return {"total_tokens": total, "distinct_tokens": distinct, "optimal_hit_rate": rate}


def png(im: Image.Image) -> bytes:
    """``im`` encoded as PNG."""
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


#: Orientations of copy ``j`` of a sample photo (entry ``j - 1``; past them, shifted
#: pixel values): other pixels, so another key.
_VARIANTS = [Image.Transpose[n] for n in "TRANSPOSE ROTATE_180 FLIP_TOP_BOTTOM".split()]
_VARIANTS += [Image.Transpose[n] for n in "ROTATE_90 ROTATE_270 FLIP_LEFT_RIGHT TRANSVERSE".split()]


def photos(k: int) -> dict[str, bytes]:
    """``k`` distinct real images by name: the sample photos, then flipped, rotated and
    (past seven orientations) tinted PNG copies of them."""
    out: dict[str, bytes] = {}
    for i in range(k):
        name, j = PHOTOS[i % len(PHOTOS)], i // len(PHOTOS)
        if j == 0:
            out[name] = (SAMPLES_DIR / name).read_bytes()
            continue
        im = Image.open(SAMPLES_DIR / name).convert("RGB")
        im = im.transpose(_VARIANTS[(j - 1) % len(_VARIANTS)])
        if j > len(_VARIANTS):
            im = im.point(lambda v, s=j: (v + s) % 256)
        out[f"{Path(name).stem}-v{j}.png"] = png(im)
    return out


def pan_frames(num_frames: int, repeat_every: int = 3, size: int = 336) -> list[bytes]:
    """Frames (PNG) of a camera pan across ``astronaut.png``: a square of 3/4 of its side
    slides from the top-left to the bottom-right corner, resized to ``size``; frame ``i``
    with ``i % repeat_every == repeat_every - 1`` repeats frame ``i - 1`` (a static shot;
    0 = no repeats)."""
    src = Image.open(SAMPLES_DIR / "astronaut.png").convert("RGB")
    w, h = src.size
    side = min(w, h) * 3 // 4
    repeat = [
        repeat_every > 0 and i > 0 and i % repeat_every == repeat_every - 1
        for i in range(num_frames)
    ]
    steps = max(repeat.count(False) - 1, 1)
    frames: list[bytes] = []
    for i in range(num_frames):
        if repeat[i]:
            frames.append(frames[-1])
            continue
        pos = len(frames) - sum(repeat[:i])
        x, y = (w - side) * pos // steps, (h - side) * pos // steps
        crop = src.crop((x, y, x + side, y + side))
        frames.append(png(crop.resize((size, size), Image.Resampling.BICUBIC)))
    return frames


def noise_image(rng: np.random.Generator, size: int) -> bytes:
    """A ``size`` x ``size`` RGB noise PNG."""
    return png(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB"))


def data_url(data: bytes) -> str:
    """``data:<mime>;base64,...`` of encoded PNG or JPEG bytes."""
    mime = "image/jpeg" if data.startswith(b"\xff\xd8") else "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def openai_messages(p: Prompt, urls: dict[str, str]) -> list[dict]:
    """``p``'s messages in the OpenAI shape: each image part becomes an ``image_url`` part
    with ``urls[name]`` (a data URL or an uploaded image's id)."""
    names = iter(p.images)
    out = []
    for m in p.messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": urls[next(names)]}}
                if part.get("type") == "image"
                else part
                for part in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


def _pick(rnd: random.Random, pool: Sequence[str], n: int) -> list[str]:
    """``n`` items of ``pool``, without repeats while possible, then cycling."""
    items, out = list(pool), []
    while len(out) < n:
        rnd.shuffle(items)
        out.extend(items[: n - len(out)])
    return out


def ask(question: str, system: bool = True) -> list[dict]:
    """Messages asking ``question`` about one image (after the system prompt if ``system``)."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    return msgs + [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]


def many_questions(
    k: int, m: float, max_tokens: int, seed: int = 0, name: str = "many_questions"
) -> Workload:
    """``k`` photos x ``m`` questions each (``round(k * m)`` in all, spread evenly when
    ``m`` is fractional: ``llava_bench``, the SGLang paper's llava-bench-in-the-wild shape),
    shared system prompt, one round in shuffled order."""
    rnd = random.Random(seed)
    imgs = photos(k)
    total = max(k, round(k * m))
    prompts = [
        Prompt(ask(q), [n])
        for i, n in enumerate(imgs)
        for q in _pick(rnd, QUESTIONS, total // k + (i < total % k))
    ]
    rnd.shuffle(prompts)
    desc = f"{k} images x {m:g} questions each ({total} requests, llava-bench style), shared "
    desc += "system prompt, submitted at once in shuffled order"
    params = {"images": k, "questions_per_image": m, "max_tokens": max_tokens, "seed": seed}
    return Workload(name, desc, imgs, [prompts], max_tokens, params)


def multi_turn(c: int, t: int, max_tokens: int, seed: int = 0) -> Workload:
    """``c`` chat sessions x ``t`` turns, each session with its own photo in its first turn;
    round ``r`` holds turn ``r`` of every session (shuffled), :attr:`Workload.sessions`
    each session's turns. The history holds :data:`CANNED_ANSWERS`."""
    rnd = random.Random(seed)
    imgs = photos(c)
    names = list(imgs)
    asked = [[rnd.choice(QUESTIONS), *_pick(rnd, FOLLOW_UPS, t - 1)] for _ in range(c)]
    rounds, chains = [], [[0] * t for _ in range(c)]
    for turn in range(t):
        batch = []
        for s in range(c):
            msgs = ask(asked[s][0])
            for j in range(1, turn + 1):
                msgs.append({"role": "assistant", "content": CANNED_ANSWERS[(j - 1) % 7]})
                msgs.append({"role": "user", "content": asked[s][j]})
            batch.append((s, Prompt(msgs, [names[s]])))
        rnd.shuffle(batch)
        for i, (s, _) in enumerate(batch):
            chains[s][turn] = turn * c + i
        rounds.append([p for _, p in batch])
    desc = f"{c} chat sessions x {t} turns, each session with its own photo in the first turn; "
    desc += "closed loop: a session sends its next turn when its previous answer arrives"
    params = {"sessions": c, "turns": t, "max_tokens": max_tokens, "seed": seed}
    return Workload("multi_turn", desc, imgs, rounds, max_tokens, params, chains)


def video_frames(f: int, q: int, max_tokens: int, seed: int = 0, repeat_every: int = 3) -> Workload:
    """``f`` frames of :func:`pan_frames` x ``q`` questions per frame, one shuffled round."""
    rnd = random.Random(seed)
    imgs = {f"frame{i:03d}": b for i, b in enumerate(pan_frames(f, repeat_every))}
    questions = _pick(rnd, QUESTIONS, q)
    prompts = [Prompt(ask(question), [n]) for n in imgs for question in questions]
    rnd.shuffle(prompts)
    desc = f"{f} video frames x {q} questions per frame (per-frame QA), submitted at once"
    params = {"frames": f, "questions_per_frame": q, "max_tokens": max_tokens, "seed": seed}
    return Workload("video_frames", desc, imgs, [prompts], max_tokens, params)


def no_sharing(n: int, max_tokens: int, seed: int = 0, image_size: int = 336) -> Workload:
    """``n`` requests with distinct noise images and random word texts, no system prompt:
    only the chat template's first tokens are shared."""
    rnd, rng = random.Random(seed), np.random.default_rng(seed)
    imgs, prompts = {}, []
    for i in range(n):
        imgs[name := f"noise{i:03d}"] = noise_image(rng, image_size)
        lead = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 10)))
        tail = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(6, 14)))
        content = [
            {"type": "text", "text": f"{lead.capitalize()}: "},
            {"type": "image"},
            {"type": "text", "text": f"{tail}?"},
        ]
        prompts.append(Prompt([{"role": "user", "content": content}], [name]))
    desc = f"{n} requests with distinct random-noise images and random texts (overhead check)"
    params = {"requests": n, "max_tokens": max_tokens, "seed": seed}
    return Workload("no_sharing", desc, imgs, [prompts], max_tokens, params)


def questions_about(
    images: dict[str, bytes], questions: int, max_tokens: int, seed: int | None = 0
) -> Workload:
    """``questions`` of :data:`QUESTIONS` (no system prompt) about each image, one round:
    shuffled with ``seed``, or round-robin for None (every image's first question, then
    every second, ...: by an image's next question a small pool has evicted it)."""
    order = [(k, n) for k in range(questions) for n in images]
    prompts = [Prompt(ask(QUESTIONS[k % len(QUESTIONS)], system=False), [n]) for k, n in order]
    if seed is not None:
        random.Random(seed).shuffle(prompts)
    desc, params = f"{len(images)} images x {questions} questions", {"questions": questions}
    params.update(images=len(images), max_tokens=max_tokens, seed=seed)
    return Workload("questions", desc, images, [prompts], max_tokens, params)


def interleaved(k: int, m: int, c: int, t: int, max_tokens: int, seed: int = 0) -> Workload:
    """:func:`many_questions` (``k`` x ``m``) and :func:`multi_turn` (``c`` x ``t``, on
    photos ``k .. k + c - 1``, so no image is shared) mixed: every question is a
    one-request session, and the sessions come in a seeded shuffled order."""
    mq, mt = many_questions(k, m, max_tokens, seed), multi_turn(c, t, max_tokens, seed + 1)
    imgs = photos(k + c)
    rename = dict(zip(mt.images, list(imgs)[k:], strict=True))
    turns = [Prompt(p.messages, [rename[n] for n in p.images]) for p in mt.prompts]
    q = mq.num_requests
    chains = [[i] for i in range(q)] + [[q + i for i in s] for s in mt.sessions]
    random.Random(seed).shuffle(chains)
    desc = f"{k} images x {m} questions and {c} sessions x {t} turns, interleaved"
    params = {"images": k, "questions": m, "sessions": c, "turns": t, "max_tokens": max_tokens}
    return Workload("interleaved", desc, imgs, [mq.prompts + turns], max_tokens, params, chains)


FACTORIES: dict[str, Any] = {
    "many_questions": many_questions,
    "llava_bench": lambda k, m, n, seed: many_questions(k, m, n, seed, "llava_bench"),
    "multi_turn": multi_turn,
    "video_frames": video_frames,
    "no_sharing": no_sharing,
}

#: Sizes per suite and scale: a workload's generator arguments before ``max_tokens``.
#: ``engine`` (in-process; ``baseline_max``: transformers requests per workload,
#: ``repeats``: on/off pairs on no_sharing, ``sweep_points``: KV-pool sizes) and ``http``
#: (``rates``: offered req/s, inf = a burst).
SCALES: dict[str, dict[str, dict[str, Any]]] = {
    "engine": {
        "ci": dict(many_questions=(2, 2), multi_turn=(2, 2), video_frames=(3, 1),
                   no_sharing=(2,), max_tokens=2, baseline_max=2, repeats=1, sweep_points=2),
        "quick": dict(many_questions=(3, 6), multi_turn=(4, 4), video_frames=(6, 2),
                      no_sharing=(4,), max_tokens=8, baseline_max=6, repeats=4, sweep_points=3),
        "full": dict(many_questions=(4, 10), multi_turn=(8, 5), video_frames=(16, 4),
                     no_sharing=(12,), max_tokens=16, baseline_max=None, repeats=3,
                     sweep_points=6),
    },
    "http": {
        "ci": dict(many_questions=(1, 2), llava_bench=(2, 1), multi_turn=(1, 2),
                   video_frames=(2, 1), no_sharing=(2,), max_tokens=3, rates=[float("inf")]),
        "quick": dict(many_questions=(3, 6), llava_bench=(8, 2), multi_turn=(4, 3),
                      video_frames=(6, 2), no_sharing=(4,), max_tokens=8,
                      rates=[1.0, float("inf")]),
        "full": dict(many_questions=(4, 10), llava_bench=(24, 2.5), multi_turn=(8, 5),
                     video_frames=(16, 4), no_sharing=(12,), max_tokens=16,
                     rates=[0.5, 1.0, 2.0, float("inf")]),
    },
}  # fmt: skip
ENGINE_WORKLOADS = ("many_questions", "multi_turn", "video_frames", "no_sharing")
HTTP_WORKLOADS = ("many_questions", "llava_bench", "multi_turn", "video_frames", "no_sharing")


def build(name: str, scale: dict[str, Any], seed: int = 0) -> Workload:
    """Workload ``name`` at ``scale`` (a value of :data:`SCALES`).

    Raises:
        ValueError: an unknown name, or one the scale has no size for.
    """
    if name not in FACTORIES or name not in scale:
        raise ValueError(f"unknown workload {name!r}")
    return FACTORIES[name](*scale[name], scale["max_tokens"], seed)
