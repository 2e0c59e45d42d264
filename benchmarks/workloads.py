"""Seeded benchmark workloads and their offline-optimal cache hit rate.

A :class:`Workload` is a list of *rounds*; every request of a round is
submitted at once, and a round starts when the previous one has finished. A
workload with *sessions* (multi_turn) is instead driven closed-loop by the mmserve
runner: turn 0 of every session is submitted at once, and each session sends its
next turn as soon as its previous answer arrives (a chat client); its rounds are
then only the lock-step alternative and the one-at-a-time baseline's order.
Images are encoded PNG/JPEG bytes, so every system decodes the same
pixels. All randomness comes from ``random.Random(seed)`` (and a seeded numpy
generator for noise images): the same arguments give the same prompts.

Workloads:

- ``many_questions``: K sample photos x M llava-bench-style questions each,
  one shared system prompt, one round, arrival order shuffled.
- ``multi_turn``: C chat sessions, each with its own photo in the first user turn,
  T turns each. Turn ``t`` of every session forms round ``t`` (lock-step order);
  :attr:`Workload.sessions` lists each session's turns for the closed-loop
  driver. Each prompt is the whole
  history; the assistant turns in the history are FIXED canned sentences (not
  what a system generated), so prompts are identical across systems.
- ``video_frames``: F frames x Q questions (per-frame QA, one round). There is
  no sample video in the repository yet, so the frames are a camera pan: square
  crops sliding diagonally across ``samples/images/astronaut.png``, resized to
  336 x 336. Every third frame repeats the previous one exactly (a static
  scene), so identical frames share their pseudo-tokens.
- ``no_sharing``: distinct random-noise images and random word texts, no system
  prompt: nothing is shared but the chat template's first few tokens.

The offline optimum follows Theorem 3.1 of the SGLang paper (arXiv 2312.07104):
with unlimited cache, the best schedule computes every edge of the prefix tree
of all prompts once, so ``optimal hit rate = 1 - distinct / total`` where
``distinct`` is the number of nodes of the token trie of all prompts and
``total`` the sum of prompt lengths (both in tokens).
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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

#: Follow-up questions for turns after the first (multi_turn).
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

#: Canned assistant answers placed in the multi-turn history (indexed by turn).
CANNED_ANSWERS = (
    "The photo shows the main subject in the center, with a plain background.",
    "Because of the shapes and the colors, which are typical for this kind of scene.",
    "There are a few smaller objects near the edges of the frame.",
    "It looks safe; nothing in the picture suggests any danger.",
    "We talked about the subject, the colors and the details of the photo.",
    "At night the colors would be darker and the lights would stand out.",
    "The texture of the surface is visible in the lower part of the image.",
)

#: Words for random texts (no_sharing).
WORDS = (
    "apple river stone cloud garden window yellow quiet market bridge forest candle "
    "silver engine harbor pencil winter violin desert planet ladder mirror orange "
    "thunder basket marble jungle rocket saddle meadow tunnel falcon copper lantern "
    "island velvet canyon meteor pillow glacier trumpet compass blossom dragon puzzle "
    "feather horizon"
).split()


@dataclass
class Prompt:
    """One request of a workload.

    Attributes:
        messages: chat messages; an image is a ``{"type": "image"}`` content part.
        images: names (keys of :attr:`Workload.images`) filling the image parts, in order.
    """

    messages: list[dict]
    images: list[str]


@dataclass
class Workload:
    """Requests grouped in rounds, plus the encoded images they use.

    Attributes:
        name: workload name (also the results file name).
        description: one line on what the workload models.
        images: encoded image bytes by name.
        rounds: requests submitted together; round ``r + 1`` starts when round ``r`` ends.
        max_tokens: output tokens per request (every system produces exactly this many).
        params: the generator's arguments (for the report).
        notes: how the data was made (for the report).
        sessions: for closed-loop chat workloads, each session's requests in turn
            order, as indices into :attr:`prompts`; empty for open workloads.
    """

    name: str
    description: str
    images: dict[str, bytes]
    rounds: list[list[Prompt]]
    max_tokens: int
    params: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sessions: list[list[int]] = field(default_factory=list)

    @property
    def prompts(self) -> list[Prompt]:
        """All requests in submission order."""
        return [p for r in self.rounds for p in r]

    @property
    def num_requests(self) -> int:
        """Number of requests."""
        return sum(len(r) for r in self.rounds)


# ---- offline optimum ------------------------------------------------------------


def trie_size(seqs: Sequence[Sequence[int]]) -> int:
    """Number of nodes (root excluded) of the token trie holding every sequence.

    Equals ``sum(len(s)) - sum(lcp(s_i, s_{i-1}))`` over the lexicographically
    sorted sequences, which is what this computes (O(total tokens)).
    """
    ordered = sorted(tuple(s) for s in seqs)
    nodes = 0
    prev: tuple[int, ...] = ()
    for s in ordered:
        n = min(len(s), len(prev))
        i = 0
        while i < n and s[i] == prev[i]:
            i += 1
        nodes += len(s) - i
        prev = s
    return nodes


def optimal_hit_rate(seqs: Sequence[Sequence[int]]) -> dict[str, float]:
    """Offline-optimal cache hit rate of a set of prompts (SGLang Theorem 3.1).

    Args:
        seqs: prompt token ids (image pseudo-tokens included), one per request.

    Returns:
        ``{"total_tokens", "distinct_tokens", "optimal_hit_rate"}``: tokens summed
        over prompts, nodes of their trie (tokens), and ``1 - distinct / total``.
    """
    total = sum(len(s) for s in seqs)
    distinct = trie_size(seqs)
    return {
        "total_tokens": total,
        "distinct_tokens": distinct,
        "optimal_hit_rate": 1.0 - distinct / total if total else 0.0,
    }


# ---- images ---------------------------------------------------------------------


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def photo_bytes(name: str) -> bytes:
    """Encoded bytes of a sample photo in ``samples/images``."""
    return (SAMPLES_DIR / name).read_bytes()


def photos(k: int) -> dict[str, bytes]:
    """``k`` distinct real images: the sample photos, then mirrored copies of them.

    The mirrors (left-right flips, PNG) have different pixels, hence different keys.
    """
    out: dict[str, bytes] = {}
    for i in range(k):
        name = PHOTOS[i % len(PHOTOS)]
        if i < len(PHOTOS):
            out[name] = photo_bytes(name)
        else:
            im = Image.open(SAMPLES_DIR / name).convert("RGB")
            for _ in range(i // len(PHOTOS)):
                im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT).rotate(90, expand=True)
            out[f"{Path(name).stem}-v{i // len(PHOTOS)}.png"] = _png(im)
    return out


def pan_frames(num_frames: int, repeat_every: int = 3, size: int = 336) -> list[bytes]:
    """Frames of a synthetic camera pan across ``astronaut.png`` (PNG bytes).

    A square window of 3/4 of the photo's side slides diagonally from the top-left
    to the bottom-right corner; each crop is resized to ``size`` x ``size``. Frame
    ``i`` with ``i % repeat_every == repeat_every - 1`` repeats frame ``i - 1``
    exactly (a static scene); ``repeat_every=0`` disables repeats.
    """
    src = Image.open(SAMPLES_DIR / "astronaut.png").convert("RGB")
    w, h = src.size
    side = min(w, h) * 3 // 4
    frames: list[bytes] = []
    pos = 0  # index of the next distinct camera position
    moving = [i for i in range(num_frames) if not _is_repeat(i, repeat_every)]
    steps = max(len(moving) - 1, 1)
    for i in range(num_frames):
        if _is_repeat(i, repeat_every) and frames:
            frames.append(frames[-1])
            continue
        x = (w - side) * pos // steps
        y = (h - side) * pos // steps
        crop = src.crop((x, y, x + side, y + side)).resize((size, size), Image.Resampling.BICUBIC)
        frames.append(_png(crop))
        pos += 1
    return frames


def _is_repeat(i: int, every: int) -> bool:
    return every > 0 and i > 0 and i % every == every - 1


def noise_image(rng: np.random.Generator, size: int) -> bytes:
    """A random RGB noise image of ``size`` x ``size`` pixels (PNG bytes)."""
    arr = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return _png(Image.fromarray(arr, "RGB"))


# ---- workloads ------------------------------------------------------------------


def _image_turn(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def many_questions(k: int, m: int, max_tokens: int, seed: int = 0) -> Workload:
    """K images x M questions each, shared system prompt, all in one round."""
    rnd = random.Random(seed)
    imgs = photos(k)
    prompts = []
    for name in imgs:
        for q in _pick(rnd, QUESTIONS, m):
            msgs = [{"role": "system", "content": SYSTEM_PROMPT}, _image_turn(q)]
            prompts.append(Prompt(msgs, [name]))
    rnd.shuffle(prompts)
    return Workload(
        "many_questions",
        f"{k} images x {m} questions each (llava-bench style), shared system prompt, "
        "submitted at once in shuffled order",
        imgs,
        [prompts],
        max_tokens,
        {"images": k, "questions_per_image": m, "max_tokens": max_tokens, "seed": seed},
        [f"images: {', '.join(imgs)}"],
    )


def multi_turn(c: int, t: int, max_tokens: int, seed: int = 0) -> Workload:
    """C chat sessions x T turns; round ``r`` holds turn ``r`` of every session."""
    rnd = random.Random(seed)
    imgs = photos(c)
    names = list(imgs)
    sessions = []
    for _ in range(c):
        first = rnd.choice(QUESTIONS)
        follow = _pick(rnd, FOLLOW_UPS, t - 1)
        sessions.append([first, *follow])
    rounds = []
    at: list[list[int]] = [[0] * t for _ in range(c)]  # (session, turn) -> prompt index
    for turn in range(t):
        batch = []
        for s in range(c):
            msgs: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
            for j in range(turn + 1):
                q = sessions[s][j]
                msgs.append(_image_turn(q) if j == 0 else {"role": "user", "content": q})
                if j < turn:
                    answer = CANNED_ANSWERS[j % len(CANNED_ANSWERS)]
                    msgs.append({"role": "assistant", "content": answer})
            batch.append((s, Prompt(msgs, [names[s]])))
        rnd.shuffle(batch)
        base = turn * c
        for i, (s, _) in enumerate(batch):
            at[s][turn] = base + i
        rounds.append([p for _, p in batch])
    return Workload(
        "multi_turn",
        f"{c} chat sessions x {t} turns, each session with its own photo in the first "
        "turn; closed loop: every session starts at once and sends its next turn as soon "
        "as its previous answer arrives",
        imgs,
        rounds,
        max_tokens,
        {"sessions": c, "turns": t, "max_tokens": max_tokens, "seed": seed},
        [
            "history holds fixed canned assistant answers, not generated text, so every "
            "system sees identical prompts",
            "mmserve: closed loop, at most one outstanding turn per session; TTFT from each "
            "turn's submission. transformers: one request at a time in round order "
            "(round t = turn t of every session)",
            f"images: {', '.join(names)}",
        ],
        at,
    )


def video_frames(f: int, q: int, max_tokens: int, seed: int = 0, repeat_every: int = 3) -> Workload:
    """F pan frames x Q questions per frame, one round, shuffled."""
    rnd = random.Random(seed)
    frames = pan_frames(f, repeat_every)
    imgs: dict[str, bytes] = {}
    order = []
    for i, data in enumerate(frames):
        name = f"frame{i:03d}"
        imgs[name] = data
        order.append(name)
    questions = _pick(rnd, QUESTIONS, q)
    prompts = []
    for name in order:
        for question in questions:
            msgs = [{"role": "system", "content": SYSTEM_PROMPT}, _image_turn(question)]
            prompts.append(Prompt(msgs, [name]))
    rnd.shuffle(prompts)
    repeats = [i for i in range(f) if _is_repeat(i, repeat_every)]
    return Workload(
        "video_frames",
        f"{f} video frames x {q} questions per frame (per-frame QA), submitted at once",
        imgs,
        [prompts],
        max_tokens,
        {"frames": f, "questions_per_frame": q, "max_tokens": max_tokens, "seed": seed},
        [
            "no sample video in the repo: frames are a synthetic camera pan (square crops of "
            "3/4 side sliding diagonally across samples/images/astronaut.png, resized to "
            "336x336, PNG)",
            f"frames {repeats} repeat the previous frame exactly (static scene)",
        ],
    )


def no_sharing(n: int, max_tokens: int, seed: int = 0, image_size: int = 336) -> Workload:
    """N requests with distinct random-noise images and random texts, one round."""
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    imgs: dict[str, bytes] = {}
    prompts = []
    for i in range(n):
        name = f"noise{i:03d}"
        imgs[name] = noise_image(rng, image_size)
        lead = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 10)))
        tail = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(6, 14)))
        msgs = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"{lead.capitalize()}: "},
                    {"type": "image"},
                    {"type": "text", "text": f"{tail}?"},
                ],
            }
        ]
        prompts.append(Prompt(msgs, [name]))
    return Workload(
        "no_sharing",
        f"{n} requests with distinct random-noise images and random texts (overhead check)",
        imgs,
        [prompts],
        max_tokens,
        {"requests": n, "max_tokens": max_tokens, "seed": seed},
        [
            "no system prompt; text before the image differs per request, so only the "
            "chat template's first tokens are shared"
        ],
    )


def _pick(rnd: random.Random, pool: Sequence[str], n: int) -> list[str]:
    """``n`` items from ``pool`` without repeats while possible, then cycling."""
    items = list(pool)
    out: list[str] = []
    while len(out) < n:
        rnd.shuffle(items)
        out.extend(items[: n - len(out)])
    return out
