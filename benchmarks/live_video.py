"""``python -m benchmarks live-video`` (issue 43): a live stream of frames asked about as
it grows, against a ``/qa`` clip over the same frames.

One video of ``--frames`` distinct frames at 1 frame/s (a moving block over a seeded
background, H.264, decoded back with the server's own decoder so that both sides get the
same pixels) feeds two ``mmserve serve`` processes on the same checkpoint:

- the **stream** server gets the frames one ``POST /v1/streams/{id}/frames`` each (PNG,
  timestamp = the frame's second), in simulated time (each frame as soon as the last was
  taken; the default below ``--scale full``) or in real time (one a second,
  ``--real-time``); every ``--every`` seconds of video, once the server holds every frame
  sent, a question goes to ``POST /v1/streams/{id}/ask``;
- the **clip** server holds the whole video (``POST /v1/videos``) and gets the same
  question as a ``POST /v1/videos/{id}/qa`` clip (``mode: clip``) over the frames the
  stream's window holds at that moment (``timestamps``): today's way to ask about a video
  so far. Its radix cache keeps the earlier clips' prefixes, as it would for a client.

Both answer ``--max-tokens`` (1) tokens, greedy; the time from sending a question to its
whole answer is its TTFT (one token: the prefill of what the cache lacks, one decode
step, and for the clip the decoding and hashing of its frames). The two servers are
asked alternately (which goes first alternates too); the stream then gets
``--repeats`` - 1 more questions (other texts) at the same moment, and its TTFT at a
question time is the median of them (the clip is asked once: a second question would
find the first one's whole clip in the cache). Reported:

- TTFT of the stream's question late (the last 3 question times) / early (the 3 around
  0.1 of the video: minute 0.5 of 5), medians; target <= 1.5;
- TTFT stream / clip at each question time, and the medians early and late;
- the stream server's CPU seconds per frame at steady state (process tree, from the
  interval's first frame sent to its last held; question intervals after the first,
  median), less the tree's idle CPU (:func:`idle_cpu_rate`) over the interval, and raw;
- the frames/s the stream server sustains: a fresh stream per rate of ``--rates``,
  frames sent in real time for ``--rate-seconds``, ``fps`` = the rate; the highest rate
  whose held prefix keeps up (:func:`thinning_ramp`).

The dtype is the servers' ``--dtype`` (default auto: what ``mmserve.config.auto_dtype``
picks on this machine); the load average is given with the results. Results:
``benchmarks/README.md``, "Live video".
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from fractions import Fraction
from typing import Any

import httpx
import numpy as np

from benchmarks import over_http as http
from benchmarks import report
from benchmarks.host import cpu_by_process

#: ``--scale`` -> frames (seconds at 1 frame/s), seconds between questions, the stream's
#: window (``max_frames``; 0: every frame), real time, rates of the ramp (frames/s) and
#: seconds per rate. At full scale the window is 200 frames (the server fits 300 here:
#: 325 of 25 tokens in the small checkpoint's 8192-token context, capped by
#: ``--max-video-frames``), so the 300-frame stream rolls once (at frame 201, to its
#: last 100 frames).
SCALES: dict[str, dict[str, Any]] = {
    "full": {"frames": 300, "every": 10, "window": 200, "real_time": True,
             "rates": "1,2,4,8,16,32", "secs": 10},
    "quick": {"frames": 120, "every": 10, "window": 0, "real_time": False,
              "rates": "1,2,4,8,16", "secs": 5},
    "ci": {"frames": 12, "every": 4, "window": 0, "real_time": False, "rates": "2,8", "secs": 2},
}  # fmt: skip
#: Questions, one per question time in turn (distinct texts: no answer repeats a prompt).
QUESTIONS = (
    "What just happened?",
    "Has anything entered the picture?",
    "Where is the block now?",
    "What colour is the block?",
    "Is the scene moving?",
    "Describe the last few seconds.",
    "What changed since the start?",
    "Is anyone in view?",
)
#: Frames a sustained rate's held prefix may lag behind the window, median over the
#: second half of the rate's run (one prefill running and the frames that came in
#: meanwhile).
MAX_LAG = 2
#: Question times on each side of the early and late points whose medians are reported.
AROUND = 3


def make_video(n: int, w: int = 160, h: int = 120, seed: int = 0) -> bytes:
    """An H.264 MP4 of ``n`` distinct frames at 1 frame/s (frame ``i`` on screen from ``i``
    to ``i + 1`` s): a seeded blocky background with a block that moves and changes colour,
    so that no two frames share a content key."""
    import av

    rng = np.random.default_rng(seed)
    base = np.kron(rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8), np.ones((8, 8, 1)))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=1, options={"bf": "0"})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.codec_context.thread_count = 1
        s.codec_context.time_base = Fraction(1, 1)
        for i in range(n):
            f = base.astype(np.uint8)
            x, y = (i * 7) % (w - 24), (i * 3) % (h - 24)
            f[y : y + 24, x : x + 24] = ((40 * i) % 256, 255 - (17 * i) % 256, (90 + 5 * i) % 256)
            f[:4, : 1 + i % w] = 255  # a bar that grows: distinct even when the block repeats
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            vf.pts, vf.time_base = i, Fraction(1, 1)
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def decoded_pngs(data: bytes) -> list[bytes]:
    """Every frame of ``data`` as the server decodes it (``mmserve.vision.video``), PNG."""
    from mmserve.vision.video import Video, VideoLimits

    video = Video(data, VideoLimits(max_video_frames=100_000))
    out = []
    for im in video.frames(list(range(video.info.num_frames))):
        b = io.BytesIO()
        im.save(b, format="PNG")
        out.append(b.getvalue())
    return out


def held(info: dict) -> int:
    """Frames in the stream's window, from ``GET /v1/streams/{id}``."""
    return int(info["frames_held"])


def thinned(info: dict) -> int:
    """Frames the stream dropped by its ``fps``, from ``GET /v1/streams/{id}``."""
    return int(info["frames_thinned"])


def lag(info: dict) -> int:
    """Frames of the window not yet in the held prefill (0: the prefix has caught up)."""
    return held(info) - int(info["cached"]["frames"])


def settled(info: dict, sent: int) -> bool:
    """Every frame sent was taken (kept or thinned) and the held prefill covers the window,
    with no prefill running."""
    cached = info["cached"]
    return (info["frames_received"] >= sent and not lag(info) and not cached["pending"]) or bool(
        cached.get("error")
    )


class StreamClient:
    """One stream on the server at ``url``: create, send frames, wait until held, ask."""

    def __init__(self, client: httpx.Client, url: str, body: dict) -> None:
        self.client, self.url = client, url
        r = client.post(f"{url}/v1/streams", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/streams: {r.status_code} {r.text[:300]}")
        self.id = r.json()["id"]
        self.sent = 0

    def send(self, png: bytes, timestamp: float) -> None:
        """One frame (multipart ``file`` and ``timestamp``)."""
        files = {"file": (f"f{self.sent}.png", png, "image/png")}
        r = self.client.post(
            f"{self.url}/v1/streams/{self.id}/frames", files=files, data={"timestamp": timestamp}
        )
        if r.status_code != 200:
            raise RuntimeError(f"frames: {r.status_code} {r.text[:300]}")
        self.sent += 1

    def info(self) -> dict:
        """``GET /v1/streams/{id}``."""
        return self.client.get(f"{self.url}/v1/streams/{self.id}").raise_for_status().json()

    def settle(self, timeout: float = 600) -> dict:
        """Wait until every frame sent is held or thinned and none is pending; the info."""
        deadline = time.perf_counter() + timeout
        while True:
            info = self.info()
            if settled(info, self.sent):
                return info
            if time.perf_counter() > deadline:
                raise TimeoutError(f"stream {self.id}: {info} after {self.sent} frames")
            time.sleep(0.02)

    def ask(self, question: str, max_tokens: int) -> dict:
        """One question, not streamed: seconds to the whole answer, its text and usage."""
        body = {"questions": [question], "max_tokens": max_tokens, "temperature": 0.0}
        t0 = time.perf_counter()
        r = self.client.post(f"{self.url}/v1/streams/{self.id}/ask", json=body)
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"ask: {r.status_code} {r.text[:300]}")
        a = r.json()["answers"][0]
        details = a["usage"].get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", a["usage"].get("cached_tokens"))
        return {
            "ttft_s": seconds,
            "text": a["answer"],
            "prompt_tokens": a["usage"]["prompt_tokens"],
            "cached_tokens": cached,
        }

    def delete(self) -> None:
        """``DELETE /v1/streams/{id}``."""
        self.client.delete(f"{self.url}/v1/streams/{self.id}")


def ask_clip(
    client: httpx.Client, url: str, video_id: str, frames: range, question: str, max_tokens: int
) -> dict:
    """The question as a ``/qa`` clip over ``frames`` (their mid-second timestamps):
    seconds to the answer event, its text and tokens."""
    body = {
        "questions": [question],
        "mode": "clip",
        "timestamps": [i + 0.5 for i in frames],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/videos/{video_id}/qa", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"qa: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.strip():
                continue
            ev = json.loads(line)
            if ev["type"] == "error":
                raise RuntimeError(f"qa: {ev}")
            if ev["type"] == "answer":
                out = {
                    "ttft_s": time.perf_counter() - t0,
                    "text": ev["text"],
                    "prompt_tokens": ev["prompt_tokens"],
                    "cached_tokens": ev["cached_tokens"],
                }
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def tree_cpu(pid: int) -> float:
    """CPU seconds so far of process ``pid`` and its descendants (the server's tree)."""
    return sum(cpu_by_process(pid).values())


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """CPU seconds per second the server's tree spends with nothing to do (its loops and
    pollers), over ``seconds``: taken out of the per-frame figures, whose intervals last
    seconds in real time."""
    cpu0, t0 = tree_cpu(pid), time.perf_counter()
    time.sleep(seconds)
    return (tree_cpu(pid) - cpu0) / (time.perf_counter() - t0)


def thinning_ramp(
    client: httpx.Client,
    url: str,
    pid: int,
    pngs: list[bytes],
    rates: list[float],
    secs: float,
    window: int,
    idle: float = 0.0,
) -> list[dict]:
    """Per rate: a fresh stream (``fps`` = the rate, so ``fps`` thins nothing), frames in
    real time for ``secs`` seconds. The stream keeps one prefill running and folds the
    frames that arrive meanwhile into the next, so an overloaded server shows as a held
    prefix that falls behind, not as a queue: per rate the median and largest lag (frames
    of the window not yet prefilled, read after each frame) over the second half, the seconds
    from the last frame to a caught-up prefix, prefills run, frames thinned and the
    server's CPU per frame. The stream's window is ``window`` frames (the run's: a window
    that fills rolls, and its re-prefill shows in the largest lag). A rate is sustained
    when the median lag is within :data:`MAX_LAG` frames and nothing is thinned. Stops
    after the first rate that is not.
    ``pngs``: frames the server has not seen (no cached features), as many as the
    fastest rate sends."""
    rows = []
    for rate in rates:
        s = StreamClient(client, url, {"fps": rate, "max_frames": window})
        n = max(2, int(rate * secs))
        cpu0, t0 = tree_cpu(pid), time.perf_counter()
        lags, late = [], 0.0
        for i in range(n):
            wait = t0 + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            late = max(late, -wait)
            s.send(pngs[i % len(pngs)], i / rate)
            lags.append(lag(s.info()))
        last = time.perf_counter()
        info = s.settle()
        cpu = tree_cpu(pid) - cpu0
        busy = cpu - idle * (time.perf_counter() - t0)
        tail = lags[n // 2 :]
        row = {
            "rate": rate,
            "sent": n,
            "held": held(info),
            "thinned": thinned(info),
            "prefills": info["cached"]["prefills"],
            "lag_p50_frames": statistics.median(tail),
            "max_lag_frames": max(tail),
            "drain_s": time.perf_counter() - last,
            "client_late_s": late,
            "cpu_s_per_frame": busy / n,
            "raw_cpu_s_per_frame": cpu / n,
        }
        row["sustained"] = row["lag_p50_frames"] <= MAX_LAG and not row["thinned"]
        rows.append(row)
        s.delete()
        print(f"live-video ramp: {row}", flush=True)
        if not row["sustained"]:
            break
    return rows


def live_video(args: argparse.Namespace, model: str) -> int:
    """``live-video``: a growing stream asked every ``--every`` s of video against a
    ``/qa`` clip over the same frames (TTFT late / early, stream / clip), the server's
    CPU per frame and the frames/s it sustains before thinning."""
    from mmserve.config import auto_dtype

    sc = SCALES[args.scale]
    n = args.frames or sc["frames"]
    every = args.every or sc["every"]
    real_time = sc["real_time"] if args.real_time is None else args.real_time
    rates = [float(r) for r in (args.rates or sc["rates"]).split(",") if r]
    window = args.window or sc["window"] or n
    data = make_video(n, seed=args.seed)
    pngs = decoded_pngs(data)
    secs = args.rate_seconds or sc["secs"]
    # the ramp's own frames: none of them in the vision cache from the run before it
    ramp_pngs = decoded_pngs(make_video(int(max(rates) * secs) + 1, seed=args.seed + 1))
    flags = ["--max-total-tokens", str(args.max_total_tokens), "--max-video-frames", str(n)]
    flags += ["--dtype", args.dtype, *args.serve_flags.split()]
    threads = args.threads or 1
    times = list(range(every, n + 1, every))  # question times (s of video)
    early_t = times[min(range(len(times)), key=lambda k: abs(times[k] - 0.1 * n))]
    rows: dict[str, dict] = {}
    steady_cpu: list[float] = []
    raw_cpu: list[float] = []
    with (
        http.mmserve_server(model, flags, threads=threads) as (s_url, s_proc),
        http.mmserve_server(model, flags, threads=threads) as (c_url, _),
        httpx.Client(timeout=600) as client,
    ):
        up = client.post(f"{c_url}/v1/videos", files={"file": ("live.mp4", data, "video/mp4")})
        video_id = up.raise_for_status().json()["id"]
        idle = idle_cpu_rate(s_proc.pid, args.idle_seconds)
        stream = StreamClient(client, s_url, {"fps": 1, "max_frames": window})
        t0 = time.perf_counter()
        sent = 0
        for k, t in enumerate(times):
            cpu0, w0 = tree_cpu(s_proc.pid), time.perf_counter()
            for i in range(sent, t):
                if real_time:
                    time.sleep(max(0.0, t0 + i - time.perf_counter()))
                stream.send(pngs[i], float(i))
            frames_in = t - sent
            sent = t
            info = stream.settle()
            cpu = tree_cpu(s_proc.pid) - cpu0
            interval_cpu = (cpu - idle * (time.perf_counter() - w0)) / frames_in
            if k:  # the first interval holds the stream's first prefill: not steady
                raw_cpu.append(cpu / frames_in)
                steady_cpu.append(interval_cpu)
            q = QUESTIONS[k % len(QUESTIONS)]
            clip = range(max(0, t - min(window, held(info) or t)), t)
            order = ("stream", "clip") if k % 2 == 0 else ("clip", "stream")
            got: dict[str, dict] = {}
            for side in order:
                if side == "stream":
                    got[side] = stream.ask(q, args.max_tokens)
                else:
                    got[side] = ask_clip(client, c_url, video_id, clip, q, args.max_tokens)
            # more stream questions (other texts) at the same moment: a median per point;
            # not the clip's, whose second question would find the first one's whole clip
            more = [
                stream.ask(QUESTIONS[(k + j) % len(QUESTIONS)], args.max_tokens)["ttft_s"]
                for j in range(1, args.repeats)
            ]
            stream_ttfts = [got["stream"]["ttft_s"], *more]
            rows[f"{t} s"] = {
                "t": t,
                "frames": len(clip),
                "stream_ttft_s": statistics.median(stream_ttfts),
                "stream_ttfts_s": stream_ttfts,
                "clip_ttft_s": got["clip"]["ttft_s"],
                "ratio": got["stream"]["ttft_s"] / got["clip"]["ttft_s"],
                "stream_prompt": got["stream"]["prompt_tokens"],
                "stream_cached": got["stream"]["cached_tokens"],
                "clip_prompt": got["clip"]["prompt_tokens"],
                "clip_cached": got["clip"]["cached_tokens"],
                "same_answer": got["stream"]["text"] == got["clip"]["text"],
                "thinned": thinned(info),
                "cpu_s_per_frame": interval_cpu,
            }
            print(f"live-video: {rows[f'{t} s']}", flush=True)
        stream.delete()
        ramp = thinning_ramp(client, s_url, s_proc.pid, ramp_pngs, rates, secs, window, idle)
    by_t = {r["t"]: r for r in rows.values()}
    ei = times.index(early_t)
    early = [by_t[t] for t in times[max(0, ei - 1) : ei + AROUND - 1]]
    late = [by_t[t] for t in times[-AROUND:]]
    med = {
        name: {
            key: _median([r[key] for r in group])
            for key in ("stream_ttft_s", "clip_ttft_s", "ratio")
        }
        for name, group in (("early", early), ("late", late))
    }
    late_over_early = med["late"]["stream_ttft_s"] / med["early"]["stream_ttft_s"]
    clean = [r["rate"] for r in ramp if r["sustained"]]
    dtype, why = auto_dtype("cpu") if args.dtype == "auto" else (args.dtype, "--dtype")
    summary = {
        "stream_late_over_early": late_over_early,
        "clip_late_over_early": med["late"]["clip_ttft_s"] / med["early"]["clip_ttft_s"],
        "stream_over_clip_early": med["early"]["ratio"],
        "stream_over_clip_late": med["late"]["ratio"],
        "cpu_s_per_frame": _median(steady_cpu),
        "raw_cpu_s_per_frame": _median(raw_cpu),
        "idle_cpu_s_per_s": idle,
        "sustained_fps": max(clean) if clean else None,
        "same_answers": sum(r["same_answer"] for r in rows.values()),
        "questions": len(rows),
    }
    targets = [report.target("TTFT late / early (stream)", late_over_early, "<=", 1.5)]
    meta = {
        "model": str(model),
        "frames": n,
        "every_s": every,
        "window_frames": window,
        "real_time": real_time,
        "early_s": [r["t"] for r in early],
        "late_s": [r["t"] for r in late],
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "dtype": dtype,
        "dtype_why": why,
        "threads": threads,
        "serve_flags": args.serve_flags,
        "load": report.loadavg(),
    }
    md = (
        f"{n} frames at 1 frame/s ({'real' if real_time else 'simulated'} time), a question "
        f"every {every} s ({args.repeats} to the stream), window {window} frames, "
        f"{args.max_tokens}-token answers{', ' + args.serve_flags if args.serve_flags else ''}; "
        f"dtype {dtype} ({why}), {threads} torch thread(s) per server, load {meta['load']}\n\n"
    )
    md += report.md_table(
        "figure|value",
        [
            (f"stream TTFT late {meta['late_s']} / early {meta['early_s']}", late_over_early),
            ("clip TTFT late / early", summary["clip_late_over_early"]),
            ("stream / clip TTFT, early", summary["stream_over_clip_early"]),
            ("stream / clip TTFT, late", summary["stream_over_clip_late"]),
            ("server CPU s per frame (steady, less idle)", summary["cpu_s_per_frame"]),
            ("server CPU s per frame (steady, raw)", summary["raw_cpu_s_per_frame"]),
            ("server CPU s per s, idle", idle),
            ("frames/s sustained (the held prefix keeps up)", summary["sustained_fps"]),
            ("same answer as the clip", f"{summary['same_answers']} of {len(rows)}"),
        ],
    )
    md += "\n" + report.targets_table(targets) + "\n"
    md += report.table(
        rows,
        "video time|frames=frames|stream TTFT=stream_ttft_s:ms|clip TTFT=clip_ttft_s:ms"
        "|stream / clip=ratio:.3f|stream cached=stream_cached|stream prompt=stream_prompt"
        "|clip cached=clip_cached|clip prompt=clip_prompt|same answer=same_answer"
        "|server CPU s/frame=cpu_s_per_frame:.3f",
    )
    md += "\n" + report.md_table(
        "frames/s|sent|held|thinned|prefills|lag p50 (frames)|lag max|drain s|CPU s/frame|kept up",
        [
            (
                r["rate"],
                r["sent"],
                r["held"],
                r["thinned"],
                r["prefills"],
                r["lag_p50_frames"],
                r["max_lag_frames"],
                r["drain_s"],
                r["cpu_s_per_frame"],
                r["sustained"],
            )
            for r in ramp
        ],
    )
    out = {"meta": meta, "summary": summary, "targets": targets, "rows": rows, "ramp": ramp}
    out["steady_cpu_s_per_frame"] = steady_cpu
    out["raw_cpu_s_per_frame"] = raw_cpu
    return report.emit(args.out, "live_video", out, md)


#: ``live-video``'s options beside the common ones.
OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--frames",), dict(type=int, default=0, help="seconds of video (default by --scale)")),
    (("--every",), dict(type=int, default=0, help="seconds between questions (by --scale)")),
    (("--window",), dict(type=int, default=0, help="the stream's max_frames (by --scale)")),
    (("--real-time",), dict(action=argparse.BooleanOptionalAction, default=None,
                            help="one frame a second (default: at --scale full)")),
    (("--max-tokens",), dict(type=int, default=1, help="answer tokens")),
    (("--repeats",), dict(type=int, default=3, help="stream questions per question time")),
    (("--rates",), dict(default="", help="frames/s of the thinning ramp (by --scale)")),
    (("--rate-seconds",), dict(type=float, default=0, help="seconds per ramp rate")),
    (("--dtype",), dict(default="auto", help="the servers' --dtype (auto: the machine's)")),
    (("--serve-flags",), dict(default="", help="more `mmserve serve` flags, both servers")),
    (("--idle-seconds",), dict(type=float, default=3.0, help="the idle CPU baseline (s)")),
    (("--max-total-tokens",), dict(type=int, default=16384, help="KV pool of each server")),
]  # fmt: skip
