"""A parser for the part of PromQL the mmserve dashboard uses, and an evaluator over scrapes.

Used by ``tests/test_observability.py`` (which metrics and labels each panel queries) and
by ``render_dashboard.py`` (the panels' values drawn without Grafana). The grammar is
PromQL's (https://prometheus.io/docs/prometheus/latest/querying/basics/), cut to: number
literals, selectors ``name{label op "value", ...}[range]``, function calls, aggregations
``op [by|without (labels)] (args) [by|without (labels)]``, unary minus, parentheses and the
binary operators ``or and unless == != > < >= <= + - * / %`` with PromQL's precedence and
optional ``on(...)`` / ``ignoring(...)`` and ``group_left`` / ``group_right``. Anything
else (``offset``, ``@``, subqueries, ``^``) raises :class:`PromQLError`, so a dashboard
that needs more fails its test instead of being read wrongly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

AGGREGATIONS = {"sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "group"}
#: Binary operators by precedence, lowest first (PromQL's table, without ``^``).
PRECEDENCE = (("or",), ("and", "unless"), ("==", "!=", ">", "<", ">=", "<="), ("+", "-"))
PRECEDENCE += (("*", "/", "%"),)
MATCH_OPS = ("=~", "!~", "!=", "=")

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<var>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)
    | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%<>=(){}\[\],^@])
    )""",
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression outside the supported subset, or malformed."""


@dataclass
class Selector:
    """``name{matchers}[range]``; ``range`` is the text inside ``[]`` (a duration or a
    Grafana variable such as ``$__rate_interval``), None for an instant selector."""

    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)
    range: str | None = None


@dataclass
class Number:
    """A number literal."""

    value: float


@dataclass
class Call:
    """``func(args)``: a function call (``rate``, ``histogram_quantile``, ...)."""

    func: str
    args: list


@dataclass
class Aggregate:
    """``op by (labels) (args)``; ``without`` means the list is the labels dropped."""

    op: str
    args: list
    labels: list[str] | None = None
    without: bool = False


@dataclass
class Binary:
    """``lhs op rhs``; ``on`` is ``(labels, ignoring?)`` from ``on(...)``/``ignoring(...)``."""

    op: str
    lhs: object
    rhs: object
    on: tuple[list[str], bool] | None = None
    group: str | None = None


@dataclass
class Negate:
    """Unary minus."""

    expr: object


def tokenize(text: str) -> list[tuple[str, str]]:
    """``(kind, text)`` tokens: string, number, ident, var or op.

    Raises:
        PromQLError: a character no token starts with.
    """
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise PromQLError(f"unexpected {text[pos : pos + 10]!r} at {pos} in {text!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = tokenize(text)
        self.i = 0

    def peek(self, k: int = 0) -> tuple[str, str]:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("end", "")

    def take(self, want: str | None = None) -> str:
        kind, text = self.peek()
        if kind == "end" or (want is not None and text != want):
            raise PromQLError(f"expected {want or 'more'!r}, got {text!r} in {self.text!r}")
        self.i += 1
        return text

    def expr(self, level: int = 0) -> object:
        if level == len(PRECEDENCE):
            return self.unary()
        lhs = self.expr(level + 1)
        while self.peek()[1] in PRECEDENCE[level] and self.peek()[0] in ("op", "ident"):
            op = self.take()
            on, group = None, None
            if self.peek()[1] == "bool":
                raise PromQLError(f"'bool' is not supported in {self.text!r}")
            if self.peek()[1] in ("on", "ignoring"):
                ignoring = self.take() == "ignoring"
                on = (self.label_list(), ignoring)
                if self.peek()[1] in ("group_left", "group_right"):
                    group = self.take()
                    if self.peek()[1] == "(":
                        self.label_list()
            lhs = Binary(op, lhs, self.expr(level + 1), on, group)
        return lhs

    def unary(self) -> object:
        if self.peek()[1] == "-":
            self.take()
            return Negate(self.unary())
        if self.peek()[1] == "+":
            self.take()
        return self.primary()

    def label_list(self) -> list[str]:
        self.take("(")
        labels = []
        while self.peek()[1] != ")":
            kind, name = self.peek()
            if kind != "ident":
                raise PromQLError(f"label name expected, got {name!r} in {self.text!r}")
            labels.append(self.take())
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return labels

    def args(self) -> list:
        self.take("(")
        out = []
        while self.peek()[1] != ")":
            out.append(self.expr())
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return out

    def primary(self) -> object:
        kind, text = self.peek()
        if kind == "number":
            self.take()
            return Number(float(text))
        if text == "(":
            self.take()
            inner = self.expr()
            self.take(")")
            return self.postfix(inner)
        if text == "{":
            return self.postfix(Selector("", self.matchers()))
        if kind != "ident":
            raise PromQLError(f"unexpected {text!r} in {self.text!r}")
        self.take()
        if text in AGGREGATIONS and self.peek()[1] in ("(", "by", "without"):
            agg = Aggregate(text, [])
            if self.peek()[1] in ("by", "without"):
                agg.without = self.take() == "without"
                agg.labels = self.label_list()
            agg.args = self.args()
            if self.peek()[1] in ("by", "without"):
                agg.without = self.take() == "without"
                agg.labels = self.label_list()
            return agg
        if self.peek()[1] == "(":
            return Call(text, self.args())
        sel = Selector(text, self.matchers() if self.peek()[1] == "{" else [])
        return self.postfix(sel)

    def matchers(self) -> list[tuple[str, str, str]]:
        self.take("{")
        out = []
        while self.peek()[1] != "}":
            label = self.take()
            op = self.take()
            kind, value = self.peek()
            if op not in MATCH_OPS or kind != "string":
                raise PromQLError(f"bad matcher {label}{op}{value} in {self.text!r}")
            self.take()
            out.append((label, op, value[1:-1]))
            if self.peek()[1] == ",":
                self.take()
        self.take("}")
        return out

    def postfix(self, node: object) -> object:
        if self.peek()[1] == "[":
            if not isinstance(node, Selector):
                raise PromQLError(f"subqueries are not supported in {self.text!r}")
            self.take("[")
            parts = []  # "5m" is a number and a name to the tokenizer
            while self.peek()[1] != "]":
                parts.append(self.take())
            self.take("]")
            node.range = "".join(parts)
        if self.peek()[1] in ("offset", "@"):
            raise PromQLError(f"{self.peek()[1]!r} is not supported in {self.text!r}")
        return node


def parse(text: str) -> object:
    """The expression tree of ``text``.

    Raises:
        PromQLError: malformed, or outside the subset this module reads.
    """
    p = _Parser(text)
    node = p.expr()
    if p.peek()[0] != "end":
        raise PromQLError(f"trailing {p.peek()[1]!r} in {text!r}")
    return node


def walk(node: object):
    """Every node of the tree, parents first."""
    yield node
    children: list = []
    if isinstance(node, Call | Aggregate):
        children = node.args
    elif isinstance(node, Binary):
        children = [node.lhs, node.rhs]
    elif isinstance(node, Negate):
        children = [node.expr]
    for child in children:
        yield from walk(child)


# --- evaluation over a list of scrapes -------------------------------------------------

#: One scrape: sample name and sorted label pairs -> value.
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]
#: An instant vector: label pairs (``__name__`` included while a selector's) -> value.
Vector = dict[tuple[tuple[str, str], ...], float]


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]], vars_: dict) -> bool:
    for label, op, value in matchers:
        for name, sub in vars_.items():
            value = value.replace("${" + name + "}", sub).replace("$" + name, sub)
        have = labels.get(label, "")
        ok = {
            "=": have == value,
            "!=": have != value,
            "=~": re.fullmatch(value, have) is not None,
            "!~": re.fullmatch(value, have) is None,
        }[op]
        if not ok:
            return False
    return True


def _duration(text: str, vars_: dict) -> float:
    for name, sub in vars_.items():
        text = text.replace("${" + name + "}", sub).replace("$" + name, sub)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total, parts = 0.0, re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
    if not parts:
        raise PromQLError(f"bad duration {text!r}")
    for n, unit in parts:
        total += float(n) * units[unit]
    return total


def _select(scrape: Scrape, sel: Selector, vars_: dict) -> Vector:
    out: Vector = {}
    for (name, labels), value in scrape.items():
        d = dict(labels)
        if (not sel.name or name == sel.name) and _matches(d, sel.matchers, vars_):
            out[tuple(sorted({**d, "__name__": name}.items()))] = value
    return out


def _drop_name(labels: tuple) -> tuple:
    return tuple(kv for kv in labels if kv[0] != "__name__")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q`` quantile from cumulative ``(le, count)`` buckets, interpolated linearly
    inside the bucket it falls in, as Prometheus does (the +Inf bucket answers the
    largest finite bound; no observations answer NaN)."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return buckets[-1][0]


def evaluate(node: object, scrapes: list[tuple[float, Scrape]], vars_: dict) -> Vector | float:
    """``node``'s value at the last of ``scrapes`` (``(unix time, scrape)`` in time order);
    ``vars_`` replaces Grafana variables (``$name``) in matchers and ranges.

    ``rate`` and ``increase`` use the first and last scrape inside the range (no
    extrapolation, no counter-reset handling: this draws one server's short run).

    Raises:
        PromQLError: a function or operator this evaluator lacks.
    """
    now, last = scrapes[-1]
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Negate):
        inner = evaluate(node.expr, scrapes, vars_)
        return -inner if isinstance(inner, float) else {k: -v for k, v in inner.items()}
    if isinstance(node, Selector):
        if node.range is not None:
            raise PromQLError("a range vector outside rate()/increase()")
        return _select(last, node, vars_)
    if isinstance(node, Call):
        return _call(node, scrapes, vars_, now)
    if isinstance(node, Aggregate):
        return _aggregate(node, scrapes, vars_)
    if isinstance(node, Binary):
        return _binary(node, scrapes, vars_)
    raise PromQLError(f"cannot evaluate {node!r}")


def _call(node: Call, scrapes: list[tuple[float, Scrape]], vars_: dict, now: float):
    if node.func in ("rate", "increase", "irate"):
        (sel,) = node.args
        if not isinstance(sel, Selector) or sel.range is None:
            raise PromQLError(f"{node.func} needs a range selector")
        span = _duration(sel.range, vars_)
        window = [(t, s) for t, s in scrapes if t >= now - span]
        if len(window) < 2:
            return {}
        (t0, first), (t1, lastv) = window[0], window[-1]
        a, b = _select(first, sel, vars_), _select(lastv, sel, vars_)
        out = {}
        for k, v in b.items():
            delta = max(v - a.get(k, 0.0), 0.0)
            out[_drop_name(k)] = delta if node.func == "increase" else delta / (t1 - t0)
        return out
    if node.func == "histogram_quantile":
        q = evaluate(node.args[0], scrapes, vars_)
        vec = evaluate(node.args[1], scrapes, vars_)
        assert isinstance(q, float) and isinstance(vec, dict)
        groups: dict[tuple, list[tuple[float, float]]] = {}
        for labels, v in vec.items():
            d = dict(_drop_name(labels))
            le = float(d.pop("le"))
            groups.setdefault(tuple(sorted(d.items())), []).append((le, v))
        return {k: histogram_quantile(q, b) for k, b in groups.items()}
    if node.func in ("clamp_min", "clamp_max"):
        vec = evaluate(node.args[0], scrapes, vars_)
        bound = evaluate(node.args[1], scrapes, vars_)
        assert isinstance(vec, dict) and isinstance(bound, float)
        pick = max if node.func == "clamp_min" else min
        return {_drop_name(k): pick(v, bound) for k, v in vec.items()}
    raise PromQLError(f"function {node.func!r} is not supported")


def _aggregate(node: Aggregate, scrapes: list[tuple[float, Scrape]], vars_: dict) -> Vector:
    vec = evaluate(node.args[-1], scrapes, vars_)
    assert isinstance(vec, dict)
    groups: dict[tuple, list[float]] = {}
    for labels, v in vec.items():
        d = dict(_drop_name(labels))
        if node.without:
            key = {k: x for k, x in d.items() if k not in (node.labels or [])}
        else:
            key = {k: x for k, x in d.items() if k in (node.labels or [])}
        groups.setdefault(tuple(sorted(key.items())), []).append(v)
    fold = {"sum": sum, "max": max, "min": min, "count": len}
    fold["avg"] = lambda xs: sum(xs) / len(xs)
    if node.op not in fold:
        raise PromQLError(f"aggregation {node.op!r} is not supported")
    return {k: float(fold[node.op](vs)) for k, vs in groups.items()}


def _binary(node: Binary, scrapes: list[tuple[float, Scrape]], vars_: dict):
    lhs = evaluate(node.lhs, scrapes, vars_)
    rhs = evaluate(node.rhs, scrapes, vars_)
    ops = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
        "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a)),
    }
    if node.op == "or" and isinstance(lhs, dict) and isinstance(rhs, dict):
        return {**{_drop_name(k): v for k, v in rhs.items()}, **lhs}
    if node.op not in ops:
        raise PromQLError(f"operator {node.op!r} is not supported")
    f = ops[node.op]
    if isinstance(lhs, float) and isinstance(rhs, float):
        return f(lhs, rhs)
    if isinstance(lhs, float):
        assert isinstance(rhs, dict)
        return {_drop_name(k): f(lhs, v) for k, v in rhs.items()}
    if isinstance(rhs, float):
        return {_drop_name(k): f(v, rhs) for k, v in lhs.items()}

    def key(labels: tuple) -> tuple:
        d = dict(_drop_name(labels))
        if node.on is not None:
            names, ignoring = node.on
            d = {k: v for k, v in d.items() if (k in names) != ignoring}
        return tuple(sorted(d.items()))

    right = {key(k): v for k, v in rhs.items()}
    return {_drop_name(k): f(v, right[key(k)]) for k, v in lhs.items() if key(k) in right}
