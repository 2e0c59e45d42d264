"""Many questions about a few images: the prefix cache on vs off, in one run.

K images are "uploaded" (decoded and hashed by ``InputProcessor.prepare_image``), then
K x M chat requests -- every question about every image -- are submitted at
once to ``Engine.generate``. The same workload runs twice on the same loaded
model, with a fresh engine each time:

* cache on: the engine's defaults (radix prefix cache, vision embedding cache);
* cache off: ``disable_radix_cache=True`` and ``vision_cache_bytes=0``, so no KV or
  image features are reused across requests.

"image prefills" counts, over all requests, the images whose 576 pseudo-token
positions had to be computed by the decoder: K with the cache on (the first
question about an image), K x M with it off. "vision-tower runs" counts encoder
passes: K with the cache on; with it off, between K and K x M, because requests
about one image that are prefilled in the same step share that step's encoder
pass (the model runner encodes each step's distinct images once).

Greedy decoding with ``ignore_eos`` makes both runs produce exactly
``max_tokens`` tokens per request. A short warm-up on a throwaway engine runs
first so one-time costs (CUDA context, kernel JIT, cuBLAS handles) are not timed.

Usage::

    python -m benchmarks.many_questions --size small --device cuda \
        --images 4 --questions 4 --max-tokens 16
    python -m benchmarks.many_questions            # tiny defaults on CPU, a few seconds
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image, ImageOps

from mmserve.config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams
from mmserve.model.loader import LoadedModel, load_model

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "samples" / "images"

QUESTIONS = [
    "What is in this photo?",
    "Describe the colours you can see.",
    "Is this photo taken indoors or outdoors?",
    "What is the main object and where is it?",
    "Write a one-sentence caption for this image.",
    "How many distinct objects are visible?",
    "What time of day does it look like?",
    "What would be a good title for this picture?",
]


@dataclass
class Figures:
    """What one run measured (times in seconds unless the name says ms).

    Attributes:
        requests: requests finished.
        wall_s: wall time of ``Engine.generate`` for the whole batch.
        requests_per_s: ``requests / wall_s``.
        output_tokens: generated tokens over all requests.
        output_tokens_per_s: ``output_tokens / wall_s``.
        ttft_p50_ms: median time from submission to first token (ms).
        cache_hit_rate: prompt tokens served from the radix cache / prompt tokens.
        vision_tower_runs: images encoded by the vision tower.
        image_prefills: images whose pseudo-token positions some request had to
            compute (not covered by its cached prefix), summed over requests.
        prefill_steps: prefill batches run.
    """

    requests: int
    wall_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_ms: float
    cache_hit_rate: float
    vision_tower_runs: int
    image_prefills: int
    prefill_steps: int


def sample_images(k: int) -> list[bytes]:
    """``k`` distinct encoded photos from ``samples/images`` (PNG/JPEG bytes).

    Past the number of sample photos, mirrored / flipped copies are used: new
    pixels, so new image keys, and the same content statistics.

    Raises:
        ValueError: if ``k < 1`` or the samples folder has no photos.
    """
    if k < 1:
        raise ValueError(f"--images must be >= 1, got {k}")
    paths = sorted(p for p in SAMPLES_DIR.iterdir() if p.suffix.lower() in (".png", ".jpg"))
    if not paths:
        raise ValueError(f"no sample photos in {SAMPLES_DIR}")
    out = [p.read_bytes() for p in paths[:k]]
    variants = (ImageOps.mirror, ImageOps.flip, lambda im: ImageOps.flip(ImageOps.mirror(im)))
    i = 0
    while len(out) < k:
        base = Image.open(paths[i % len(paths)]).convert("RGB")
        im = variants[(i // len(paths)) % len(variants)](base)
        if i >= len(paths) * len(variants):  # beyond that, shift pixels to stay distinct
            im = im.point(lambda v, s=i: (v + s) % 256)
        buf = io.BytesIO()
        im.save(buf, "PNG")
        out.append(buf.getvalue())
        i += 1
    return out


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _config(args: argparse.Namespace, model_path: str, cache: bool) -> EngineConfig:
    extra = {} if cache else {"disable_radix_cache": True, "vision_cache_bytes": 0}
    return EngineConfig(
        model_path=model_path,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        **extra,
    )


def warm_up(args: argparse.Namespace, model_path: str, model: LoadedModel) -> None:
    """One image request on a throwaway engine, so one-time costs are not timed."""
    eng = Engine(_config(args, model_path, cache=True), model=model)
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 150)).save(buf, "PNG")  # not one of the photos
    img = eng.processor.prepare_image(buf.getvalue())
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.generate(
        [eng.processor.make_request(messages=_messages("Hi?"), images=[img], params=params)]
    )


def run_once(
    args: argparse.Namespace,
    model_path: str,
    model: LoadedModel,
    photos: list[bytes],
    questions: list[str],
    cache: bool,
) -> Figures:
    """Upload ``photos``, ask every question about each at once, and measure.

    Returns:
        The run's :class:`Figures`.
    """
    eng = Engine(_config(args, model_path, cache), model=model)
    images = [eng.processor.prepare_image(b) for b in photos]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    reqs = [
        eng.processor.make_request(messages=_messages(q), images=[img], params=params)
        for img in images
        for q in questions
    ]
    results = eng.generate(reqs)
    wall = time.perf_counter() - t0
    stats = eng.cache_stats()
    out_tokens = sum(r.completion_tokens for r in results)
    return Figures(
        requests=len(results),
        wall_s=wall,
        requests_per_s=len(results) / wall,
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / wall,
        ttft_p50_ms=1000 * statistics.median(r.ttft for r in results),
        cache_hit_rate=float(stats["cache_hit_rate"]),
        vision_tower_runs=int(stats["vision_tower_images"]),
        image_prefills=sum(r.images_needing_vision for r in results),
        prefill_steps=eng.stats.prefill_steps,
    )


def _ratio(on: float, off: float) -> float | None:
    return on / off if off else None


def format_table(on: Figures, off: Figures) -> str:
    """The side-by-side table that :func:`main` prints."""
    rows = [
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
        ("cache hit rate", "cache_hit_rate", "{:.3f}"),
        ("vision-tower runs", "vision_tower_runs", "{}"),
        ("image prefills", "image_prefills", "{}"),
        ("prefill steps", "prefill_steps", "{}"),
        ("wall time (s)", "wall_s", "{:.2f}"),
    ]
    lines = [f"{'':<20}{'cache on':>12}{'cache off':>12}{'on/off':>10}"]
    for label, key, fmt in rows:
        a, b = getattr(on, key), getattr(off, key)
        r = _ratio(a, b)
        lines.append(
            f"{label:<20}{fmt.format(a):>12}{fmt.format(b):>12}"
            + (f"{r:>9.2f}x" if r is not None else f"{'-':>10}")
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.many_questions", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size", choices=["tiny", "small"], default="tiny", help="bundled model")
    p.add_argument("--model", default=None, help="checkpoint directory (overrides --size)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument("--images", type=int, default=2, help="distinct images K")
    p.add_argument(
        "--questions", type=int, default=2, help=f"questions per image M (<= {len(QUESTIONS)})"
    )
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    p.add_argument(
        "--max-total-tokens", type=int, default=16384, help="KV pool size per engine (tokens)"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, and return the figures.

    Returns:
        ``{"config": {...}, "on": Figures-as-dict, "off": ..., "ratio": {key: on/off or None}}``.

    Raises:
        ValueError: for out-of-range ``--images`` / ``--questions`` / ``--max-tokens``.
    """
    args = build_parser().parse_args(argv)
    if not 1 <= args.questions <= len(QUESTIONS):
        raise ValueError(f"--questions must be in 1..{len(QUESTIONS)}, got {args.questions}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.model is None:
        from mmserve.model.make_checkpoint import ensure_model

        model_path = str(ensure_model(args.size))
    else:
        model_path = args.model
    probe = _config(args, model_path, cache=True)
    probe.validate()
    model = load_model(model_path, device=args.device, dtype=probe.torch_dtype())
    photos = sample_images(args.images)
    questions = QUESTIONS[: args.questions]
    if not args.no_warmup:
        warm_up(args, model_path, model)
    on = run_once(args, model_path, model, photos, questions, cache=True)
    off = run_once(args, model_path, model, photos, questions, cache=False)

    config = {
        "model": Path(model_path).name,
        "device": args.device,
        "dtype": str(probe.torch_dtype()).removeprefix("torch."),
        "attention_backend": _backend_name(probe, model),
        "images": args.images,
        "questions": args.questions,
        "max_tokens": args.max_tokens,
        "page_size": args.page_size,
    }
    print(
        f"many_questions: {args.images} images x {args.questions} questions = "
        f"{on.requests} requests at once, {args.max_tokens} output tokens each; "
        f"{config['model']} on {config['device']} ({config['dtype']}, "
        f"attention {config['attention_backend']})"
    )
    print(format_table(on, off))
    ratio = {k: _ratio(v, getattr(off, k)) for k, v in asdict(on).items()}
    return {"config": config, "on": asdict(on), "off": asdict(off), "ratio": ratio}


def _backend_name(cfg: EngineConfig, model: LoadedModel) -> str:
    from mmserve.kernels.select import resolve_attention_backend

    return resolve_attention_backend(
        cfg.attention_backend, cfg.device, model.decoder.embed_tokens.weight.dtype
    )


if __name__ == "__main__":
    main()
