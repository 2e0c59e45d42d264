"""Draw the Grafana dashboard without Grafana: scrape a running server, evaluate each panel.

    python -m examples.observability.render_dashboard --url http://127.0.0.1:8000 \
        --seconds 90 --out docs/observability-dashboard.png

Scrapes ``URL/metrics`` every ``--interval`` seconds while its own load runs (``--clients``
threads, started one by one over the first half of the run, asking short questions about
the sample images, each image asked about again and again so the prefix and embedding
caches are hit; ``--no-load`` only scrapes, e.g. while a
benchmark runs), then evaluates every panel's PromQL at every scrape with
``promql.evaluate`` (``$__rate_interval`` = ``--rate-interval``, ``$instance`` = all) and
draws the panels with matplotlib at their ``gridPos`` (Grafana's 24-column grid). It is
a picture of the same queries, not Grafana's own rendering: no Prometheus in between, and
``rate`` is taken between the first and last scrape in its window, without Prometheus'
extrapolation. Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import math
import random
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from examples.observability.promql import Scrape, evaluate, parse

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DASHBOARD = HERE / "grafana" / "dashboards" / "mmserve.json"
QUESTIONS = ("What is this?", "Describe it.", "Colors?", "Count the objects.", "Where is it?")
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9")


def scrape(url: str) -> Scrape:
    """``URL/metrics`` read by :func:`parse_scrape`."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return parse_scrape(text, url.split("://", 1)[-1].rstrip("/"))


def parse_scrape(text: str, instance: str) -> Scrape:
    """A Prometheus text exposition as sample name and sorted labels -> value, with the
    ``job`` and ``instance`` labels Prometheus would attach."""
    out: Scrape = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {**s.labels, "job": "mmserve", "instance": instance}
            out[s.name, tuple(sorted(labels.items()))] = s.value
    return out


def _post(url: str, path: str, body: bytes, ctype: str) -> dict:
    req = urllib.request.Request(f"{url}{path}", data=body, headers={"Content-Type": ctype})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def upload_samples(url: str) -> list[str]:
    """Upload samples/images/* and return their ids."""
    ids = []
    for path in sorted((ROOT / "samples" / "images").glob("*.[pj][np]g")):
        boundary = uuid.uuid4().hex
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="{path.name}"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
            + path.read_bytes()
            + f"\r\n--{boundary}--\r\n".encode()
        )
        ids.append(
            _post(url, "/v1/images", body, f"multipart/form-data; boundary={boundary}")["id"]
        )
    return ids


def fresh_image(rng: random.Random) -> str:
    """A PNG data URL of a few random rectangles (an image the server has not seen)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (224, 224), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x, y = rng.randrange(200), rng.randrange(200)
        fill = tuple(rng.randrange(256) for _ in range(3))
        draw.rectangle((x, y, x + rng.randrange(8, 100), y + rng.randrange(8, 100)), fill=fill)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def load(
    url: str, model: str, images: list[str], new_share: float, stop: threading.Event, seed: int
) -> None:
    """Ask questions about ``images`` (or, ``new_share`` of the time, a fresh image) until
    ``stop``; failures (a 503) are skipped."""
    rng = random.Random(seed)
    while not stop.is_set():
        image = fresh_image(rng) if rng.random() < new_share else rng.choice(images)
        content = [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": rng.choice(QUESTIONS)},
        ]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": rng.randint(4, 24),
            "temperature": 0,
        }
        try:
            _post(url, "/v1/chat/completions", json.dumps(body).encode(), "application/json")
        except OSError:
            time.sleep(0.5)


def record(args: argparse.Namespace) -> list[tuple[float, Scrape]]:
    """Scrapes over ``args.seconds``, with the load running unless ``args.no_load``."""
    stop = threading.Event()
    threads = []
    if not args.no_load:
        with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        images = upload_samples(args.url)
        for i in range(args.clients):
            t = threading.Thread(
                target=load, args=(args.url, model, images, args.new_images, stop, i), daemon=True
            )
            threads.append(t)
    scrapes = [(time.time(), scrape(args.url))]
    start = time.time()
    end = start + args.seconds
    while time.time() < end:
        # offered load ramps up: one more client every seconds / (2 * clients)
        due = int((time.time() - start) / args.seconds * 2 * len(threads)) + 1
        for t in threads[:due]:
            if not t.is_alive() and t.ident is None:
                t.start()
        time.sleep(args.interval)
        scrapes.append((time.time(), scrape(args.url)))
    stop.set()
    for t in threads:
        t.join(timeout=300)
    return scrapes


def _dump_scrape(t: float, s: Scrape) -> str:
    return json.dumps([t, [[name, dict(labels), v] for (name, labels), v in s.items()]])


def _load_scrape(line: str) -> tuple[float, Scrape]:
    t, rows = json.loads(line)
    return t, {(name, tuple(sorted(labels.items()))): v for name, labels, v in rows}


def series(expr: str, scrapes: list[tuple[float, Scrape]], rate_interval: str) -> dict:
    """Legend-less label tuple -> ``(times, values)`` of ``expr`` at every scrape."""
    tree = parse(expr)
    vars_ = {"__rate_interval": rate_interval, "instance": ".*"}
    out: dict = {}
    for i in range(1, len(scrapes) + 1):
        value = evaluate(tree, scrapes[:i], vars_)
        vec = {(): value} if isinstance(value, float) else value
        for labels, v in vec.items():
            ts, vs = out.setdefault(labels, ([], []))
            ts.append(scrapes[i - 1][0] - scrapes[0][0])
            vs.append(v)
    return out


def fmt(value: float, unit: str) -> str:
    """A value as Grafana's unit would print it (roughly)."""
    if value is None or math.isnan(value):
        return "No data"
    if unit == "percentunit":
        return f"{100 * value:.1f}%"
    if unit == "s":
        return f"{1000 * value:.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "reqps":
        return f"{value:.2f} req/s"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 1000:.3g}k" if abs(value) >= 1000 else f"{value:.3g}"


def draw(dash: dict, scrapes: list[tuple[float, Scrape]], rate_interval: str, out: Path) -> None:
    """The dashboard's panels on one dark figure, placed by ``gridPos``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    panels = dash["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width_px, cell_px = 1800, 34  # Grafana: 24 columns, a grid row 30 px + margins
    fig = plt.figure(figsize=(width_px / 100, (rows * cell_px + 40) / 100), dpi=100)
    fig.patch.set_facecolor("#111217")
    top = 1 - 40 / (rows * cell_px + 40)
    fig.text(
        0.005, 1 - 12 / (rows * cell_px + 40), "mmserve dashboard", color="white", size=14, va="top"
    )
    stamp = f"headless render of {DASHBOARD.name}, {len(scrapes)} scrapes"
    fig.text(
        0.995, 1 - 14 / (rows * cell_px + 40), stamp, color="#8e8e8e", size=9, ha="right", va="top"
    )
    fig_h = rows * cell_px + 40
    for p in panels:
        g = p["gridPos"]
        pad = 4 / width_px
        box = [
            g["x"] / 24 + pad,
            top * (1 - (g["y"] + g["h"]) / rows) + pad * 2,
            g["w"] / 24 - 2 * pad,
            top * g["h"] / rows - pad * 4,
        ]
        if p["type"] == "row":
            fig.text(
                box[0],
                box[1] + box[3] / 2,
                p["title"],
                color="#d8d9da",
                size=11,
                weight="bold",
                va="center",
            )
            continue
        fig.patches.append(
            Rectangle(
                (box[0], box[1]),
                box[2],
                box[3],
                transform=fig.transFigure,
                facecolor="#181b1f",
                edgecolor="#2c3235",
                lw=0.8,
                zorder=-1,
            )
        )
        fig.text(
            box[0] + 8 / width_px,
            box[1] + box[3] - 6 / fig_h,
            p["title"],
            color="#d8d9da",
            size=9.5,
            va="top",
        )
        inset = [box[0] + 70 / width_px, box[1] + 24 / fig_h]  # room for the axis labels
        inset += [box[2] - 82 / width_px, box[3] - 58 / fig_h]
        ax = fig.add_axes(inset)
        ax.set_facecolor("#181b1f")
        for side in ax.spines.values():
            side.set_visible(False)
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        drawn = []
        for t in p["targets"]:
            for labels, (ts, vs) in series(t["expr"], scrapes, rate_interval).items():
                legend = t.get("legendFormat") or t["expr"]
                for k, v in labels:
                    legend = legend.replace("{{" + k + "}}", v)
                drawn.append((legend, ts, vs))
        if p["type"] in ("stat", "gauge"):
            ax.set_xticks([])
            ax.set_yticks([])
            texts = [
                f"{fmt(vs[-1], unit)}" + (f"  {lg}" if len(drawn) > 1 else "")
                for lg, _, vs in drawn
            ] or ["No data"]
            ax.text(
                0.5,
                0.45,
                "\n".join(texts),
                color=PALETTE[0],
                ha="center",
                va="center",
                size=18 if len(texts) == 1 else 12,
                transform=ax.transAxes,
            )
            continue
        stacked = p["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {})
        if stacked.get("mode") == "normal" and drawn:
            base = [0.0] * len(drawn[0][1])
            for (legend, ts, vs), color in zip(drawn, itertools.cycle(PALETTE)):
                vs = [0.0 if math.isnan(v) else v for v in vs][: len(base)]
                upper = [b + v for b, v in zip(base, vs, strict=True)]
                ax.fill_between(ts[: len(base)], base, upper, color=color, alpha=0.25, lw=0)
                ax.plot(ts[: len(base)], upper, color=color, lw=1.2, label=legend)
                base = upper
        else:
            for (legend, ts, vs), color in zip(drawn, itertools.cycle(PALETTE)):
                ax.plot(ts, vs, color=color, lw=1.2, label=legend)
        if not drawn:
            ax.text(0.5, 0.5, "No data", color="#8e8e8e", ha="center", transform=ax.transAxes)
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        ax.yaxis.set_major_formatter(lambda v, _pos, u=unit: fmt(v, u))
        ax.xaxis.set_major_formatter(lambda v, _pos: f"{v:.0f}s")
        ax.grid(color="#2c3235", lw=0.5)
        if drawn:
            ax.legend(
                loc="best",
                fontsize=7,
                frameon=False,
                labelcolor="#d8d9da",
                ncol=min(len(drawn), 3),
            )
    fig.savefig(out, facecolor=fig.get_facecolor())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--interval", type=float, default=2, help="seconds between scrapes")
    ap.add_argument("--rate-interval", default="20s", help="$__rate_interval")
    ap.add_argument("--clients", type=int, default=4, help="load threads")
    ap.add_argument("--new-images", type=float, default=0.2, help="share of fresh images")
    ap.add_argument("--no-load", action="store_true", help="only scrape")
    ap.add_argument("--out", type=Path, default=Path("dashboard.png"))
    ap.add_argument("--scrapes", type=Path, help="also write the scrapes here (JSON lines)")
    ap.add_argument("--replay", type=Path, help="draw from --scrapes of an earlier run")
    args = ap.parse_args(argv)
    if args.replay:
        scrapes = [_load_scrape(line) for line in args.replay.read_text().splitlines()]
    else:
        scrapes = record(args)
    if args.scrapes:
        args.scrapes.write_text("".join(_dump_scrape(t, s) + "\n" for t, s in scrapes))
    draw(json.loads(DASHBOARD.read_text()), scrapes, args.rate_interval, args.out)
    span = scrapes[-1][0] - scrapes[0][0]
    print(f"{args.out}: {len(scrapes)} scrapes over {span:.0f} s")


if __name__ == "__main__":
    main()
