"""Bad input gets a clear 4xx and leaves the server healthy; odd but valid images are answered.

After every refusal the same app answers a normal request and the KV pool
accounting holds (free + tree + running pages = pool size: invariant (3),
docs/architecture.md, section 2).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFile, ImageOps

from api.app import ServerSettings, create_app
from mmserve.vision.image import ImageLimits
from tests.helpers import (
    assert_error,
    assert_healthy,
    chat,
    data_url,
    image_part,
    png_bytes,
    upload,
)

MODEL = "llava-tiny"
MAX_IMAGE_BYTES = 1_000_000


@pytest.fixture(scope="module")
def client(make_engine):
    engine = make_engine(
        max_total_tokens=8192,
        max_images_per_request=2,
        image_limits=ImageLimits(max_bytes=MAX_IMAGE_BYTES),
    )
    settings = ServerSettings(served_model_name=MODEL, max_request_bytes=4 * MAX_IMAGE_BYTES)
    with TestClient(create_app(engine, settings)) as c:
        c.engine = engine
        yield c


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and that holds almost no data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    body = struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    idat = b"IDAT" + zlib.compress(b"\0" * 64)
    body += struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat))
    return b"\x89PNG\r\n\x1a\n" + body


def gif_header(width: int, height: int) -> bytes:
    """A GIF whose logical screen and frame claim ``width`` x ``height``."""
    return (
        b"GIF89a"
        + struct.pack("<HHBBB", width, height, 0, 0, 0)
        + b","
        + struct.pack("<HHHHB", 0, 0, width, height, 0)
        + b"\x02\x02\x44\x01\x00;"
    )


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """Incompressible pixels: about 3 bytes per pixel as PNG."""
    rng = np.random.default_rng(seed)
    return png_bytes(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


# ---- broken or hostile uploads -------------------------------------------------------


@pytest.mark.parametrize(
    "name, words",
    [
        ("empty.png", "empty"),
        ("truncated.png", "truncated"),
        ("not-an-image.jpg", "not a decodable image"),
        ("bomb-header-50000.png", "refused before decoding"),
    ],
)
def test_broken_case_files_are_refused(client, cases_dir, name, words) -> None:
    r = upload(client, (cases_dir / name).read_bytes(), name)
    err = assert_error(r, 400, words, "invalid_image")
    assert err["param"] == "file"
    assert_healthy(client)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The sizes of the images Pillow decodes (``ImageFile.load``) while a test runs."""
    seen: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def counted(im: ImageFile.ImageFile):
        seen.append(im.size)
        return load(im)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return seen


@pytest.mark.parametrize(
    "data, words",
    [
        (png_header(50_000, 50_000), "refused before decoding"),
        (png_header(10_000, 5_000), "10000x5000 pixels"),
        (png_header(20_000, 100), "20000x100 pixels"),
        (gif_header(65_535, 65_535), "refused before decoding"),
        (gif_header(9_000, 9_000), "9000x9000 pixels"),
        (png_header(1, 900), "aspect ratio"),
        (png_header(3_000, 2), "aspect ratio"),
    ],
)
def test_bomb_headers_refused_before_decoding(client, decodes, data, words) -> None:
    r = upload(client, data)
    assert decodes == []  # refused from the header: no pixel was decoded
    assert_error(r, 400, words, "invalid_image")
    assert_healthy(client)


def test_degenerate_aspect_case_file_is_refused_before_decoding(client, decodes, cases_dir) -> None:
    r = upload(client, (cases_dir / "one-pixel-high.png").read_bytes())
    assert decodes == []
    assert_error(r, 400, "900x1", "invalid_image")
    # a sound image of the same kind is decoded (the count sees the server's decoder)
    ok = upload(client, png_bytes(Image.new("RGB", (90, 60), (1, 2, 3))))
    assert ok.status_code == 200, ok.text
    assert (90, 60) in decodes
    assert_healthy(client)


def test_image_over_the_byte_limit(client) -> None:
    big = noise_png(620, 620)
    assert MAX_IMAGE_BYTES < len(big) < 2 * MAX_IMAGE_BYTES
    assert_error(upload(client, big), 400, f"limit is {MAX_IMAGE_BYTES} bytes", "invalid_image")
    r = client.post("/v1/images", json={"data": base64.b64encode(big).decode()})
    assert_error(r, 400, f"limit is {MAX_IMAGE_BYTES} bytes", "invalid_image")
    r = chat(client, [image_part(data_url(big)), {"type": "text", "text": "hi"}])
    assert_error(r, 400, f"limit is {MAX_IMAGE_BYTES} bytes", "invalid_image")
    assert_healthy(client)


def test_request_body_over_the_limit_is_413(client) -> None:
    huge = b"\0" * (4 * MAX_IMAGE_BYTES + 1)
    r = client.post("/v1/images", content=huge, headers={"content-type": "application/json"})
    assert_error(r, 413, "request body is over", "too_large")

    def chunks():  # no Content-Length: counted while reading
        for _ in range(5):
            yield b"\0" * MAX_IMAGE_BYTES

    r = client.post("/v1/images", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "request body is over")
    assert_healthy(client)


@pytest.mark.parametrize(
    "kwargs, status, words",
    [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "JSON"),
        ({"json": {"data": "@@not base64@@"}}, 400, "base64"),
        ({"json": {"image": "x"}}, 400, '{"data"'),
        ({"files": {"photo": ("a.png", b"123")}}, 400, "named 'file'"),
        ({"content": b"raw", "headers": {"content-type": "image/png"}}, 415, "multipart"),
    ],
)
def test_malformed_uploads(client, kwargs, status, words) -> None:
    assert_error(client.post("/v1/images", **kwargs), status, words)
    assert_healthy(client)


# ---- bad chat requests ----------------------------------------------------------------


def test_too_many_images_refused_before_decoding(client, photos) -> None:
    bad = "data:image/png;base64,@@@"  # would be a base64 error if it were decoded
    r = chat(client, [image_part(bad)] * 3 + [{"type": "text", "text": "hi"}])
    assert_error(r, 400, "3 images in one request; the limit is 2", "too_many_images")
    good = upload(client, photos["cat.png"]).json()["id"]
    msgs = [
        {"role": "user", "content": [image_part(good), {"type": "text", "text": "a"}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [image_part(good), image_part(good)]},
    ]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
    assert_error(r, 400, "the limit is 2", "too_many_images")
    assert_healthy(client)


@pytest.mark.parametrize(
    "content, kw, status, words, param",
    [
        ([image_part("img-" + "0" * 32)], {}, 400, "unknown image id", None),
        ([image_part("mmserve://images/img-" + "a" * 32)], {}, 400, "unknown image id", None),
        ([image_part("data:image/png;base64,@@@not-base64")], {}, 400, "not valid base64", None),
        ([image_part("data:image/png,plain")], {}, 400, "data:<mime>;base64", None),
        ([image_part("https://example.com/a.png")], {}, 400, "--allow-remote-images", None),
        ([image_part("file:///etc/passwd")], {}, 400, "--allowed-local-media-path", None),
        ([image_part("/etc/hosts")], {}, 400, "POST /v1/images", None),
        ([image_part("ftp://x/y.png")], {}, 400, "POST /v1/images", None),
        ([{"type": "image_url"}], {}, 400, "without a url", None),
        ("hello", {"max_tokens": -1}, 400, "max_tokens", "max_tokens"),
        ("hello", {"max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ("hello", {"max_tokens": 10**6}, 400, "context", "max_tokens"),
        ("hello", {"max_tokens": 10**30}, 400, "context", "max_tokens"),
        ("hello", {"max_completion_tokens": 8190}, 400, "context", "max_tokens"),
        ("hello", {"temperature": -0.5}, 400, "temperature", "temperature"),
        ("hello", {"temperature": 2.5}, 400, "temperature", "temperature"),
        ("hello", {"top_p": 0}, 400, "top_p", "top_p"),
        ("hello", {"top_k": -5}, 400, "top_k", "top_k"),
        ("hello", {"stop": [""]}, 400, "stop", "stop"),
        ("hello", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs"),
        ("hello", {"top_logprobs": 2}, 400, "needs logprobs", "top_logprobs"),
        ("hello", {"n": 0}, 400, "n", "n"),
        ("hello", {"n": 1000}, 400, "limit is 16", "n"),
        ("hello", {"seed": 2**64}, 400, "seed", "seed"),
        ("hello", {"model": "gpt-4"}, 404, "does not exist", "model"),
        ("what is <image> this", {}, 400, "placeholder", "messages"),
        ("hello", {"messages": []}, 400, "messages", "messages"),
        (
            "hello",
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]},
            400,
            "role",
            "messages[0].role",
        ),
    ],
)
def test_bad_chat_requests(client, content, kw, status, words, param) -> None:
    err = assert_error(chat(client, content, **kw), status, words)
    if param is not None:
        assert err["param"].startswith(param), err
    assert_healthy(client)


def test_image_outside_a_user_message(client, photos) -> None:
    image_id = upload(client, photos["cat.png"]).json()["id"]
    msgs = [{"role": "system", "content": [image_part(image_id)]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
    assert_error(r, 400, "only allowed in user messages")
    assert_healthy(client)


def test_malformed_json_and_wrong_types(client) -> None:
    for body in (b"{not json", b"[1, 2", b"\xff\xfe", b"null", b"[]", b'"text"'):
        r = client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": "hello"})
    assert_error(r, 400, "messages")
    assert_healthy(client)


def test_unknown_image_routes_are_404(client) -> None:
    missing = "img-" + "1" * 32
    assert_error(client.get(f"/v1/images/{missing}"), 404, "no image", "image_not_found")
    assert_error(client.delete(f"/v1/images/{missing}"), 404, "no image", "image_not_found")
    r = client.post(f"/v1/images/{missing}/ask", json={"questions": ["hi"]})
    assert_error(r, 404, "no image", "image_not_found")
    assert_error(client.get("/v1/nothing-here"), 404, "Not Found")
    assert_healthy(client)


# ---- odd but valid images -------------------------------------------------------------


@pytest.mark.parametrize(
    "name, mode",
    [
        ("gray-224.jpg", "L"),
        ("palette.png", "P"),
        ("rgba-64.png", "RGBA"),
        ("cmyk.jpg", "CMYK"),
        ("gray16.png", "L"),  # more than 8 bits per sample: scaled to 8-bit L
        ("animated.gif", "P"),
        ("one-by-one.png", "RGB"),
    ],
)
def test_odd_modes_and_sizes_are_answered(client, cases_dir, name, mode) -> None:
    info = upload(client, (cases_dir / name).read_bytes(), name).json()
    assert info["mode"] == mode, info
    r = chat(client, [image_part(info["id"]), {"type": "text", "text": "Describe."}])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens"] > 576
    assert_healthy(client)


def test_animated_gif_is_its_first_frame(client, cases_dir) -> None:
    data = (cases_dir / "animated.gif").read_bytes()
    frames = Image.open(io.BytesIO(data))
    first = frames.copy()
    frames.seek(1)
    second = frames.copy()
    a = upload(client, data, "animated.gif").json()
    assert a["id"] == upload(client, png_bytes(first)).json()["id"]
    assert a["id"] != upload(client, png_bytes(second)).json()["id"]


def test_exif_orientation_is_applied_before_hashing(client, cases_dir) -> None:
    data = (cases_dir / "exif-orientation-6.jpg").read_bytes()
    info = upload(client, data).json()
    assert (info["width"], info["height"]) == (16, 24)  # stored 24x16, rotated by EXIF
    rotated = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert upload(client, png_bytes(rotated)).json()["id"] == info["id"]
    unrotated = Image.open(io.BytesIO(data)).convert("RGB")
    assert upload(client, png_bytes(unrotated)).json()["id"] != info["id"]


def test_very_wide_panorama_is_answered(client) -> None:
    pano = Image.new("RGB", (4000, 300))
    pano.paste((200, 120, 40), (0, 0, 2000, 300))
    data = png_bytes(pano)
    assert len(data) < MAX_IMAGE_BYTES
    r = chat(client, [image_part(data_url(data)), {"type": "text", "text": "Where?"}])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 576
    assert_healthy(client)


@pytest.mark.parametrize(
    "part, param, words",
    [
        (
            {"type": "input_image", "image_url": "x"},
            "messages[0].content[1].type",
            "accepted types are 'text', 'image_url' or 'video_url'",
        ),
        ({"type": "image", "image": "x"}, "messages[0].content[1].type", "'image'"),
        ({"text": "hi"}, "messages[0].content[1].type", "field required"),
        (
            {"type": "image_url", "image_url": {"url": 123}},
            "messages[0].content[1].image_url.url",
            "expected a string",
        ),
        (
            {"type": "image_url", "image_url": {}},
            "messages[0].content[1].image_url.url",
            "field required",
        ),
        ({"type": "text", "text": ["a"]}, "messages[0].content[1].text", "expected a string"),
        (
            {"type": "video_url", "video_url": {"url": "v", "num_frames": "many"}},
            "messages[0].content[1].video_url.num_frames",
            "expected an integer",
        ),
    ],
)
def test_malformed_parts_name_the_deepest_field(client, part, param, words) -> None:
    err = assert_error(chat(client, [{"type": "text", "text": "a"}, part]), 400, words)
    assert err["param"] == param
    assert err["message"].startswith(param + ": ")
    assert ".str" not in err["message"] and "Input should" not in err["message"]
    assert_healthy(client)


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]},
            "messages[0].role",
            "'tool'",
        ),
        ({"messages": "hello"}, "messages", "expected an array"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": "3"},
            "max_tokens",
            "integer",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "max_tokens",
            "integer",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream", "boolean"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": "all"}, "top_k", "integer"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "expected"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "at least 1"),
    ],
)
def test_validation_errors_name_the_field(client, body, param, words) -> None:
    r = client.post("/v1/chat/completions", json={"max_tokens": 2, **body})
    err = assert_error(r, 400, words)  # strict types: "3" is not 3, true is not 1
    assert err["param"] == param
    assert_healthy(client)


def test_a_prompt_that_fills_the_context_is_not_blamed_on_max_tokens(make_engine) -> None:
    engine = make_engine(max_total_tokens=700)
    with TestClient(create_app(engine, ServerSettings(served_model_name=MODEL))) as c:
        long_text = "word " * 800
        for extra in ({}, {"max_tokens": 5}):
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": long_text}], **extra},
            )
            err = assert_error(r, 400, "no room for output")
            assert err["param"] == "messages"
            assert "max_tokens (" not in err["message"], err
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 699},
        )
        err = assert_error(r, 400, "max_tokens (699)")
        assert err["param"] == "max_tokens" and "at most" in err["message"]
        # with no max_tokens the same prompt is answered: the default is capped to the room
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
