"""Turn an ``image_url`` value into a hashed, preprocessed image.

Accepted: an uploaded image id (``img-...`` or ``mmserve://images/img-...``)
and ``data:<mime>;base64,...`` URLs. ``http(s)://`` URLs only when the
operator passed ``--allow-remote-images``, and then only to public addresses
(:mod:`api.remote_fetch`); ``file://`` URLs only inside
``--allowed-local-media-path``. Everything else is a 400 that says how to
upload instead.

Each image is decoded, hashed and preprocessed in one go and its decoded pixels
dropped before the next image of the request is read
(:meth:`~mmserve.frontend.processor.InputProcessor.prepare_image`); an image beyond the
request's pixel budget is a 400 naming it, and a server whose decoded-image budget
stays full answers 503 with ``Retry-After`` (:func:`busy_error`).
"""

from __future__ import annotations

import base64
import binascii
import logging
import urllib.parse
from pathlib import Path

from fastapi.concurrency import run_in_threadpool

from api.errors import APIError
from api.ids import IMAGE, id_like
from api.image_store import ImageStore
from api.remote_fetch import RemoteFetcher, RemoteFetchError, Resolver
from api.settings import ServerSettings
from mmserve.cancel import check_cancelled
from mmserve.frontend.processor import InputProcessor
from mmserve.vision.budget import DecodeBusyError, PixelBudgetError, RequestPixels
from mmserve.vision.image import ImageError, ImageLimits
from mmserve.vision.inputs import ImageInput

log = logging.getLogger(__name__)

UPLOAD_HINT = (
    "upload the image with POST /v1/images (multipart field 'file', or JSON "
    '{"data": "<base64>"}) and pass its id (img-...) as the url, or send a '
    "data:image/...;base64,... URL"
)


class MediaResolver:
    """Resolves image URLs against the store and the operator's permissions.

    Args:
        store: uploaded images.
        limits: image limits (the byte limit bounds downloads and local files).
        settings: which remote and local sources are allowed.
        transient_images: images from data URLs, remote URLs and files kept (memory only,
            apart from the uploads so that they never evict an upload) so that a repeated
            one skips decoding.
        resolver: host name -> addresses for remote URLs (default: the system's
            ``getaddrinfo``); tests inject one.
        processor: prepares images for requests (decode, hash, preprocess); None: the
            object whose bound method the store's ``prepare`` is
            (``InputProcessor.prepare_image``).
    """

    def __init__(
        self,
        store: ImageStore,
        limits: ImageLimits,
        settings: ServerSettings,
        transient_images: int = 256,
        resolver: Resolver | None = None,
        processor: InputProcessor | None = None,
    ) -> None:
        self.store = store
        self.processor = processor or getattr(store.prepare, "__self__", None)
        if self.processor is None:
            raise ValueError("MediaResolver needs the InputProcessor (processor=...)")
        # keys and sizes of images that came with their bytes (no files, no pixels)
        self.transient = ImageStore(store.prepare, max_images=transient_images, keep_files=False)
        self.limits = limits
        self.settings = settings
        local = settings.allowed_local_media_path
        self.local_root = Path(local).resolve() if local else None
        self.fetcher = RemoteFetcher(
            max_bytes=limits.max_bytes,
            timeout=settings.remote_image_timeout,
            max_redirects=settings.remote_image_max_redirects,
            allowed_networks=settings.allowed_networks(),
        )
        if resolver is not None:
            self.fetcher.resolver = resolver

    async def resolve(
        self,
        url: str,
        param: str,
        mode: str | None = None,
        pixels: RequestPixels | None = None,
    ) -> ImageInput:
        """The image that ``url`` names, prepared in ``mode`` for a request.

        Args:
            url: the ``image_url`` value.
            param: its request field (named by errors).
            mode: the mode to prepare it in (``InputProcessor.image_mode``); None returns
                the stored or decoded image unprepared (hashed, with its decoded image
                for a new one).
            pixels: the request's pixel count, charged with this image.

        Raises:
            APIError: 400 for a malformed or unknown id, a bad data URL, an undecodable or
                over-limit image, an image past the request's pixel budget, or a source the
                operator has not allowed; 503 when the server's decoded-image budget stays full.
            Cancelled: the request's client left (checked before the fetch, before the
                decode and inside it).
        """
        check_cancelled()
        url = url.strip()
        if id_like(url):
            # only uploads are addressable by id: a data-URL image's id is not an upload
            image = IMAGE.find(url, param, self.store.get)
            if mode is not None:
                return await self._prepare(image.source, param, mode, pixels, known=image)
            return image
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = decode_data_url(url, param)
        elif scheme in ("http", "https"):
            if not self.settings.allow_remote_images:
                raise APIError(
                    400,
                    f"{param}: remote image URLs are disabled on this server (the operator "
                    f"can allow them with --allow-remote-images); {UPLOAD_HINT}",
                    param=param,
                    code="unsupported_image_url",
                )
            data = await run_in_threadpool(self._fetch, url, param)
        elif scheme == "file" or url.startswith(("/", "./", "~")):
            data = await run_in_threadpool(self._read_local, url, param)
        else:
            raise APIError(
                400,
                f"{param}: unsupported image url; {UPLOAD_HINT}",
                param=param,
                code="unsupported_image_url",
            )
        check_cancelled()  # fetched or read: no decode for a client gone
        if mode is None:
            return await self.store_bytes(data, param, upload=False)
        known = self.transient.lookup(data)
        image = await self._prepare(data, param, mode, pixels, known=known)
        if known is None:
            self.transient.add(image, data)
        return image

    async def _prepare(
        self,
        data: bytes | None,
        param: str,
        mode: str,
        pixels: RequestPixels | None,
        known: ImageInput | None,
    ) -> ImageInput:
        try:
            return await run_in_threadpool(self.processor.prepare_image, data, mode, pixels, known)
        except ImageError as e:
            raise image_error(e, param) from None
        except DecodeBusyError as e:
            raise busy_error(e) from None

    async def store_bytes(
        self, data: bytes, param: str, upload: bool = True, name: str = ""
    ) -> ImageInput:
        """Decode, hash and keep ``data``: in the upload store (under ``name``, when not
        empty), else in the transient cache.

        Raises:
            APIError: 400 ``invalid_image`` naming the problem.
        """
        store = self.store if upload else self.transient
        try:
            if upload and name:
                return await run_in_threadpool(store.put, data, True, name)
            return await run_in_threadpool(store.put, data)
        except ImageError as e:
            raise image_error(e, param) from None
        except DecodeBusyError as e:
            raise busy_error(e) from None

    def _fetch(self, url: str, param: str) -> bytes:
        """The bytes of a remote image (:class:`~api.remote_fetch.RemoteFetcher` rules).

        Raises:
            APIError: 400 ``image_url_not_allowed`` for a URL, address or redirect the
                server does not fetch; 400 ``invalid_image`` for a body over the byte
                limit; 400 ``image_fetch_failed`` otherwise. The message never repeats
                what the remote side answered.
        """
        try:
            return self.fetcher.fetch(url)
        except RemoteFetchError as e:
            log.info("remote image %s refused or failed: %s (%s)", param, e.message, e.detail)
            if e.refused:
                code = "image_url_not_allowed"
                msg = f"{param}: image URL refused: {e.message}"
            else:
                code = "invalid_image" if e.too_large else "image_fetch_failed"
                msg = f"{param}: {e.message}"
            raise APIError(400, msg, param=param, code=code) from None

    def _read_local(self, url: str, param: str) -> bytes:
        if self.local_root is None:
            raise APIError(
                400,
                f"{param}: local file paths are disabled on this server (the operator can "
                f"allow a directory with --allowed-local-media-path); {UPLOAD_HINT}",
                param=param,
                code="unsupported_image_url",
            )
        raw = urllib.parse.unquote(urllib.parse.urlparse(url).path) if "://" in url else url
        path = Path(raw).expanduser().resolve()
        if not path.is_relative_to(self.local_root) or not path.is_file():
            raise APIError(
                400,
                f"{param}: {raw!r} is not a file inside the allowed media directory",
                param=param,
                code="unsupported_image_url",
            )
        if path.stat().st_size > self.limits.max_bytes:
            raise APIError(
                400,
                f"{param}: file is over {self.limits.max_bytes} bytes",
                param=param,
                code="invalid_image",
            )
        return path.read_bytes()


def check_image_count(n: int, limit: int, param: str, what: str = "images") -> None:
    """Refuse ``n`` images in one request over ``limit`` (``max_images_per_request``),
    before any is decoded; ``what`` says what was counted.

    Raises:
        APIError: 400 ``too_many_images`` naming ``param``.
    """
    if n > limit:
        raise APIError(
            400,
            f"{n} {what} in one request; the limit is {limit}",
            param=param,
            code="too_many_images",
        )


def image_error(e: ImageError, param: str) -> APIError:
    """The 400 for an image refused at ``param``: ``request_image_pixels_exceeded`` past the
    request's pixel budget, else ``invalid_image``."""
    code = "request_image_pixels_exceeded" if isinstance(e, PixelBudgetError) else "invalid_image"
    return APIError(400, f"{param}: {e}", param=param, code=code)


def busy_error(e: DecodeBusyError) -> APIError:
    """The 503 (with ``Retry-After``) for a decoded-image budget that stayed full."""
    return APIError(
        503,
        str(e),
        "server_error",
        code="image_decode_busy",
        headers={"Retry-After": str(e.retry_after)},
    )


def decode_data_url(url: str, param: str) -> bytes:
    """The bytes of a ``data:<mime>;base64,<payload>`` URL.

    Raises:
        APIError: 400 if it is not base64 or not in that form.
    """
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise APIError(
            400,
            f"{param}: data URL must be data:<mime>;base64,<data>",
            param=param,
            code="invalid_data_url",
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(
            400,
            f"{param}: data URL payload is not valid base64",
            param=param,
            code="invalid_data_url",
        ) from None
