"""The web page at ``/`` in a real browser (Playwright driving the system's Chromium).

A real ``mmserve serve`` subprocess; the page uploads a photo and the sample video
through its file input, asks two questions (the second reports the photo's tokens
as cached), runs per-frame video QA to the end of its progress bar, shows a 401's
message for a wrong key and works with the right one. Key elements must be on
screen at a desktop and a phone width, and every request the page makes must go
to the server's own origin. ``MMSERVE_SCREENSHOT_DIR=docs`` also writes the
README's screenshots (palette PNGs) there. The live panel streams Chromium's fake
camera and screen to ``/v1/streams`` on a LLaVA-OneVision server and asks about them.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.helpers import SAMPLES
from tests.live_server import live_server

CHROMIUM = os.environ.get("MMSERVE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # a fake camera (a moving test pattern) and screen, granted without a prompt
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
WAIT_MS = 60_000  # the longest any one wait may take
PHOTO = SAMPLES / "cat.png"
ROCKET = SAMPLES / "rocket.jpg"
VIDEO = SAMPLES.parent / "video" / "pans.mp4"
KEY = "page-test-key"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), (
        f"no Chromium at {CHROMIUM}: apt-get install chromium (.ci/run does), "
        "or set MMSERVE_CHROMIUM"
    )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=WAIT_MS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    disk = str(tmp_path_factory.mktemp("kv-disk"))
    tiers = (
        "--kv-host-bytes",
        str(64 << 20),
        "--kv-disk-dir",
        disk,
        "--kv-disk-bytes",
        str(1 << 30),
    )
    with live_server(model_dir, "--max-total-tokens", "8192", *tiers) as url:
        yield url


@pytest.fixture(scope="module")
def onevision_server(families) -> Iterator[str]:
    """A server on the tiny LLaVA-OneVision checkpoint (the streams' video path)."""
    with live_server(families["llava-onevision"].model_dir, "--max-total-tokens", "8192") as url:
        yield url


@contextmanager
def opened(browser: Browser, url: str, viewport: dict) -> Iterator[Page]:
    """A fresh page on ``url``; afterwards, every request it made must be to ``url``'s origin."""
    context = browser.new_context(viewport=viewport)
    context.set_default_timeout(WAIT_MS)
    seen: list[str] = []
    context.on("request", lambda r: seen.append(r.url))
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(url + "/")
        yield page
    finally:
        context.close()
    origin = _origin(url)
    outside = [u for u in seen if _origin(u) != origin]
    assert seen and not outside, outside
    assert not errors, errors  # no uncaught JavaScript error


def _origin(url: str) -> str:
    u = urllib.parse.urlsplit(url.removeprefix("blob:"))  # blob: URLs of the page's origin
    return f"{u.scheme}://{u.netloc}"


def upload(page: Page, path: Path) -> None:
    """Upload through the page's file input; wait for the item to be listed and selected."""
    page.set_input_files("#file-input", str(path))
    expect(page.locator("#media-list li.selected .name")).to_have_text(path.name, timeout=WAIT_MS)


def ask(page: Page, questions: list[str], max_tokens: int = 8) -> None:
    page.fill("#questions", "\n".join(questions))
    page.fill("#max-tokens", str(max_tokens))
    page.click("#ask")


def wait_answers(page: Page, n: int) -> list[dict]:
    """Wait until ``n`` answer cards are done; their question, answer and cached tokens."""
    cards = page.locator(".answer-card")
    expect(cards).to_have_count(n, timeout=WAIT_MS)
    for i in range(n):
        expect(cards.nth(i)).to_have_attribute("data-state", "done", timeout=WAIT_MS)
    return [
        {
            "question": cards.nth(i).locator(".question").inner_text(),
            "answer": cards.nth(i).locator(".answer").text_content(),
            "cached": int(cards.nth(i).get_attribute("data-cached")),
            "meta": cards.nth(i).locator(".meta").inner_text(),
        }
        for i in range(n)
    ]


def check_cache_bars(page: Page, answers: list[dict]) -> None:
    """Each done card's bar splits its prompt into cached and computed tokens (widths in
    proportion), says whether the vision tower ran, and the session totals add them up."""
    cards = page.locator(".answer-card")
    cached_total, saved = 0, 0
    for i, a in enumerate(answers):
        card = cards.nth(i)
        prompt = int(re.search(r"of (\d+) prompt tokens", a["meta"]).group(1))
        legend = card.locator(".cache-bar .legend")
        computed = prompt - a["cached"]
        expect(legend.locator(".key-cached")).to_have_text(f"{_tokens(a['cached'])} cached")
        expect(legend.locator(".key-computed")).to_have_text(f"{_tokens(computed)} computed")
        widths = card.locator(".cache-bar .bar span").evaluate_all(
            "s => s.map(e => e.getBoundingClientRect().width)"
        )
        assert widths[0] / sum(widths) == pytest.approx(a["cached"] / prompt, abs=0.02)
        skipped = a["cached"] >= 576
        expect(legend.locator(".tower")).to_have_text(
            "vision tower skipped" if skipped else "vision tower run"
        )
        cached_total += a["cached"]
        saved += skipped
    expect(page.locator("#stat-session-cached")).to_have_text(f"{cached_total:,}")
    expect(page.locator("#stat-session-tower")).to_have_text(str(saved))


def _tokens(n: int) -> str:
    return f"{n:,} token" + ("" if n == 1 else "s")


def check_on_screen(page: Page, selectors: list[str], scroll: bool) -> None:
    """Each selector's element is visible with its whole box inside the viewport (after
    scrolling it into view when ``scroll``), and nothing overflows sideways."""
    vp = page.viewport_size
    for sel in selectors:
        loc = page.locator(sel).first
        expect(loc).to_be_visible(timeout=WAIT_MS)
        if scroll:
            loc.scroll_into_view_if_needed()
        box = loc.bounding_box()
        assert box and box["width"] > 0 and box["height"] > 0, sel
        assert box["x"] >= 0 and box["x"] + box["width"] <= vp["width"] + 0.5, (sel, box)
        # half a pixel either way: scrolling a box of fractional height into view rounds
        assert box["y"] >= -0.5 and box["y"] + box["height"] <= vp["height"] + 0.5, (sel, box)
    assert page.evaluate("document.documentElement.scrollWidth") <= vp["width"]


def screenshot(page: Page, tmp_path: Path, name: str) -> None:
    """Screenshot the viewport; also into ``$MMSERVE_SCREENSHOT_DIR`` as a small palette PNG."""
    path = tmp_path / name
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(path))
    with Image.open(path) as im:
        assert im.size == (page.viewport_size["width"], page.viewport_size["height"])
        if out := os.environ.get("MMSERVE_SCREENSHOT_DIR"):
            im.convert("RGB").quantize(64).save(Path(out) / name, optimize=True)


KEY_ELEMENTS = [
    "#drop",
    "#media-list li",
    "#questions",
    "#ask",
    "#stats",
    "#stat-session-cached",
    "#stat-session-tower",
    "#random-note",
    "#results",
]


def test_image_two_questions_stream_and_the_second_is_cached(
    browser: Browser, server: str, tmp_path: Path
) -> None:
    with opened(browser, server, DESKTOP) as page:
        expect(page.locator("#model-name")).to_have_text("llava-tiny", timeout=WAIT_MS)
        expect(page.locator("#key-box")).to_be_hidden()  # this server has no key
        # make-model's checkpoint: the page says its answers are noise
        expect(page.locator("#random-note")).to_be_visible()
        expect(page.locator("#random-note")).to_contain_text("seeded random numbers")
        upload(page, PHOTO)
        item = page.locator("#media-list li.selected")
        assert re.fullmatch(r"img-[0-9a-f]{32}", item.locator(".id").inner_text())
        expect(item.locator(".size")).to_contain_text("451×300")
        expect(item.locator(".size")).to_contain_text("576 tokens (low: 576)")
        expect(page.locator("#detail")).to_have_value("auto")  # image_url.detail
        ask(page, ["What is in this picture?", "What colours stand out?"])
        first, second = wait_answers(page, 2)
        assert first["question"] == "What is in this picture?"
        assert first["answer"] and second["answer"]
        assert first["cached"] < 576 <= second["cached"], (first, second)
        assert f"cached {second['cached']} of" in second["meta"] and " s" in second["meta"]
        assert "(576 image)" in second["meta"]
        check_cache_bars(
            page, [first, second]
        )  # the stats panel refreshes after the questions: one vision-tower run
        expect(page.locator("#stat-tower")).to_have_text("1", timeout=WAIT_MS)
        expect(page.locator("#stat-hit")).to_have_text(re.compile(r"\d+\.\d%"))
        expect(page.locator("#stat-kv")).to_contain_text("of 8192 tokens")
        # the KV tiers: nothing evicted into host memory; on disk the photo's features
        expect(page.locator("#stat-tier-host")).to_have_text("0 B of 64.0 MB, 0 tokens loaded")
        expect(page.locator("#stat-tier-disk")).to_have_text(
            re.compile(r"^0 pages, 1 image, \d+(\.\d)? KB of 1\.0 GB, 0 tokens loaded$"),
            timeout=WAIT_MS,
        )
        expect(page.locator("#error")).to_be_hidden()
        # an API error is shown as the API words it
        image_id = item.locator(".id").inner_text()
        ask(page, ["Too long?"], max_tokens=10**8)
        card = page.locator(".answer-card")
        expect(card).to_have_attribute("data-state", "error", timeout=WAIT_MS)
        parts = [
            {"type": "image_url", "image_url": {"url": image_id}},
            {"type": "text", "text": "Too long?"},
        ]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 10**8}
        expect(card.locator(".meta")).to_have_text(_error_message(server, body, 400))


def test_video_per_frame_progress_reaches_the_end(
    browser: Browser, server: str, tmp_path: Path
) -> None:
    with opened(browser, server, DESKTOP) as page:
        upload(page, PHOTO)
        upload(page, VIDEO)
        item = page.locator("#media-list li.selected")
        assert item.get_attribute("data-kind") == "video"
        expect(item.locator(".size")).to_contain_text("4.0 s, 40 frames at 10 fps")
        expect(page.locator("#video-options")).to_be_visible()
        page.select_option("#frames-by", "num_frames")
        page.fill("#frames-value", "3")
        page.select_option("#mode", "per_frame")
        ask(page, ["What is in this picture?", "What colours stand out?"])
        run = page.locator(".video-run")
        expect(run).to_have_attribute("data-state", "done", timeout=WAIT_MS)
        bar = run.locator("progress")
        assert bar.evaluate("b => [b.value, b.max]") == [6, 6]
        expect(run.locator(".count")).to_have_text("6 / 6")
        stamps = run.locator("th.ts").all_inner_texts()
        assert len(stamps) == 3 and all(re.fullmatch(r"\d+\.\d\d s", t) for t in stamps), stamps
        assert run.locator("td.pending").count() == 0 and run.locator("td").count() == 6
        expect(run.locator(".meta")).to_contain_text("6 answers over 3 distinct frames")
        expect(run.locator(".meta")).to_contain_text("3 vision-tower runs")
        # 6 answers over 3 frames, 3 tower runs: the caches spared 3
        expect(page.locator("#stat-session-tower")).to_have_text("3")
        check_on_screen(page, [*KEY_ELEMENTS, "#video-options", ".video-run progress"], False)
        screenshot(page, tmp_path, "web-page-desktop.png")


def test_phone_width_layout(browser: Browser, server: str, tmp_path: Path) -> None:
    with opened(browser, server, PHONE) as page:
        upload(page, PHOTO)
        ask(page, ["What is in this picture?", "What colours stand out?"])
        answers = wait_answers(page, 2)
        check_cache_bars(page, answers)
        check_on_screen(
            page, [*KEY_ELEMENTS, "#schema-box", ".answer-card", ".cache-bar .legend"], True
        )
        screenshot(page, tmp_path, "web-page-phone.png")
        # a JSON schema typed in the box goes out as response_format json_schema
        page.click("#schema-box summary")
        schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
        page.fill("#schema", json.dumps(schema))
        with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as req:
            ask(page, ["What is it?"])
        assert req.value.post_data_json["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        }
        card = page.locator(".answer-card")
        expect(card).not_to_have_attribute("data-state", "running", timeout=WAIT_MS)
        page.fill("#schema", "{not json")
        ask(page, ["What is it?"])
        expect(page.locator("#error")).to_contain_text("the JSON schema is not valid JSON")


def test_api_key_wrong_shows_the_401_and_right_works(
    browser: Browser, model_dir: Path, tmp_path: Path
) -> None:
    with live_server(model_dir, "--max-total-tokens", "8192", "--api-key", KEY) as url:
        missing, invalid = (
            _error_message(url, {}, 401, h) for h in ({}, {"Authorization": "Bearer no"})
        )
        for path in ("/", "/static/app.js", "/static/style.css"):  # the page needs no key
            with urllib.request.urlopen(url + path, timeout=10) as r:
                assert r.status == 200
        with opened(browser, url, DESKTOP) as page:
            expect(page.locator("#key-box")).to_be_visible(timeout=WAIT_MS)
            expect(page.locator("#error")).to_have_text(missing, timeout=WAIT_MS)
            page.fill("#api-key", "wrong")
            page.press("#api-key", "Enter")
            with page.expect_response(lambda r: r.url.endswith("/v1/images")) as resp:
                page.set_input_files("#file-input", str(PHOTO))
            assert resp.value.status == 401
            expect(page.locator("#error")).to_have_text(invalid, timeout=WAIT_MS)
            assert page.locator("#media-list li").count() == 0
            page.fill("#api-key", KEY)
            page.press("#api-key", "Enter")
            expect(page.locator("#model-name")).to_have_text("llava-tiny", timeout=WAIT_MS)
            upload(page, PHOTO)
            expect(page.locator("#error")).to_be_hidden()
            ask(page, ["What is it?"])
            (answer,) = wait_answers(page, 1)
            assert answer["answer"]
            expect(page.locator("#stat-tower")).to_have_text("1", timeout=WAIT_MS)


def _error_message(url: str, body: dict, status: int, headers: dict | None = None) -> str:
    """The ``error.message`` of a chat completion refused with ``status``."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == status
    return json.loads(e.value.read())["error"]["message"]


def test_page_files_are_served_without_a_key_and_nothing_else_is(server: str) -> None:
    for path, kind in [
        ("/", "text/html"),
        ("/static/app.js", "text/javascript"),
        ("/static/style.css", "text/css"),
    ]:
        with urllib.request.urlopen(server + path, timeout=10) as r:
            assert r.headers["Content-Type"].startswith(kind)
            body = r.read().decode()
        # no URL of another host anywhere in the page's files
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", body, re.I), path
    for path in ["/static/index.html", "/static/..%2fapp.py", "/static/nope.js"]:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server + path, timeout=10)
        assert e.value.code == 404


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_page_lists_images_and_videos_stored_before_it_opened(
    browser: Browser, server: str, viewport: dict
) -> None:
    import httpx

    ids = {}
    names = {"image": "my rocket.jpg", "video": "pans.mp4"}
    for kind, path, mime in [("image", ROCKET, "image/jpeg"), ("video", VIDEO, "video/mp4")]:
        files = {"file": (names[kind], path.read_bytes(), mime)}
        r = httpx.post(f"{server}/v1/{kind}s", files=files, timeout=60)
        assert r.status_code == 200, r.text
        ids[kind] = r.json()["id"]
    with opened(browser, server, viewport) as page:
        for kind, item_id in ids.items():
            item = page.locator(f'#media-list li[data-id="{item_id}"]')
            expect(item).to_have_attribute("data-kind", kind, timeout=WAIT_MS)
            # the name it was uploaded under, and the server's thumbnail drawn
            expect(item.locator(".name")).to_have_text(names[kind])
            thumb = item.locator("img.thumb.stored")
            expect(thumb).to_have_attribute("src", re.compile(r"^blob:"), timeout=WAIT_MS)
            thumb.scroll_into_view_if_needed()
            page.wait_for_function(
                "t => t.complete && t.naturalWidth > 0", arg=thumb.element_handle()
            )
            assert thumb.evaluate("t => Math.max(t.naturalWidth, t.naturalHeight)") == 256
            check_on_screen(page, [f'li[data-id="{item_id}"] img.thumb'], True)
        expect(page.locator(f'li[data-id="{ids["image"]}"] .size')).to_contain_text("576 tokens")
        page.click(f'li[data-id="{ids["video"]}"]')  # a listed item can be asked about
        expect(page.locator("#video-options")).to_be_visible()
        expect(page.locator("#ask")).to_be_enabled()


def _stream(url: str, stream_id: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/streams/{stream_id}", timeout=10) as r:
        return json.loads(r.read())


def _wait_frames(url: str, stream_id: str, n: int) -> dict:
    """``GET /v1/streams/{id}`` once the server holds at least ``n`` frames prefilled."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while (info := _stream(url, stream_id))["cached"]["frames"] < n:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    return info


def panel_screenshot(page: Page, tmp_path: Path, name: str) -> None:
    """Screenshot the live panel; also into ``$MMSERVE_SCREENSHOT_DIR`` as a palette PNG."""
    path = tmp_path / name
    page.locator("#live-panel").screenshot(path=str(path))
    with Image.open(path) as im:
        assert im.size[0] > 300 and im.size[1] > 200
        if out := os.environ.get("MMSERVE_SCREENSHOT_DIR"):
            im.convert("RGB").quantize(64).save(Path(out) / name, optimize=True)


def test_live_panel_streams_the_camera_and_answers_from_the_cache(
    browser: Browser, onevision_server: str, tmp_path: Path
) -> None:
    url = onevision_server
    with opened(browser, url, DESKTOP) as page:
        expect(page.locator("#live-ask")).to_be_disabled()  # no stream yet
        page.fill("#live-interval", "0.5")
        page.fill("#max-tokens", "4")
        # what the page puts in its forms (Playwright cannot read a body built of blobs)
        page.evaluate(
            """() => {
            window.formParts = [];
            const append = FormData.prototype.append;
            FormData.prototype.append = function (name, value, filename) {
              window.formParts.push([name, value instanceof Blob ? value.type : value, filename]);
              return append.apply(this, arguments);
            };
          }"""
        )
        page.click("#live-start")
        panel = page.locator("#live-panel")
        expect(panel).to_have_attribute("data-stream", re.compile(r"^stream-"))
        stream_id = panel.get_attribute("data-stream")
        # the server received frames from the page, one every half second
        info = _wait_frames(url, stream_id, 3)
        # each a JPEG of the camera's picture with its seconds since Start
        parts = page.evaluate("window.formParts")
        assert parts[:2] == [
            ["file", "image/jpeg", "frame-0.jpg"],
            ["timestamp", parts[1][1], None],
        ]
        stamps = [float(v) for name, v, _ in parts if name == "timestamp"]
        assert 0 <= stamps[0] < 5 and stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
        assert info["window"]["start"] == pytest.approx(stamps[0], abs=1e-3)
        assert (
            info["window"]["end"] - info["window"]["start"]
            >= 0.5 * (info["frames_held"] - 1) - 0.01
        )
        expect(page.locator("#live-status")).to_contain_text(f"{stream_id} · ")
        expect(page.locator("#live-status")).to_contain_text("frames held of 32 (")  # default
        page.fill("#live-question", "What just happened?")
        page.click("#live-ask")
        card = page.locator(".live-card").first
        expect(card).to_have_attribute("data-state", "done", timeout=WAIT_MS)
        expect(card.locator(".question")).to_have_text("What just happened?")
        assert card.locator(".answer").text_content()
        # the frames were prefilled as they came: the answer found them in the cache
        cached = int(card.get_attribute("data-cached"))
        per_frame = 16  # the tiny OneVision checkpoint's pooled frame
        assert cached >= info["cached"]["frames"] * per_frame, (cached, info)
        ttft = float(card.get_attribute("data-ttft"))
        meta = card.locator(".meta").inner_text()
        shown = re.search(r"TTFT (\d+\.\d\d) s here", meta)
        # data-ttft has 3 decimals and the text 2, both rounded from the same figure
        assert 0 < ttft < WAIT_MS / 1000 and shown, meta
        assert abs(float(shown.group(1)) - ttft) <= 0.0051, (ttft, meta)
        prompt = int(re.search(r"cached \d+ of (\d+) prompt tokens", meta).group(1))
        assert f"cached {cached} of {prompt} prompt tokens" in meta and cached < prompt
        expect(card.locator(".cache-bar .key-cached")).to_have_text(f"{_tokens(cached)} cached")
        expect(page.locator("#stat-session-cached")).to_have_text(f"{cached:,}")
        check_on_screen(page, ["#live-video", "#live-status", ".live-card .meta"], True)
        panel_screenshot(page, tmp_path, "web-page-live.png")
        # stop: the capture ends and the stream is deleted on the server
        page.click("#live-stop")
        expect(page.locator("#live-status")).to_have_text(f"stopped; {stream_id} deleted")
        expect(page.locator("#live-view")).to_be_hidden()
        with pytest.raises(urllib.error.HTTPError) as e:
            _stream(url, stream_id)
        assert e.value.code == 404
        assert page.evaluate("document.querySelector('#live-video').srcObject") is None
        # a shared screen works the same way; the window box sets the stream's max_frames
        page.select_option("#live-source", "screen")
        page.fill("#live-window", "8")
        page.click("#live-start")
        expect(panel).to_have_attribute("data-stream", re.compile(r"^stream-"))
        screen_id = panel.get_attribute("data-stream")
        assert screen_id != stream_id
        assert _wait_frames(url, screen_id, 1)["max_frames"] == 8
        page.click("#live-stop")
        expect(page.locator("#live-status")).to_have_text(f"stopped; {screen_id} deleted")
        # a frame interval that is not a number of seconds is refused before anything starts
        page.fill("#live-interval", "0")
        page.click("#live-start")
        expect(page.locator("#error")).to_contain_text("a frame every")
        expect(page.locator("#live-status")).to_have_text(f"stopped; {screen_id} deleted")
