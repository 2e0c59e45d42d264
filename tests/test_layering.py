"""The layers stay plain: the core never imports the HTTP layer, routes never reach into
the scheduler, tree or allocator, and only the scheduler changes its queues."""

from __future__ import annotations

import ast
import fnmatch
import glob
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted((ROOT / "mmserve").rglob("*.py"))
API = sorted((ROOT / "api").rglob("*.py"))

#: Attributes of the engine's internals the HTTP layer must not touch.
INTERNALS = {"scheduler", "tree", "allocator", "pool", "runner", "waiting", "running"}
#: Calls that change a queue, the tree's structure or locks, or page ownership.
QUEUE_EDITS = {"append", "appendleft", "remove", "clear", "pop", "popleft", "insert", "extend"}
TREE_EDITS = {"insert", "evict", "reset", "inc_lock_ref", "dec_lock_ref"}
ALLOC_EDITS = {"alloc", "free"}


def parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_core_never_imports_the_http_layer() -> None:
    bad = []
    for path in CORE:
        for node in ast.walk(parse(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{rel(path)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "api"]
    assert not bad, bad
    assert CORE and API


#: Packages below the engine (the engine imports them, never the reverse).
BELOW_ENGINE = ("cache", "kernels", "model", "vision", "distributed", "structured")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, ``TYPE_CHECKING`` blocks included."""
    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


def _imports_of(packages: tuple[str, ...], banned: str) -> list[str]:
    """``path:line module`` of every import of ``banned`` (or a submodule) in ``packages``."""
    bad = []
    for pkg in packages:
        paths = sorted((ROOT / "mmserve" / pkg).rglob("*.py"))
        assert paths, pkg
        bad += [
            f"{rel(path)}:{line} {name}"
            for path in paths
            for line, name in _imports(path)
            if name == banned or name.startswith(banned + ".")
        ]
    return bad


#: Packages of the serving path, which never build test checkpoints (mmserve.testing).
SERVING = ("engine", "model", "cache", "kernels", "vision", "structured", "distributed")


@pytest.mark.parametrize(
    ("packages", "banned"),
    [(BELOW_ENGINE, "mmserve.engine"), (SERVING, "mmserve.testing")],
    ids=["below-engine", "serving-path-vs-checkpoint-writer"],
)
def test_packages_never_import(packages: tuple[str, ...], banned: str) -> None:
    assert not _imports_of(packages, banned)


def test_structured_specs_and_the_lru_load_without_torch() -> None:
    # the HTTP layer checks specs with mmserve.structured.spec; it must stay light
    code = (
        "import sys, mmserve.lru, mmserve.structured, mmserve.structured.spec\n"
        "heavy = sorted({'torch', 'transformers', 'xgrammar'} & set(sys.modules))\n"
        "assert not heavy, heavy"
    )
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr


def test_routes_do_not_reach_into_engine_internals() -> None:
    bad = []
    for path in API:
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
                bad.append(f"{rel(path)}:{node.lineno} .{node.attr}")
    assert not bad, bad


def _receiver(node: ast.Attribute) -> str:
    v = node.value
    return v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else ""


#: The scheduler package: the orchestrator and its rooms (admission, KV manager, extends).
SCHEDULER_ROOMS = tuple(
    rel(p) for p in sorted((ROOT / "mmserve" / "engine" / "scheduler").glob("*.py"))
)


def test_only_the_scheduler_changes_its_queues_tree_and_pages() -> None:
    allowed = set(SCHEDULER_ROOMS) | {  # the owner of every queue transition
        "mmserve/cache/radix_cache.py",  # the tree frees its own evicted pages
        "mmserve/cache/no_prefix_cache.py",  # the no-op cache frees what it is given
        "mmserve/cache/page_allocator.py",
    }
    assert all((ROOT / name).exists() for name in allowed), allowed
    bad = []
    for path in CORE + API:
        if rel(path) in allowed:
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in {
                        "waiting",
                        "running",
                        "prefilling",
                        "extending",
                    }:
                        bad.append(f"{rel(path)}:{node.lineno} assigns .{t.attr}")
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            method, owner = node.func.attr, _receiver(node.func)
            if owner in {"waiting", "running", "extending"} and method in QUEUE_EDITS:
                bad.append(f"{rel(path)}:{node.lineno} {owner}.{method}()")
            if owner == "tree" and method in TREE_EDITS:
                bad.append(f"{rel(path)}:{node.lineno} tree.{method}()")
            if owner in {"allocator", "alloc"} and method in ALLOC_EDITS:
                bad.append(f"{rel(path)}:{node.lineno} allocator.{method}()")
    assert not bad, bad


#: Request fields with one writer: the engine (sampling and finishing) for the output,
#: the scheduler for progress and pages (the model runner and the grammar only read).
OUTPUT_FIELDS = {"output_ids", "logprobs", "logits", "finish_reason", "error"}
OUTPUT_COUNTS = {"images_needing_vision", "vision_tower_runs", "emitted", "first_token_time"}
LIST_EDITS = {"append", "extend", "pop", "insert", "clear", "remove"}


def test_the_engine_is_the_one_writer_of_a_requests_output() -> None:
    readers = ["mmserve/engine/model_runner.py", "mmserve/structured/decode.py"]
    readers += [rel(p) for p in (ROOT / "mmserve" / "kernels").glob("*.py")]
    bad = []
    for name in readers:
        for node in ast.walk(parse(ROOT / name)):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    while isinstance(t, ast.Subscript):  # out[-1] = ...
                        t = t.value
                    if isinstance(t, ast.Attribute) and t.attr in OUTPUT_FIELDS | OUTPUT_COUNTS:
                        bad.append(f"{name}:{node.lineno} assigns .{t.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in LIST_EDITS and _receiver(node.func) in OUTPUT_FIELDS:
                    bad.append(f"{name}:{node.lineno} {_receiver(node.func)}.{node.func.attr}()")
    assert not bad, bad


def test_api_imports_the_checkpoint_writer_only_when_it_builds_the_default_model() -> None:
    # module-level imports load on every server and replica start; only the default-model
    # fallback (a function body) may reach mmserve.testing
    bad = []
    for path in API:
        for node in parse(path).body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [
                f"{rel(path)}:{node.lineno} {n}" for n in names if n.startswith("mmserve.testing")
            ]
    assert not bad, bad


#: Packages split by job: their modules in order, each importing only those before it (never
#: one that builds on it, nor the package itself, whose __init__ re-exports them all).
SPLIT_PACKAGES = {
    "mmserve/cache/kv_tiers": ("keys", "disk", "tiers"),
    "mmserve/vision/video": ("select", "orientation", "probe", "decode"),
    "mmserve/testing": ("hub_cache", "tokenizer", "weights", "checkpoints", "copying"),
    "mmserve/engine/scheduler": (
        "holds",
        "kv_manager",
        "features",
        "spec_pages",
        "admission",
        "extend",
        "core",
    ),
}


@pytest.mark.parametrize("package", sorted(SPLIT_PACKAGES))
def test_split_packages_import_downward_and_stay_small(package: str) -> None:
    order = SPLIT_PACKAGES[package]
    dotted = package.replace("/", ".")
    files = {p.stem for p in (ROOT / package).glob("*.py")} - {"__init__"}
    assert files == set(order), f"{package}: modules {sorted(files)}; list them in order"
    bad = []
    for i, name in enumerate(order):
        path = ROOT / package / f"{name}.py"
        allowed = {f"{dotted}.{m}" for m in order[:i]}
        for line, module in _imports(path):
            if (module == dotted or module.startswith(dotted + ".")) and module not in allowed:
                bad.append(f"{rel(path)}:{line} {module}")
        lines = len(path.read_text().splitlines())
        if lines > 600:
            bad.append(f"{rel(path)}: {lines} lines (over 600)")
    assert not bad, bad


def _api_imports(sub: str) -> list[tuple[str, int, str]]:
    """``(path, line, module)`` of every import in ``api/<sub>/``."""
    paths = sorted((ROOT / "api" / sub).rglob("*.py"))
    assert paths, sub
    return [(rel(p), line, name) for p in paths for line, name in _imports(p)]


@pytest.mark.parametrize("sub", ["batch", "endpoints"])
def test_handlers_and_batches_never_import_the_routes(sub: str) -> None:
    # a batch line runs through its endpoint's handler (api/endpoints/), as the route does;
    # neither reaches back into a route module
    bad = [
        f"{path}:{line} {name}"
        for path, line, name in _api_imports(sub)
        if name.startswith("api.routes_")
    ]
    bad += [
        f"{rel(p)}:{node.lineno} from api import {a.name}"
        for p in sorted((ROOT / "api" / sub).rglob("*.py"))
        for node in ast.walk(parse(p))
        if isinstance(node, ast.ImportFrom) and node.module == "api"
        for a in node.names
        if a.name.startswith("routes_")
    ]
    assert not bad, bad


def test_the_batch_runner_answers_through_the_handlers() -> None:
    names = {name for _, _, name in _api_imports("batch")}
    assert "api.endpoints" in names
    assert not names & {"api.openai_format", "api.generation", "api.structured"}


def test_the_batch_runner_waits_on_signals_not_sleeps() -> None:
    # room in the window, a free queue slot and a cancel are awaited signals, not polls
    bad = [
        f"{rel(p)}:{node.lineno}"
        for p in sorted((ROOT / "api" / "batch").rglob("*.py"))
        for node in ast.walk(parse(p))
        if isinstance(node, ast.Attribute) and node.attr == "sleep"
    ]
    assert not bad, bad


#: What stays in ``api/replicas/``: the ingress app and its launch (CLI glue); the fleet
#: itself is ``mmserve/fleet/`` and the front end the ingress builds ``mmserve/frontend/``.
INGRESS_MODULES = {"__init__.py", "ingress.py", "launch.py"}


def test_the_fleet_is_below_the_http_layer_and_api_replicas_is_only_the_ingress() -> None:
    fleet = sorted((ROOT / "mmserve" / "fleet").rglob("*.py"))
    assert fleet
    bad = [
        f"{rel(path)}:{line} {name}"
        for path in fleet
        for line, name in _imports(path)
        if name.split(".")[0] in {"api", "fastapi", "starlette"}
    ]
    assert not bad, bad
    here = {p.name for p in (ROOT / "api" / "replicas").rglob("*.py")}
    assert here == INGRESS_MODULES, sorted(here ^ INGRESS_MODULES)


#: Attributes that switch the radix cache off: the config's flag, and ``disable`` so that no
#: per-object switch comes back (``make_tree`` picks the no-op cache instead).
CACHE_SWITCHES = {"disable_radix_cache", "disable"}


def test_only_the_cache_and_the_scheduler_read_the_cache_switch() -> None:
    # the switch picks the no-op prefix cache once (make_tree); everywhere else the
    # cache's interface stands in for an `if disable` branch
    allowed = set(SCHEDULER_ROOMS)
    bad, seen = [], []
    for path in CORE + API:
        name = rel(path)
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and node.attr in CACHE_SWITCHES:
                if name.startswith("mmserve/cache/") or name in allowed:
                    seen.append(name)
                else:
                    bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert not bad, bad
    assert "mmserve/engine/scheduler/kv_manager.py" in seen  # where the cache is picked


#: Packages that never import the front end: the engine and everything below it.
NO_FRONTEND = ("engine", *BELOW_ENGINE)


def test_the_engine_and_below_never_import_the_front_end() -> None:
    assert not _imports_of(NO_FRONTEND, "mmserve.frontend")


def test_the_public_types_import_neither_engine_nor_front_end() -> None:
    path = ROOT / "mmserve" / "types.py"
    bad = [
        f"{rel(path)}:{line} {name}"
        for line, name in _imports(path)
        for banned in ("mmserve.engine", "mmserve.frontend")
        if name == banned or name.startswith(banned + ".")
    ]
    assert not bad, bad


def test_the_public_types_load_without_torch() -> None:
    # schemas and the ingress read the limits and types; torch stays an annotation
    done = run_python("import sys, mmserve.types; assert 'torch' not in sys.modules", timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_http_layer_imports_no_engine_module() -> None:
    # api/ goes through mmserve.frontend and mmserve.types (TYPE_CHECKING blocks too)
    bad = [
        f"{rel(path)}:{line} {name}"
        for path in API
        for line, name in _imports(path)
        if name == "mmserve.engine" or name.startswith("mmserve.engine.")
    ]
    assert not bad, bad


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it loads (``TYPE_CHECKING`` blocks left out; function
    bodies included)."""
    tree = parse(path)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_no_import_cycle_among_the_types_the_request_and_sampling() -> None:
    # the old circle: messages -> request -> (sampling, messages) -> request
    modules = {
        "mmserve.types": ROOT / "mmserve" / "types.py",
        "mmserve.engine.request": ROOT / "mmserve" / "engine" / "request.py",
        "mmserve.engine.sampling": ROOT / "mmserve" / "engine" / "sampling.py",
    }
    edges = {m: _runtime_imports(p) & set(modules) for m, p in modules.items()}
    assert edges["mmserve.types"] == set(), edges  # the types depend on neither
    seen: list[str] = []

    def visit(m: str, path: tuple[str, ...]) -> None:
        if m in path:
            seen.append(" -> ".join((*path, m)))
            return
        for n in sorted(edges[m]):
            visit(n, (*path, m))

    for m in modules:
        visit(m, ())
    assert not seen, seen


#: Most lines a source file of mmserve/ or api/ may have: a newcomer reads one whole.
MAX_FILE_LINES = 600


def test_no_source_file_is_longer_than_a_newcomer_can_hold() -> None:
    long = {
        rel(p): n for p in CORE + API if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, long


# ---- the may-import table of docs/architecture.md, section 4 ----------------------------
#: The doc whose table is checked.
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass
class Row:
    """One row of the table: a folder or module and what its files may import.

    ``allowed``: units (``mmserve/cache``, ``mmserve/config.py``, ``api/routes_*``) any
    import may reach; ``typing``: units only ``TYPE_CHECKING`` blocks may reach;
    ``body``: units only function bodies may reach; ``never``: units excluded from all
    three (``except`` and ``never`` clauses).
    """

    unit: str
    allowed: list[str] = field(default_factory=list)
    typing: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    never: list[str] = field(default_factory=list)


#: A unit in a may-import cell: a backticked path under mmserve/ or api/ (other backticked
#: words are prose).
UNIT = re.compile(r"`((?:mmserve|api)/[^`]*)`")


def layering_table(text: str) -> dict[str, Row]:
    """The rows of the ``| Folder | Role | May import |`` table by unit.

    A may-import cell is clauses split by ``;``; in each, backticked units before
    ``except`` (or after ``never``) are allowed (excluded; only paths under
    ``mmserve/`` or ``api/`` are units); a clause saying "type hints
    only" allows its units in ``TYPE_CHECKING`` blocks only, one saying "function body"
    in function bodies only; words outside backticks are prose.
    """
    rows: dict[str, Row] = {}
    lines = text.splitlines()
    start = lines.index("| Folder | Role | May import |")
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        folder, _, may = (c.strip() for c in line.strip("|").split(" | "))
        row = Row(folder.strip("`").rstrip("/") or folder)
        for clause in may.split(";"):
            kind = (
                row.typing
                if "type hints only" in clause
                else row.body
                if "function body" in clause
                else row.allowed
            )
            head, _, rest = clause.partition("except")
            if "never" in head:
                head, _, never = head.partition("never")
                row.never += UNIT.findall(never)
            kind += UNIT.findall(head)
            row.never += UNIT.findall(rest)
        rows[row.unit] = row
    return rows


def _covers(unit: str, path: str) -> bool:
    """Whether ``unit`` (a folder, module or ``routes_*``-style glob) holds ``path``."""
    unit = unit.rstrip("/")
    if "*" in unit:
        return fnmatch.fnmatch(path, unit + "*")
    return path == unit or path.startswith(unit + "/")


def _module_path(module: str) -> str:
    """``mmserve.cache.kv_pool`` -> ``mmserve/cache/kv_pool.py`` (a package: its folder)."""
    p = module.replace(".", "/")
    return p if (ROOT / p).is_dir() else p + ".py"


def _row_of(rows: dict[str, Row], path: str) -> Row | None:
    """The most specific row holding ``path``."""
    best = [u for u in rows if _covers(u, path)]
    return rows[max(best, key=len)] if best else None


def _placed_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module path, where)`` of every ``mmserve``/``api`` import of ``path``;
    where: "typing" (a ``TYPE_CHECKING`` block), "body" (a function body) or "top"."""
    tree = parse(path)
    where: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(node):
                where.setdefault(id(n), "body")
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in ast.walk(node):
                where[id(n)] = "typing"
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
            if node.module in {"mmserve", "api"}:  # from mmserve import types
                names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in {"mmserve", "api"}:
                out.append((node.lineno, _module_path(name), where.get(id(node), "top")))
    return out


def _table_verdicts() -> tuple[dict[str, Row], list[str], dict[str, set[str]]]:
    """The table, the imports it does not allow, and the units each row's files use."""
    rows = layering_table(ARCHITECTURE.read_text())
    bad: list[str] = []
    used: dict[str, set[str]] = {u: set() for u in rows}
    for path in CORE + API:
        name = rel(path)
        row = _row_of(rows, name)
        imports = _placed_imports(path)
        if row is None:
            bad += [f"{name}: in no row of the table" for _ in imports[:1]]
            continue
        for line, target, where in imports:
            if _covers(row.unit, target):
                continue  # a folder imports its own modules
            if any(_covers(u, target) for u in row.never):
                bad.append(f"{name}:{line} {target} (excluded for {row.unit})")
                continue
            kinds = [row.allowed] + ([row.typing] if where == "typing" else [])
            kinds += [row.body] if where == "body" else []
            units = [u for k in kinds for u in k if _covers(u, target)]
            if not units:
                bad.append(f"{name}:{line} {target} ({where}) not allowed for {row.unit}")
            used[row.unit] |= set(units)
    return rows, bad, used


def test_the_may_import_table_names_real_units() -> None:
    rows = layering_table(ARCHITECTURE.read_text())
    assert {"api", "mmserve/engine", "mmserve/cache", "mmserve/engine/scheduler"} <= set(rows)
    missing = [
        f"{row.unit}: {u}"
        for row in rows.values()
        for u in [row.unit, *row.allowed, *row.typing, *row.body, *row.never]
        if not (glob.glob(str(ROOT / u.rstrip("/"))) or glob.glob(str(ROOT / u) + "*"))
    ]
    assert not missing, missing


def test_every_import_is_allowed_by_the_may_import_table() -> None:
    _, bad, _ = _table_verdicts()
    assert not bad, bad


def test_every_allowed_import_in_the_table_is_used() -> None:
    # the table is true both ways: a row allows nothing its files never import
    rows, _, used = _table_verdicts()
    unused = [
        f"{row.unit}: {u}"
        for row in rows.values()
        for u in [*row.allowed, *row.typing, *row.body]
        if u not in used[row.unit]
    ]
    assert not unused, unused
