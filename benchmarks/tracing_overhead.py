"""``python -m benchmarks tracing``: ``--otlp-traces-endpoint`` off against on, over HTTP
(what it measures: ``benchmarks/README.md``, "Tracing overhead")."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from benchmarks import over_http as http
from benchmarks import report, workloads


class _OTLPSink:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 that counts what it is sent (spans,
    bytes) and answers 200, so the exporter's whole cost is paid as against a collector."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        sink = self
        self.spans = self.bytes = 0
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                msg = ExportTraceServiceRequest.FromString(body)
                n = sum(len(s.spans) for r in msg.resource_spans for s in r.scope_spans)
                with sink.lock:
                    sink.spans += n
                    sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tracing_overhead(args: argparse.Namespace, model_dir: str) -> int:
    """many_questions bursts on two servers, ``--otlp-traces-endpoint`` off and on (spans
    to a counting OTLP/HTTP sink on loopback), in alternating order from cold caches:
    req/s and server CPU seconds per request, on / off per pair (median)."""
    size = workloads.SCALES["http"][args.scale]
    k, m = size["many_questions"]
    wl = workloads.many_questions(k, m, size["max_tokens"], args.seed)
    sink = _OTLPSink()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    flags = ("--otlp-traces-endpoint", sink.url)
    try:
        with (
            http.mmserve_server(model_dir, (), args.threads) as (off_url, off_proc),
            http.mmserve_server(model_dir, flags, args.threads) as (on_url, on_proc),
        ):
            servers = {"off": (off_url, off_proc.pid), "on": (on_url, on_proc.pid)}
            bodies = http.request_bodies(wl, None)
            for url, _ in servers.values():  # warm-up: first-request costs out of the pairs
                http.run_load(url, bodies[:2], [0.0, 0.0])
            for r in range(args.repeats):
                for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    url, pid = servers[name]
                    http.flush(url)
                    cpu0 = http.cpu_seconds(pid)
                    results, _ = http.run_load(url, bodies, [0.0] * len(bodies))
                    s = http.summarize(results, wl.max_tokens)
                    cpu = http.cpu_seconds(pid)
                    if not s["token_counts_ok"]:
                        raise RuntimeError(f"{name}: failed requests {s['errors']}")
                    s["cpu_per_request_ms"] = (
                        1e3 * (cpu - cpu0) / s["completed"] if cpu is not None else None
                    )
                    runs[name].append(s)
            time.sleep(6)  # the batch processor exports every 5 s; the rest on shutdown
    finally:
        sink.close()
    pairs = list(zip(runs["off"], runs["on"], strict=True))
    rps = [b["request_throughput"] / a["request_throughput"] for a, b in pairs]
    cpu = [
        b["cpu_per_request_ms"] / a["cpu_per_request_ms"]
        for a, b in pairs
        if a["cpu_per_request_ms"] and b["cpu_per_request_ms"]
    ]
    med = lambda xs, key: statistics.median(x[key] for x in xs)  # noqa: E731
    rows = {
        name: {
            "req_s": med(rs, "request_throughput"),
            "cpu_ms": med(rs, "cpu_per_request_ms"),
            "ttft_p50_ms": 1e3 * statistics.median(x["ttft_s"]["p50"] for x in rs),
        }
        for name, rs in runs.items()
    }
    requests = args.repeats * wl.num_requests
    out = {
        "workload": wl.description,
        "model": model_dir,
        "repeats": args.repeats,
        "rows": rows,
        "req_s_on_over_off": statistics.median(rps),
        "req_s_ratios": rps,
        "cpu_per_request_on_over_off": statistics.median(cpu) if cpu else None,
        "spans_exported": sink.spans,
        "spans_per_request": sink.spans / requests,
        "export_bytes_per_request": sink.bytes / requests,
        "loadavg": report.loadavg(),
    }
    cols = "tracing|req/s=req_s:.2f|server CPU ms / request=cpu_ms:.1f|TTFT p50 ms=ttft_p50_ms:.0f"
    md = f"{wl.description}; {args.repeats} pairs, alternating order, cold caches each\n\n"
    md += report.table(rows, cols)
    md += (
        f"\nreq/s on / off (median of pairs): {out['req_s_on_over_off']:.3f}; server CPU per "
        f"request on / off: {out['cpu_per_request_on_over_off'] or float('nan'):.3f}; "
        f"{out['spans_per_request']:.1f} spans and {out['export_bytes_per_request']:.0f} "
        f"OTLP bytes per request; load average {out['loadavg']}"
    )
    return report.emit(args.out, "tracing_overhead", out, md)
