"""HTTP-level settings of the server (the engine's are :class:`mmserve.config.EngineConfig`)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from api.remote_fetch import IPNetwork, parse_networks
from api.tenants import TenantFileError, TenantKeys
from mmserve.vision.video import VideoLimits

#: Environment variable read for the API key when ``--api-key`` is not given.
API_KEY_ENV = "MMSERVE_API_KEY"
#: Orders a batch's requests may run in (``--batch-order``).
BATCH_ORDERS = ("cache", "submitted")
#: Where stored responses and conversations live (``--responses-store``).
RESPONSE_STORES = ("memory", "disk", "off")


@dataclass
class ServerSettings:
    """Settings of the HTTP layer.

    Attributes:
        served_model_name: the name clients pass as ``model`` (default: the model dir name).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``
            (None: read ``MMSERVE_API_KEY``; empty: no key). One key is one tenant.
        api_keys: a file of ``KEY TENANT`` lines (``#`` comments and blank lines skipped):
            each key's requests are its tenant's; tenants share no cached state (unless
            ``shared_cache``) and see only their own uploads, files and batches. Read at
            start (a malformed line refuses to start, naming it) and on SIGHUP (a bad
            file then keeps the old keys). Not with ``api_key``.
        shared_cache: tenants share the prefix cache and image features (their requests
            are not salted with their tenant); ownership of stored objects stays.
        max_stored_images: most images the upload store keeps (LRU beyond it).
        max_stored_image_bytes: most decoded pixel bytes the upload store keeps (bytes).
        image_store_dir: directory where uploads are kept across restarts (None: memory only).
        allow_remote_images: fetch ``http(s)://`` image URLs (default: refused).
        allowed_local_media_path: directory whose files ``file://`` image URLs may name
            (None: local paths refused).
        remote_image_timeout: seconds for fetching one remote image, name lookups,
            connections, redirects and slow reads all included (a deadline, not a
            per-read timeout).
        remote_image_max_redirects: most redirects followed when fetching a remote image
            (each hop is checked like the first; 0 follows none).
        remote_image_allowed_networks: comma-separated CIDRs (e.g. 10.1.0.0/16,::1/128)
            that remote image URLs may point to although they are not public; by default
            a URL whose host resolves to any loopback, private, link-local, multicast,
            unspecified or other non-global address (IPv4, IPv6 and IPv4 embedded in
            IPv6) is refused, at every redirect.
        max_queued_requests: most requests submitted to the engine and still waiting for
            their first token; beyond it the server answers 503 with ``Retry-After``.
        retry_after_seconds: the ``Retry-After`` value sent with a 503 (seconds).
        max_request_bytes: largest request body (bytes); larger gets 413.
        max_json_depth: most nested arrays and objects in a JSON request body (the
            body itself counts 1; at most 512); deeper gets 400.
        max_questions: most questions in one ``/v1/images/{id}/ask`` call.
        max_n: most choices (``n``) in one chat completion.
        default_max_tokens: ``max_tokens`` when the client gives none (tokens; capped at
            what the context leaves).
        max_video_bytes: largest encoded video upload or data URL (bytes).
        max_video_frames: most frames sampled from a video for one request; ``fps`` and
            the default sampling are thinned to it, an exact ``num_frames`` or
            ``timestamps`` over it is refused.
        max_video_tokens: most pseudo-tokens one video's sampled frames may take in a
            prompt (None: no budget); thinned to or refused as ``max_video_frames``; a
            request's own max_video_tokens field may lower it, not raise it.
        max_video_side: largest video frame width or height (pixels).
        max_stored_videos: most videos the upload store keeps (LRU beyond it).
        max_stored_video_bytes: most encoded video bytes the upload store keeps (bytes).
        unhealthy_after_failed_steps: engine steps failing in a row after which
            ``/health`` answers 503.
        data_dir: directory of the ``/v1/files`` uploads (batch input files, output and
            error files) and the ``/v1/batches`` state and results, kept across restarts
            (None: ``$MMSERVE_CACHE_DIR/batches``, else ``$XDG_CACHE_HOME/mmserve/batches``,
            else ``~/.cache/mmserve/batches``; created on first use).
        max_batch_file_bytes: largest ``/v1/files`` upload (bytes); larger gets 400.
        max_batch_lines: most requests (lines) in one batch input file; more gets 400.
        max_stored_file_bytes: most bytes all stored files may take (uploads and batch
            output together); an upload beyond it gets 400 (delete files to make room).
        batch_max_in_flight: most requests of batch jobs submitted to the engine at once.
        batch_in_flight_with_online: most batch requests in flight while online (non-batch)
            requests are running, so that interactive traffic keeps its latency.
        batch_order: order of a batch's requests: "cache" (depth-first over their prompts'
            segments, so requests about one image or prefix run together) or "submitted"
            (input file order).
        otlp_traces_endpoint: URL of an OTLP/HTTP collector (e.g.
            http://localhost:4318/v1/traces; /v1/traces is added to a URL without a path)
            to which every /v1/ request's spans are sent (OpenTelemetry; needs
            pip install 'mmserve[tracing]'). None: no tracing, and the OpenTelemetry SDK
            is never imported.
        responses_store: where stored responses (``store``, ``previous_response_id``,
            background responses) and conversations live: "memory" (lost at exit),
            "disk" (under ``data_dir``/responses and /conversations, kept across
            restarts) or "off" (nothing stored; the fields that need it get a 400 naming
            this flag).
        max_stored_responses: most stored responses, and most conversations, kept
            (oldest evicted first).
        max_stored_response_bytes: most bytes all stored responses, and all
            conversations, take (their JSON; oldest evicted first).
        max_stored_object_bytes: most bytes one stored response or conversation may take
            (its JSON: input items, output and history); a request that would exceed it
            gets a 400.
        max_streams: most live video streams (``/v1/streams``) open at once, all tenants
            together; one more gets a 429 (delete one, or wait for an idle one to expire).
        stream_idle_seconds: a live video stream with no frames, questions or WebSocket
            for this long (seconds) is deleted and its cached prefix released.
        max_stream_frames_per_post: most frames one ``/v1/streams/{id}/frames`` call (or
            one WebSocket message) may carry; more gets a 400.
        max_stream_pixel_bytes: most bytes of prepared frame pixels all live streams may
            keep (bytes; a stream reserves ``max_frames`` times its frames' size at its
            first frame): past it a stream's frames get a 429 (400 when one stream's
            window alone needs more).
        stream_interval: tokens per streamed chunk (vLLM's and SGLang's name): a
            streamed answer's writer wakes for a request once it has this many new
            tokens (or its first token, or its end), so a chunk carries this many tokens
            (more when the reader is behind) and the server writes about that many times
            fewer events (1: every token as soon as it is made). Text is the same either
            way.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    api_keys: str | None = None
    shared_cache: bool = False
    max_stored_images: int = 256
    max_stored_image_bytes: int = 1 << 30
    image_store_dir: str | None = None
    allow_remote_images: bool = False
    allowed_local_media_path: str | None = None
    remote_image_timeout: float = 10.0
    remote_image_max_redirects: int = 3
    remote_image_allowed_networks: str = ""
    max_queued_requests: int = 256
    retry_after_seconds: int = 1
    max_request_bytes: int = 64 << 20
    max_json_depth: int = 64
    max_questions: int = 32
    max_n: int = 16
    default_max_tokens: int = 256
    max_video_bytes: int = 64 << 20
    max_video_frames: int = 64
    max_video_tokens: int | None = None
    max_video_side: int = 3840
    max_stored_videos: int = 32
    max_stored_video_bytes: int = 512 << 20
    unhealthy_after_failed_steps: int = 3
    data_dir: str | None = None
    max_batch_file_bytes: int = 64 << 20
    max_batch_lines: int = 50_000
    max_stored_file_bytes: int = 8 << 30
    batch_max_in_flight: int = 8
    batch_in_flight_with_online: int = 1
    batch_order: str = "cache"
    otlp_traces_endpoint: str | None = None
    responses_store: str = "memory"
    max_stored_responses: int = 10_000
    max_stored_response_bytes: int = 1 << 30
    max_stored_object_bytes: int = 16 << 20
    max_streams: int = 16
    stream_idle_seconds: float = 300.0
    max_stream_frames_per_post: int = 32
    max_stream_pixel_bytes: int = 2 << 30
    stream_interval: int = 1

    def video_limits(self) -> VideoLimits:
        """The video bounds these settings give."""
        side = self.max_video_side
        return VideoLimits(
            self.max_video_bytes,
            self.max_video_frames,
            side,
            min(side * side, 3840 * 2160),
            max_tokens=self.max_video_tokens,
        )

    def resolved_data_dir(self) -> Path:
        """``data_dir``, else ``$MMSERVE_CACHE_DIR/batches``, else
        ``$XDG_CACHE_HOME/mmserve/batches``, else ``~/.cache/mmserve/batches``."""
        if self.data_dir:
            return Path(self.data_dir)
        root = os.environ.get("MMSERVE_CACHE_DIR")
        if not root:
            cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
            root = Path(cache) / "mmserve"
        return Path(root) / "batches"

    def resolved_api_key(self) -> str | None:
        """The key to require: ``api_key``, else ``$MMSERVE_API_KEY``; None when neither is set."""
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None

    def tenant_keys(self) -> TenantKeys | None:
        """The keys to require: the ``api_keys`` file's, else the one ``api_key``
        (:meth:`resolved_api_key`) as tenant ``default``; None without keys.

        Raises:
            TenantFileError: (a ValueError) the file is unreadable or malformed, naming
                the line; or both ``api_key`` and ``api_keys`` were given.
        """
        if self.api_keys:
            if self.api_key:
                raise TenantFileError("give --api-key or --api-keys, not both")
            return TenantKeys.from_file(self.api_keys)
        key = self.resolved_api_key()
        return TenantKeys.single(key) if key else None

    def validate(self) -> None:
        """Raises ValueError for a setting out of range (and TenantFileError, one, for a
        malformed ``api_keys`` file, naming the line)."""
        self.tenant_keys()
        for name in (
            "max_stored_images",
            "max_stored_image_bytes",
            "max_queued_requests",
            "max_request_bytes",
            "max_json_depth",
            "max_questions",
            "max_n",
            "default_max_tokens",
            "max_video_bytes",
            "max_video_frames",
            "max_video_side",
            "max_stored_videos",
            "max_stored_video_bytes",
            "unhealthy_after_failed_steps",
            "max_batch_file_bytes",
            "max_batch_lines",
            "max_stored_file_bytes",
            "batch_max_in_flight",
            "batch_in_flight_with_online",
            "max_stored_responses",
            "max_stored_response_bytes",
            "max_stored_object_bytes",
            "max_streams",
            "max_stream_frames_per_post",
            "max_stream_pixel_bytes",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_video_tokens is not None and self.max_video_tokens < 1:
            raise ValueError(f"max_video_tokens must be >= 1, got {self.max_video_tokens}")
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"batch_order must be one of {BATCH_ORDERS}, got {self.batch_order!r}")
        if self.responses_store not in RESPONSE_STORES:
            raise ValueError(
                f"responses_store must be one of {RESPONSE_STORES}, got {self.responses_store!r}"
            )
        if not self.stream_idle_seconds > 0:
            raise ValueError(f"stream_idle_seconds must be > 0, got {self.stream_idle_seconds}")
        if self.retry_after_seconds < 0 or self.remote_image_timeout <= 0:
            raise ValueError("retry_after_seconds must be >= 0 and remote_image_timeout > 0")
        if self.max_json_depth > 512:  # deeper meets Python's recursion limit first
            raise ValueError(f"max_json_depth must be <= 512, got {self.max_json_depth}")
        if self.remote_image_max_redirects < 0:
            raise ValueError(
                f"remote_image_max_redirects must be >= 0, got {self.remote_image_max_redirects}"
            )
        try:
            self.allowed_networks()
        except ValueError as e:
            raise ValueError(f"remote_image_allowed_networks: {e}") from None
        if self.otlp_traces_endpoint is not None:
            self._check_tracing()

    def _check_tracing(self) -> None:
        """Raises ValueError when the ``tracing`` extra is not installed (checked without
        importing it) or ``otlp_traces_endpoint`` is no http(s) URL."""
        for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:  # a parent package is missing
                found = False
            if not found:
                raise ValueError(
                    f"otlp_traces_endpoint needs {module}: pip install 'mmserve[tracing]'"
                )
        from api.tracing import traces_url  # imports opentelemetry: only when tracing is on

        traces_url(self.otlp_traces_endpoint or "")

    def allowed_networks(self) -> tuple[IPNetwork, ...]:
        """The networks of ``remote_image_allowed_networks``.

        Raises:
            ValueError: naming an entry that is not a CIDR.
        """
        return parse_networks(self.remote_image_allowed_networks or "")
