"""Prometheus metrics: HTTP-side counters and latency histograms, engine figures at scrape time.

Engine figures (tokens, cache, KV pool, vision tower) come from one
``Engine.cache_stats()`` snapshot taken on the engine thread per scrape, so a
scrape never reads the radix tree while a step changes it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.types import GenerateResult
from mmserve.vision.inputs import MODALITIES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# (metric name, cache_stats key, help, counter?) for cumulative engine counters
_COUNTERS = (
    ("mmserve_generation_tokens", "completion_tokens", "Generated tokens.", True),
    (
        "mmserve_cached_prompt_tokens",
        "cached_tokens",
        "Prompt tokens whose KV came from the prefix cache.",
        True,
    ),
    (
        "mmserve_engine_requests_finished",
        "requests_finished",
        "Requests the engine finished.",
        True,
    ),
    (
        "mmserve_vision_tower_runs",
        "vision_tower_images",
        "Images encoded by the vision tower.",
        True,
    ),
    (
        "mmserve_vision_embedding_cache_hits",
        "vision_cache_hits",
        "Image embeddings served from the vision-embedding cache.",
        True,
    ),
    (
        "mmserve_vision_embedding_cache_misses",
        "vision_cache_misses",
        "Image embeddings not in the vision-embedding cache.",
        True,
    ),
    (
        "mmserve_spec_decode_draft_tokens",
        "spec_drafted_tokens",
        "Tokens drafted by speculative decoding (--speculative).",
        True,
    ),
    (
        "mmserve_spec_decode_accepted_tokens",
        "spec_accepted_tokens",
        "Drafted tokens the target model accepted.",
        True,
    ),
    (
        "mmserve_spec_decode_verifies",
        "spec_verifies",
        "Request-steps that verified a draft (each gives 1 + accepted tokens).",
        True,
    ),
    (
        "mmserve_spec_decode_accepted_length",
        "spec_accepted_length",
        "Mean tokens per verify since start (1 + accepted / verifies; 0 before any).",
        False,
    ),
)


class Metrics:
    """The collectors of one app, in their own registry.

    Attributes:
        registry: what ``GET /metrics`` renders.
        requests: finished requests by finish reason.
        rejected: requests refused with 503 because the queue was full.
        ttft: time to first token (seconds).
        tpot: time per output token after the first (seconds).
        e2e: request latency from arrival to finish (seconds).
        queue_length: requests submitted and still waiting for their first token.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "mmserve_requests", "Finished requests.", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "mmserve_requests_rejected", "Requests refused because the queue was full.", registry=r
        )

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_, buckets=buckets, registry=r)

        self.ttft = histogram(
            "mmserve_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "mmserve_time_per_output_token_seconds",
            "Time per output token after the first.",
            TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "mmserve_e2e_request_latency_seconds",
            "Request latency from arrival to finish.",
            LATENCY_BUCKETS,
        )
        self.queue_length = Gauge(
            "mmserve_queue_length",
            "Requests submitted and still waiting for their first token.",
            registry=r,
        )
        # how many tenants the keys name (1 with one key or none); never their names
        self.tenants = Gauge("mmserve_tenants", "Tenants the server's API keys name.", registry=r)
        self.tenants.set(1)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def observe(self, result: GenerateResult) -> None:
        """Count a finished request and its latencies."""
        self.requests.labels(result.finish_reason or "unknown").inc()
        if result.completion_tokens >= 1:
            self.ttft.observe(result.ttft)
            self.e2e.observe(result.latency)
        if result.completion_tokens >= 2:
            self.tpot.observe((result.latency - result.ttft) / (result.completion_tokens - 1))

    def render(self, engine_stats: dict, media_stats: dict | None = None) -> bytes:
        """Prometheus text exposition, with ``engine_stats`` from ``Engine.cache_stats()``
        and ``media_stats`` from :func:`media_stats`."""
        self._engine.stats = engine_stats
        self._engine.media = media_stats or {}
        return generate_latest(self.registry)

    def summary(self) -> dict:
        """HTTP-side figures as JSON (for ``/v1/cache/stats``)."""
        get = self.registry.get_sample_value

        def hist(name: str) -> dict:
            count = get(f"{name}_count") or 0.0
            total = get(f"{name}_sum") or 0.0
            return {"count": int(count), "sum": total, "mean": total / count if count else 0.0}

        by_reason = {
            s.labels["finish_reason"]: int(s.value)
            for metric in self.requests.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        }
        return {
            "queue_length": int(get("mmserve_queue_length") or 0),
            "requests_rejected": int(get("mmserve_requests_rejected_total") or 0),
            "requests_by_finish_reason": by_reason,
            "ttft_seconds": hist("mmserve_time_to_first_token_seconds"),
            "tpot_seconds": hist("mmserve_time_per_output_token_seconds"),
            "e2e_latency_seconds": hist("mmserve_e2e_request_latency_seconds"),
        }


class _EngineCollector(Collector):
    """Engine figures from the latest ``cache_stats()`` snapshot."""

    def __init__(self) -> None:
        self.stats: dict = {}
        self.media: dict = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from _table_metrics(_MEDIA, self.media)
        s = self.stats
        if not s:
            return
        yield from _table_metrics(_COUNTERS, s, missing=0)
        yield _prompt_tokens(s)
        yield GaugeMetricFamily(
            "mmserve_cache_hit_rate",
            "Cached prompt tokens / prompt tokens since start.",
            value=s["cache_hit_rate"],
        )
        pages = GaugeMetricFamily(
            "mmserve_kv_pages",
            "KV pool pages by state, disjoint and adding up to mmserve_kv_pool_pages: used "
            "(held by a running or waiting request), evictable (cached in the radix tree, "
            "held by no request), free.",
            labels=["state"],
        )
        pages.add_metric(["used"], s["pool_pages"] - s["free_pages"] - s["evictable_pages"])
        pages.add_metric(["evictable"], s["evictable_pages"])
        pages.add_metric(["free"], s["free_pages"])
        yield pages
        yield GaugeMetricFamily("mmserve_kv_pool_pages", "KV pool size.", value=s["pool_pages"])
        yield GaugeMetricFamily(
            "mmserve_kv_usage_ratio",
            "Fraction of KV pages not free (used + evictable).",
            value=1 - s["free_pages"] / s["pool_pages"] if s["pool_pages"] else 0.0,
        )
        yield GaugeMetricFamily("mmserve_radix_tree_nodes", "Radix tree nodes.", s["tree_nodes"])
        if "tier_host_hit_tokens" in s:  # host/disk KV tiers are on
            yield from _tier_metrics(s)
        yield GaugeMetricFamily(
            "mmserve_num_requests_running", "Requests decoding.", value=s["running_requests"]
        )
        yield GaugeMetricFamily(
            "mmserve_num_requests_waiting",
            "Requests in the engine's waiting queue.",
            value=s["waiting_requests"],
        )


def _prompt_tokens(s: dict) -> Metric:
    """``mmserve_prompt_tokens_total{modality}``: prompt tokens of finished requests by
    modality (text, image, video); the series add up to all prompt tokens."""
    image, video = s.get("prompt_image_tokens", 0), s.get("prompt_video_tokens", 0)
    family = CounterMetricFamily(
        "mmserve_prompt_tokens",
        "Prompt tokens of finished requests, by modality (text, image, video).",
        labels=["modality"],
    )
    for modality, value in zip(
        MODALITIES, (s["prompt_tokens"] - image - video, image, video), strict=True
    ):
        family.add_metric([modality], value)
    return family


# (metric name, stats key with "{}" for the tier, help, counter?): one series per tier
_PER_TIER = (
    (
        "mmserve_kv_tier_hit_tokens",
        "tier_{}_hit_tokens",
        "Prompt tokens whose KV was loaded from a tier instead of computed.",
        True,
    ),
    ("mmserve_kv_tier_bytes", "tier_{}_bytes", "Bytes held by a KV tier.", False),
    ("mmserve_kv_tier_pages", "tier_{}_pages", "Pages held by a KV tier.", False),
)
# (metric name, cache_stats key, help, counter?) for the disk tier
_DISK_TIER = (
    ("mmserve_kv_tier_disk_loads", "tier_loads", "Disk loads (one per waiting request).", True),
    (
        "mmserve_kv_tier_disk_load_seconds",
        "tier_load_seconds",
        "Time spent reading pages from disk.",
        True,
    ),
    ("mmserve_kv_tier_disk_writes", "tier_disk_writes", "Pages written to disk.", True),
    (
        "mmserve_kv_tier_disk_read_failures",
        "tier_disk_read_failures",
        "Disk pages or feature files refused (truncated, corrupted or foreign) and deleted.",
        True,
    ),
    (
        "mmserve_kv_tier_disk_feature_files",
        "tier_disk_feature_files",
        "Images whose projected features the disk tier holds.",
        False,
    ),
    (
        "mmserve_kv_tier_feature_loads",
        "tier_feature_loads",
        "Images whose features were read from disk instead of running the vision tower.",
        True,
    ),
    (
        "mmserve_kv_tier_disk_writable",
        "tier_disk_writable",
        "1 while the disk tier writes; 0 after a write error turned it off.",
        False,
    ),
)


def _tier_metrics(s: dict) -> Iterator[Metric]:
    """Per-tier hits, bytes and pages, then the disk tier's loads, writes and failures."""
    for name, key, help_, counter in _PER_TIER:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(
            name, help_, labels=["tier"]
        )
        for tier in ("host", "disk"):
            family.add_metric([tier], s[key.format(tier)])
        yield family
    yield from _table_metrics(_DISK_TIER, s)


# (metric name, media_stats key, help, counter?) for decoded images and the image stores
_MEDIA = (
    (
        "mmserve_decoded_image_bytes",
        "decoded_bytes_in_use",
        "Bytes of decoded images held now while requests decode and preprocess them.",
        False,
    ),
    (
        "mmserve_decoded_image_bytes_peak",
        "decoded_bytes_peak",
        "Most bytes of decoded images held at once since start.",
        False,
    ),
    (
        "mmserve_decoded_image_bytes_limit",
        "decoded_bytes_limit",
        "Server-wide budget for decoded images (--max-decoded-image-bytes).",
        False,
    ),
    (
        "mmserve_image_decode_waits",
        "decode_waits",
        "Image decodes that waited for room in the decoded-image budget.",
        True,
    ),
    (
        "mmserve_image_decode_refusals",
        "decode_refusals",
        "Image decodes refused (503) because the decoded-image budget stayed full.",
        True,
    ),
    (
        "mmserve_image_store_bytes",
        "store_bytes",
        "Bytes the image stores hold (encoded files; no decoded images are kept).",
        False,
    ),
    ("mmserve_image_store_images", "store_images", "Images in the upload store.", False),
    (
        "mmserve_image_memo_images",
        "memo_images",
        "Keys of data-URL and remote images remembered to skip re-hashing.",
        False,
    ),
)


def _table_metrics(table: tuple, stats: dict, missing: float | None = None) -> Iterator[Metric]:
    """One unlabelled series per ``(name, key, help, counter?)`` row of ``table`` with the
    value ``stats[key]``; a key ``stats`` lacks is ``missing`` (None: left out)."""
    for name, key, help_, counter in table:
        value = stats.get(key, missing)
        if value is not None:
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            yield cls(name, help_, value=value)


def media_stats(budget: object, store: object, memo: object) -> dict:
    """Figures for :meth:`Metrics.render`: a ``DecodeBudget`` and the upload store and
    memo (``ImageStore``)."""
    return {
        "decoded_bytes_in_use": budget.in_use,
        "decoded_bytes_peak": budget.peak,
        "decoded_bytes_limit": budget.capacity,
        "decode_waits": budget.waits,
        "decode_refusals": budget.refusals,
        "store_bytes": store.total_bytes + memo.total_bytes,
        "store_images": len(store),
        "memo_images": len(memo),
    }
