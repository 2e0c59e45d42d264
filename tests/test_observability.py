"""examples/observability: the Grafana dashboard queries only what a running server exports,
and the dashboard, Prometheus and Grafana provisioning files are well formed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from api.cli import LaunchSettings
from examples.observability.promql import (
    Aggregate,
    Call,
    PromQLError,
    Selector,
    histogram_quantile,
    parse,
    walk,
)
from examples.observability.render_dashboard import parse_scrape, series
from tests.helpers import MODEL
from tests.live_server import app_client

ROOT = Path(__file__).resolve().parents[1]
OBS = ROOT / "examples" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "mmserve.json"
#: Labels Prometheus attaches to every scraped series (not in the exposition).
TARGET_LABELS = {"job", "instance"}
#: What the dashboard must show (issue 47): the families behind each quantity.
REQUIRED = {
    "mmserve_requests",  # request rate
    "mmserve_time_to_first_token_seconds",
    "mmserve_time_per_output_token_seconds",
    "mmserve_e2e_request_latency_seconds",
    "mmserve_num_requests_running",
    "mmserve_num_requests_waiting",
    "mmserve_kv_usage_ratio",
    "mmserve_cache_hit_rate",
    "mmserve_cached_prompt_tokens",
    "mmserve_prompt_tokens",  # cached vs computed
    "mmserve_vision_tower_runs",
    "mmserve_vision_embedding_cache_hits",
    "mmserve_requests_rejected",
}


class Exposition:
    """A ``/metrics`` text read per sample name: its family, the family's type, the label
    names and the label values seen."""

    def __init__(self, text: str) -> None:
        self.family: dict[str, tuple[str, str]] = {}
        self.labels: dict[str, dict[str, set[str]]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                self.family[s.name] = (fam.name, fam.type)
                seen = self.labels.setdefault(s.name, {})
                for k, v in s.labels.items():
                    seen.setdefault(k, set()).add(v)


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """``(where, expr)`` for every panel target (rows' nested panels included)."""
    out = []
    for panel in all_panels(dash):
        for t in panel.get("targets", []):
            out.append((f"panel {panel['id']} {panel['title']!r} {t['refId']}", t["expr"]))
    return out


def all_panels(dash: dict) -> list[dict]:
    return [q for p in dash["panels"] for q in (p, *p.get("panels", []))]


def query_problems(expr: str, expo: Exposition) -> list[str]:
    """What in ``expr`` the exposition does not back: a sample name it lacks, a label
    matcher or grouping label no queried series has, a literal label value never seen, a
    ``histogram_quantile`` over something other than a histogram's ``_bucket`` series or
    whose aggregation drops ``le``. Empty when the query would find its series."""
    try:
        tree = parse(expr)
    except PromQLError as e:
        return [str(e)]
    problems = []
    for node in walk(tree):
        if isinstance(node, Selector):
            if node.name not in expo.family:
                problems.append(f"{node.name} is not exported")
                continue
            have = expo.labels[node.name]
            for label, op, value in node.matchers:
                if label not in have and label not in TARGET_LABELS:
                    problems.append(f"{node.name} has no label {label!r}")
                elif op == "=" and "$" not in value and value not in have.get(label, set()):
                    problems.append(f"{node.name}{{{label}={value!r}}}: never seen")
        elif isinstance(node, Aggregate) and not node.without:
            under = {
                label
                for n in walk(node)
                if isinstance(n, Selector) and n.name in expo.labels
                for label in expo.labels[n.name]
            }
            for label in set(node.labels or []) - under - TARGET_LABELS:
                problems.append(f"{node.op} by {label!r}: no queried series has it")
        elif isinstance(node, Call) and node.func == "histogram_quantile":
            for n in walk(node.args[1]):
                if isinstance(n, Selector):
                    family, kind = expo.family.get(n.name, ("", ""))
                    if kind != "histogram" or n.name != family + "_bucket":
                        problems.append(f"histogram_quantile over {n.name}, not a _bucket")
                if isinstance(n, Aggregate) and (n.without or "le" not in (n.labels or [])):
                    problems.append(f"histogram_quantile: {n.op} drops 'le'")
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def scrapes(make_engine, photos) -> tuple[str, str]:
    """``/metrics`` of an in-process server with a host KV tier, before and after two
    image questions (3 tokens each: TTFT, TPOT and e2e observed; the second question hits
    the cache)."""
    engine = make_engine(max_total_tokens=4096, kv_host_bytes=1 << 24)
    with app_client(engine) as c:
        before = c.get("/metrics").text
        upload = c.post("/v1/images", files={"file": ("c.png", photos["cat.png"], "image/png")})
        content = [{"type": "image_url", "image_url": {"url": upload.json()["id"]}}]
        for q in ("One?", "Two?"):
            body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            body["messages"] = [
                {"role": "user", "content": [*content, {"type": "text", "text": q}]}
            ]
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        r = c.get("/metrics")
        assert r.status_code == 200
        return before, r.text


@pytest.fixture(scope="module")
def exposition(scrapes: tuple[str, str]) -> Exposition:
    return Exposition(scrapes[1])


def test_every_dashboard_query_is_exported_by_a_running_server(
    dashboard: dict, exposition: Exposition
) -> None:
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 20
    problems = [f"{where}: {p}" for where, e in exprs for p in query_problems(e, exposition)]
    assert problems == []
    families = {
        exposition.family[n.name][0]
        for _, e in exprs
        for n in walk(parse(e))
        if isinstance(n, Selector)
    }
    assert families >= REQUIRED, REQUIRED - families
    # the template variable's query: label_values(metric, label)
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "instance"]
    metric, label = var["query"]["query"].removeprefix("label_values(").rstrip(")").split(", ")
    assert metric in exposition.family and label in TARGET_LABELS


def test_the_checker_catches_what_would_rot(exposition: Exposition) -> None:
    good = 'histogram_quantile(0.99, sum by (le) (rate(mmserve_e2e_request_latency_seconds_bucket{instance=~"$instance"}[$__rate_interval])))'  # noqa: E501
    assert query_problems(good, exposition) == []
    bad = {
        "rate(mmserve_request_total[5m])": "mmserve_request_total is not exported",
        'mmserve_kv_pages{status="used"}': "mmserve_kv_pages has no label 'status'",
        'mmserve_kv_pages{state="busy"}': "mmserve_kv_pages{state='busy'}: never seen",
        "sum by (reason) (mmserve_requests_total)": "sum by 'reason': no queried series has it",
        "histogram_quantile(0.5, sum by (le) (mmserve_e2e_request_latency_seconds_sum))": (
            "histogram_quantile over mmserve_e2e_request_latency_seconds_sum, not a _bucket"
        ),
        "histogram_quantile(0.5, sum(rate(mmserve_e2e_request_latency_seconds_bucket[1m])))": (
            "histogram_quantile: sum drops 'le'"
        ),
        "rate(mmserve_requests_total[5m] offset 1h)": "'offset' is not supported",
    }
    for expr, problem in bad.items():
        found = query_problems(expr, exposition)
        assert problem in found or any(problem in f for f in found), (expr, found)


def test_dashboard_is_a_well_formed_grafana_dashboard(dashboard: dict) -> None:
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["instance"]["datasource"] == ds
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh"), p["title"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels overlap
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["id"], cells.get((x, y)))
                cells[x, y] = p["id"]
        if p["type"] == "row":
            assert "targets" not in p and g["w"] == 24 and g["h"] == 1
            continue
        assert p["type"] in {"timeseries", "stat", "gauge"} and p["datasource"] == ds
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == ds and t["expr"].strip(), (p["title"], t)


def test_prometheus_and_grafana_provisioning_fit_together() -> None:
    prom = yaml.safe_load((OBS / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    launch = LaunchSettings()
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"{launch.host}:{launch.port}"]
    compose = yaml.safe_load((OBS / "compose.yaml").read_text())["services"]
    assert compose["prometheus"]["image"] == "prom/prometheus"
    assert compose["grafana"]["image"] == "grafana/grafana"
    listen = [a for a in compose["prometheus"]["command"] if a.startswith("--web.listen")]
    ds_file = OBS / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    (source,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert listen == ["--web.listen-address=" + source["url"].removeprefix("http://")]
    # container path -> file here, over both services' volumes
    by_target = {
        target: src
        for service in compose.values()
        for src, target in (v.split(":")[:2] for v in service.get("volumes", []))
    }
    provider_file = OBS / "grafana" / "provisioning" / "dashboards" / "mmserve.yml"
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    assert (OBS / by_target[provider["options"]["path"]]).resolve() == DASHBOARD.parent
    assert (OBS / by_target["/etc/grafana/provisioning"]).resolve() == ds_file.parents[1]
    assert (OBS / by_target["/etc/prometheus/prometheus.yml"]).resolve() == OBS / "prometheus.yml"


def test_histogram_quantile_interpolates_as_prometheus_does() -> None:
    buckets = [(0.1, 1.0), (0.5, 3.0), (math.inf, 4.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)  # rank 2 in (0.1, 0.5]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 1: bucket's top
    assert histogram_quantile(0.99, buckets) == 0.5  # in +Inf: the largest finite bound
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))


def test_headless_render_evaluates_every_panel(dashboard: dict, scrapes: tuple[str, str]) -> None:
    """render_dashboard's evaluator reads every panel's query, and the values are the
    scrapes' own: 2 requests in 10 s, the hit rate of the second request's cached tokens."""
    before, after = (parse_scrape(text, "127.0.0.1:8000") for text in scrapes)
    timeline = [(0.0, before), (10.0, after)]
    values = {}
    for where, expr in dashboard_exprs(dashboard):
        got = series(expr, timeline, "1m")
        values[expr] = {k: vs[-1] for k, (_, vs) in got.items()}
        assert got, where  # every query finds series in these scrapes

    def one(name: str, key: tuple = ()) -> float:
        (expr,) = {e for _, e in dashboard_exprs(dashboard) if name in e}
        return values[expr][key]

    sample = {k[0]: v for k, v in after.items() if len(k[1]) == 2}  # unlabelled: job, instance
    assert one("sum(rate(mmserve_requests_total") == pytest.approx(2 / 10)
    cached = sample["mmserve_cached_prompt_tokens_total"]
    prompt = sum(v for (n, _), v in after.items() if n == "mmserve_prompt_tokens_total")
    assert 0 < cached < prompt
    rates = [
        v
        for e, vec in values.items()
        if e.startswith("sum(rate(mmserve_cached") and "/" in e
        for v in vec.values()
    ]
    assert rates and all(r == pytest.approx(cached / prompt) for r in rates)
    assert one("sum(mmserve_num_requests_running") == 0
    # p99 of e2e: Prometheus' interpolation over the buckets' increase in the window
    name = "mmserve_e2e_request_latency_seconds_bucket"
    buckets = [
        (float(dict(labels)["le"]), v - before[name, labels])
        for (n, labels), v in after.items()
        if n == name
    ]
    (p99,) = [
        vec[()]
        for e, vec in values.items()
        if e.startswith("histogram_quantile(0.99") and "e2e" in e
    ]
    assert p99 == pytest.approx(histogram_quantile(0.99, [(le, c / 10) for le, c in buckets]))
    assert 0 < p99 < 120
