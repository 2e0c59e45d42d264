"""What structured output must match (:class:`GuidedSpec`) and the checks made before a
request is queued: JSON-schema keywords xgrammar enforces, sizes, depth, reference
cycles, then xgrammar's own parser (no tokenizer).

The lowest module of :mod:`mmserve.structured`: imports neither torch nor a tokenizer.
xgrammar is imported lazily (:func:`load_xgrammar`), so a server answering no
constrained request never loads it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserve.lru import LRU

#: The xgrammar release this module is written and tested against (pinned in .ci/run
#: and the README's install commands).
XGRAMMAR_VERSION = "0.2.8"
#: How to install it (without triton).
INSTALL_HINT = f"pip install --no-deps xgrammar=={XGRAMMAR_VERSION}"

#: Kinds of :class:`GuidedSpec`.
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

#: JSON Schema keywords whose constraint xgrammar enforces (checked by sampling
#: against the ``jsonschema`` validator; see tests/test_structured_output.py).
#: Any other keyword is refused: xgrammar would silently ignore it (``multipleOf``,
#: ``uniqueItems``, ``not``, ``allOf``, ``if``/``then``/``else``, ``contains``,
#: ``dependentRequired`` gave invalid outputs), or it was not verified.
ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "$ref",
        "$defs",
        "definitions",
    }
)
#: Keywords that do not constrain a value (annotations); accepted and ignored.
ANNOTATION_KEYWORDS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
#: ``format`` values xgrammar generates correctly (others, ``date`` with day 31 in a
#: 30-day month or ``ipv4`` with leading zeros among them, are refused).
ENFORCED_FORMATS = frozenset({"uuid", "ipv6"})
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")

#: Compiled grammars kept by :class:`GrammarCache` (distinct specs).
GRAMMAR_CACHE_SIZE = 128
#: Longest spec text accepted (characters): a schema, regex, grammar or choice list.
MAX_SPEC_CHARS = 64 * 1024
#: Most characters a regex or grammar rule may expand to through its counted repetitions
#: (``a{1000}`` is 1,000; ``(ab){10}{10}`` is 200): xgrammar builds one automaton state
#: per repeated item, so ``a{100000000}`` would take gigabytes and minutes to compile.
MAX_EXPANSION = 100_000
#: Deepest nesting of subschemas accepted.
MAX_SCHEMA_DEPTH = 32


class GrammarError(ValueError):
    """A structured-output request that cannot be enforced (HTTP 400).

    Args:
        message: what is wrong, naming the field or keyword.
        param: the request field at fault (``response_format.json_schema.schema...``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must match; hashable, the key of the compile cache.

    Attributes:
        kind: one of :data:`KINDS`.
        spec: the schema as compact JSON (property order kept: it is the order of
            generation), the regex, the choices as a JSON list, or the EBNF grammar
            (root rule ``root``); empty for ``json_object``.
        param: the request field it came from (for error messages; not part of the key).
    """

    kind: str
    spec: str = ""
    param: str = field(default="", compare=False)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format.json_schema.schema"):
        """A JSON-schema spec; the schema is checked by :func:`check_spec`.

        Raises:
            GrammarError: if ``schema`` is not a JSON object.
        """
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: expected a JSON Schema object", param)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "guided_choice"):
        """Exactly one of ``choices`` (strings).

        Raises:
            GrammarError: for an empty list or a non-string choice.
        """
        if not choices or any(not isinstance(c, str) for c in choices):
            raise GrammarError(f"{param}: expected a non-empty list of strings", param)
        return cls("choice", json.dumps(list(choices)), param)


# ---- checking (no tokenizer: cheap enough for the request's thread) --------------------
def check_spec(spec: GuidedSpec) -> None:
    """Refuse a spec that is malformed or would not be enforced, before it is queued.

    JSON schemas are walked keyword by keyword (:func:`check_schema`); then the spec
    is parsed by xgrammar (``Grammar.from_json_schema`` / ``from_regex`` /
    ``from_ebnf``, no tokenizer), which reports a bad regex, reference or range.

    Raises:
        GrammarError: naming the field (and keyword) at fault and what is wrong;
            also when xgrammar is not installed.
    """
    if spec.kind not in KINDS:
        raise GrammarError(f"unknown structured output kind {spec.kind!r}", spec.param)
    if len(spec.spec) > MAX_SPEC_CHARS:
        raise GrammarError(
            f"{spec.param}: {len(spec.spec)} characters; the limit is {MAX_SPEC_CHARS}",
            spec.param,
        )
    if _checked.touch(spec):
        return
    if spec.kind in ("regex", "grammar"):
        size = expansion(spec.spec)
        if size > MAX_EXPANSION:
            raise GrammarError(
                f"{spec.param}: its counted repetitions expand to about {size:,} items; the "
                f"limit is {MAX_EXPANSION:,} (use + or * for unbounded repetition)",
                spec.param,
            )
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec)
        check_schema(schema, spec.param)
        _check_ref_cycles(schema, spec.param)
    xgr = load_xgrammar(spec.param)
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(ebnf(spec))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError
        raise GrammarError(describe_error(spec, e), spec.param) from None
    _checked.put(spec, None)


#: Specs that passed :func:`check_spec` (a memo: the walk and xgrammar's parse run once).
_checked: LRU[GuidedSpec, None] = LRU(max_items=4 * GRAMMAR_CACHE_SIZE)


def check_schema(schema: Any, param: str = "schema", depth: int = 0) -> None:
    """Walk a JSON schema: every keyword must be enforced (:data:`ENFORCED_KEYWORDS`)
    or an annotation, and its value well-formed.

    Args:
        schema: the decoded schema (a dict, or a boolean subschema below the root).
        param: the field path of ``schema`` in the request.
        depth: nesting level of ``schema`` (at most :data:`MAX_SCHEMA_DEPTH`).

    Raises:
        GrammarError: ``param.path: keyword 'multipleOf' is not enforced ...`` or
            ``param.path.maxLength: expected a non-negative integer`` and the like.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{param}: a schema must be an object or a boolean", param)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{param}: subschemas nested over {MAX_SCHEMA_DEPTH} deep", param)
    for key, value in schema.items():
        where = f"{param}.{key}"
        if key in ANNOTATION_KEYWORDS:
            continue
        if key not in ENFORCED_KEYWORDS:
            raise GrammarError(
                f"{param}: JSON Schema keyword {key!r} is not enforced by constrained decoding "
                f"(the output could violate it), so it is refused; remove it. Enforced "
                f"keywords: {', '.join(sorted(ENFORCED_KEYWORDS))}",
                where,
            )
        _check_keyword(key, value, where, depth + 1)
    _check_bounds(schema, param)


def _check_keyword(key: str, value: Any, where: str, depth: int) -> None:
    def bad(what: str) -> GrammarError:
        return GrammarError(f"{where}: {what}", where)

    if key == "type":
        types = value if isinstance(value, list) else [value]
        if not types or any(t not in JSON_TYPES for t in types):
            raise bad(f"expected one of {', '.join(JSON_TYPES)} (or a list of them)")
    elif key == "enum":
        if not isinstance(value, list) or not value:
            raise bad("expected a non-empty array")
    elif key == "anyOf" or key == "prefixItems":
        if not isinstance(value, list) or not value:
            raise bad("expected a non-empty array of schemas")
        for i, sub in enumerate(value):
            check_schema(sub, f"{where}[{i}]", depth)
    elif key in ("properties", "$defs", "definitions"):
        if not isinstance(value, dict):
            raise bad("expected an object of schemas")
        for name, sub in value.items():
            check_schema(sub, f"{where}.{name}", depth)
    elif key == "required":
        if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
            raise bad("expected an array of property names")
    elif key in ("additionalProperties", "items"):
        check_schema(value, where, depth)
    elif key in ("minItems", "maxItems", "minLength", "maxLength"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("expected a non-negative integer")
    elif key == "pattern":
        if not isinstance(value, str):
            raise bad("expected a regular expression string")
    elif key == "format":
        if value not in ENFORCED_FORMATS:
            raise bad(
                f"format {value!r} is not enforced by constrained decoding, so it is "
                f"refused; enforced formats: {', '.join(sorted(ENFORCED_FORMATS))}"
            )
    elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("expected a number")
        if not math.isfinite(value):
            raise bad("expected a finite number")
    elif key == "$ref":
        if not isinstance(value, str) or not value.startswith("#"):
            raise bad("only local references ('#/$defs/name') are supported")


def _check_ref_cycles(root: Any, param: str) -> None:
    """Refuse a schema that is only references leading back to themselves (``{"$ref":
    "#"}``): it constrains nothing, and the grammar built from it admits only "".
    """
    if not isinstance(root, dict):
        return

    def resolve(ref: str) -> Any:
        node: Any = root
        for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def pure_ref(node: Any) -> str | None:
        if isinstance(node, dict) and "$ref" in node:
            if set(node) - {"$ref"} <= ANNOTATION_KEYWORDS and isinstance(node["$ref"], str):
                return node["$ref"]
        return None

    defs = [root] + [
        sub
        for key in ("$defs", "definitions")
        for sub in (root.get(key) or {}).values()
        if isinstance(root.get(key), dict)
    ]
    for start in defs:
        seen: list[int] = []
        node = start
        while (ref := pure_ref(node)) is not None:
            if id(node) in seen:
                raise GrammarError(
                    f"{param}: $ref {ref!r} leads back to itself through references only, "
                    "so the schema constrains nothing; give it a type or properties",
                    f"{param}.$ref",
                )
            seen.append(id(node))
            node = resolve(ref)


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def expansion(text: str) -> int:
    """An estimate of how many items a regex or EBNF text expands to through counted
    repetitions ``{n}``, ``{n,}``, ``{n,m}``: items in sequence add, a repetition
    multiplies the item or group before it by its largest count (``n`` for ``{n,}``).
    Alternatives add (an upper bound); EBNF rule references count as one item.
    Linear in ``len(text)``."""
    stack = [0]  # cost of the current group so far
    last = 0  # cost of the item just closed (what a repetition applies to)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            last = 1
        elif c == "[":  # a character class: one item
            j = i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            last = 1
        elif c == '"' or c == "'":  # an EBNF string: its characters
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            last = max(1, j - i - 1)
            i = j + 1
        elif c == "(":
            stack.append(0)
            i += 1
            continue
        elif c == ")":
            last = stack.pop() if len(stack) > 1 else 0
            i += 1
        elif c == "{" and (m := _COUNT.match(text, i)):
            hi = int(m.group(2)) if m.group(2) else int(m.group(1))
            stack[-1] += last * (hi - 1)  # the item itself is already counted
            last = last * hi
            i = m.end()
            continue
        else:
            last = 1 if not c.isspace() else 0
            i += 1
        stack[-1] += last
    return sum(stack)


def _check_bounds(schema: dict, param: str) -> None:
    for lo, hi in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if lo in schema and hi in schema and schema[lo] > schema[hi]:
            raise GrammarError(
                f"{param}: {lo} ({schema[lo]}) is greater than {hi} ({schema[hi]})",
                f"{param}.{lo}",
            )
    low = [schema[k] for k in ("minimum", "exclusiveMinimum") if k in schema]
    high = [schema[k] for k in ("maximum", "exclusiveMaximum") if k in schema]
    if low and high and max(low) > min(high):
        raise GrammarError(f"{param}: the lower bound is above the upper bound", param)


def describe_error(spec: GuidedSpec, e: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    what = {
        "json_schema": "invalid or unsupported JSON schema",
        "regex": "invalid or unsupported regular expression",
        "grammar": "invalid EBNF grammar",
        "choice": "invalid choices",
        "json_object": "invalid JSON grammar",
    }[spec.kind]
    return f"{spec.param}: {what}: {msg}"


def ebnf(spec: GuidedSpec) -> str:
    if spec.kind == "grammar":
        return spec.spec
    return "root ::= " + " | ".join(_ebnf_string(c) for c in json.loads(spec.spec))


def _ebnf_string(text: str) -> str:
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")  # xgrammar's \\x takes every hex digit that follows
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def load_xgrammar(param: str | None = None):
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(
            f"structured output needs xgrammar, which is not installed: {INSTALL_HINT}", param
        ) from None
    return xgrammar
