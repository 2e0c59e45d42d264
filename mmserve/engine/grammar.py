"""Structured output: grammar-constrained decoding with xgrammar, and jump-forward decoding.

A request may carry a :class:`GuidedSpec` (a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar). The front end
(:class:`~mmserve.engine.processor.InputProcessor`) checks it, compiles it once per
distinct spec into xgrammar's token-level automaton (a bounded LRU,
:class:`GrammarCache`, on the caller's thread) and gives the request its own
``GrammarMatcher``. On the engine thread, :class:`GuidedDecoding` fills every
constrained row's token bitmask for the whole batch, applies them to the logits
before sampling, advances each matcher with the sampled token, and runs
jump-forward decoding (SGLang, Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", arXiv 2312.07104, Section 4, "compressed
finite state machine"): where the grammar admits exactly one continuation string
(``GrammarMatcher.find_jump_forward_string``), its tokens are appended at once and
computed in one extend step instead of one decode step per token.

Re-tokenization at the boundary (the paper's fix for the token-boundary problem):
the token just sampled has no K/V yet, so its text and the jump string are
tokenized together and replace it (``{`` + ``"name": "`` may become ``{"``,
``name``, ...), as the tokenizer would have produced them; the K/V already computed
never changes. A candidate is used only if it decodes to exactly the old text plus
the jump string and the matcher accepts every token; otherwise the jump string is
tokenized alone after the sampled token, and if that fails too the request decodes
token by token.

Logprobs are taken after the grammar mask: the distribution the token was drawn
from (the model's unscaled distribution restricted to what the grammar allows,
renormalized). A re-tokenized boundary token reports its logprob from the same
masked row; the other jumped tokens were not sampled and report ``0.0``
(probability 1: the grammar allowed nothing else), with themselves as the only
alternative.

An end-of-sequence token the grammar forces (the grammar has ended, or reached a dead
end, and allows nothing else) is not part of the answer: it is never appended, or,
decoding token by token, it is removed again once sampled, and the request ends with
"stop". One the model chose while the grammar allowed more stays, like any token.

xgrammar is imported lazily, so an engine serving no constrained request never
loads it. It is installed with ``pip install --no-deps`` (its Linux package
declares triton, which it does not need on the CPU; see the README).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mmserve.engine.request import Request
    from mmserve.model.loader import LoadedModel

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
    def json_schema(cls, schema: Any, param: str = "response_format.json_schema.schema"):  # noqa: ANN206
        """A JSON-schema spec; the schema is checked by :func:`check_spec`.

        Raises:
            GrammarError: if ``schema`` is not a JSON object.
        """
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: expected a JSON Schema object", param)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "guided_choice"):  # noqa: ANN206
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
    if spec in _checked:
        return
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec)
        check_schema(schema, spec.param)
        _check_ref_cycles(schema, spec.param)
    xgr = _xgrammar(spec.param)
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(_ebnf(spec))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError
        raise GrammarError(_describe(spec, e), spec.param) from None
    with _checked_lock:
        _checked[spec] = None
        while len(_checked) > 4 * GRAMMAR_CACHE_SIZE:
            _checked.popitem(last=False)


_checked: OrderedDict[GuidedSpec, None] = OrderedDict()
_checked_lock = threading.Lock()


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


def _describe(spec: GuidedSpec, e: Exception) -> str:
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


def _ebnf(spec: GuidedSpec) -> str:
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


def _xgrammar(param: str | None = None):  # noqa: ANN202
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(
            f"structured output needs xgrammar, which is not installed: {INSTALL_HINT}", param
        ) from None
    return xgrammar


# ---- compiling (front end) -----------------------------------------------------------
class GrammarState:
    """One request's position in its grammar (an xgrammar ``GrammarMatcher``).

    Args:
        matcher: a fresh matcher of the compiled grammar.
        spec: the spec it enforces.
    """

    def __init__(self, matcher: Any, spec: GuidedSpec) -> None:
        self.matcher = matcher
        self.spec = spec


def new_state(compiled: Any, spec: GuidedSpec) -> GrammarState:
    """A fresh matcher of an already compiled grammar (what the engine makes for each
    constrained request from its message)."""
    return GrammarState(_xgrammar().GrammarMatcher(compiled), spec)


class GrammarCache:
    """Compiles specs against one model's vocabulary; a bounded LRU of compiled grammars.

    Thread-safe: HTTP worker threads compile here (never the engine thread); two
    callers asking for the same new spec compile it once. Special tokens other than
    end-of-sequence, and the model's never-sampled ids, are never allowed. For JSON
    outputs tokens holding control characters (bytes 0x00-0x1f, which JSON strings
    must escape; xgrammar's length-bounded strings would let them through) and bytes
    that never occur in UTF-8 (0xc0, 0xc1, 0xf5-0xff) are never allowed either.

    Args:
        model: the loaded checkpoint (tokenizer, vocabulary size, stop ids).
        capacity: compiled grammars kept (least recently used dropped first).

    Attributes:
        compiles: grammars compiled so far (cache misses).
        hits: lookups answered from the cache.
    """

    def __init__(self, model: LoadedModel, capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self.model = model
        self.capacity = capacity
        self.compiles = 0
        self.hits = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._pending: dict[GuidedSpec, threading.Event] = {}
        self._compilers: tuple[Any, Any] | None = None
        self._vocab: list[bytes] | None = None

    def _get_compilers(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compilers is None:
                self._compilers, self._vocab = _make_compilers(self.model)
            return self._compilers

    def vocab_bytes(self) -> list[bytes]:
        """Each token id's bytes as decoded text holds them (``b""`` for special ids)."""
        self._get_compilers()
        return self._vocab

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec`` (cached).

        Raises:
            GrammarError: if the spec is refused or does not compile.
        """
        check_spec(spec)
        while True:
            with self._lock:
                if spec in self._cache:
                    self._cache.move_to_end(spec)
                    self.hits += 1
                    return self._cache[spec]
                waiting = self._pending.get(spec)
                if waiting is None:
                    self._pending[spec] = threading.Event()
                    break
            waiting.wait()  # another thread compiles it; then look again
        try:
            compiled = self._compile(spec)
            with self._lock:
                self.compiles += 1
                self._cache[spec] = compiled
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(spec).set()

    def _compile(self, spec: GuidedSpec) -> Any:
        full, json_only = self._get_compilers()
        try:
            if spec.kind == "json_schema":
                return json_only.compile_json_schema(
                    spec.spec, any_whitespace=False, strict_mode=True
                )
            if spec.kind == "json_object":
                return json_only.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.kind == "regex":
                return full.compile_regex(spec.spec)
            return full.compile_grammar(_ebnf(spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError
            raise GrammarError(_describe(spec, e), spec.param) from None

    def state(self, spec: GuidedSpec) -> GrammarState:
        """A fresh matcher for one request (compiling ``spec`` if needed).

        Raises:
            GrammarError: if the spec is refused or does not compile.
        """
        return new_state(self.compile(spec), spec)

    def __len__(self) -> int:
        return len(self._cache)


def _make_compilers(model: LoadedModel) -> tuple[tuple[Any, Any], list[bytes]]:
    """Two ``GrammarCompiler`` (any text; JSON, control characters never allowed) and
    the vocabulary's bytes."""
    xgr = _xgrammar()
    tok = model.tokenizer
    vocab_size = model.decoder.shape.vocab_size
    stop = list(model.eos_token_ids)
    base = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=stop)
    vocab = list(base.decoded_vocab)[:vocab_size]
    vocab += [b""] * (vocab_size - len(vocab))
    banned = set(getattr(tok, "all_special_ids", [])) | set(model.never_sample_ids)
    for i in banned - set(stop):
        if 0 <= i < vocab_size:
            vocab[i] = b""  # xgrammar never allows an empty token
    bad_json = set(range(0x20)) | {0xC0, 0xC1} | set(range(0xF5, 0x100))
    json_vocab = [b"" if any(c in bad_json for c in v) else v for v in vocab]
    for i in stop:
        json_vocab[i] = vocab[i]
    infos = [
        xgr.TokenizerInfo(v, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
        for v in (vocab, json_vocab)
    ]
    compilers = tuple(xgr.GrammarCompiler(i, max_threads=2, cache_enabled=False) for i in infos)
    return compilers, vocab


# ---- the engine side -----------------------------------------------------------------
@dataclass
class GuidedStats:
    """Counters of constrained decoding since start.

    Attributes:
        mask_steps: batches whose logits got grammar masks.
        masked_rows: rows masked (constrained requests x steps).
        mask_seconds: wall time filling and applying masks (seconds).
        jumps: jump-forward appends.
        jumped_tokens: tokens appended by jump-forward (beyond the sampled ones).
        retokenized: jumps whose boundary token was replaced by re-tokenization.
    """

    mask_steps: int = 0
    masked_rows: int = 0
    mask_seconds: float = 0.0
    jumps: int = 0
    jumped_tokens: int = 0
    retokenized: int = 0


#: Output ids decoded around a jump-forward (enough for any token's text to settle).
JUMP_CONTEXT = 16


@dataclass
class Advance:
    """What a constrained request's grammar makes of its sampled token.

    Attributes:
        token: the id to append for the sampled token (a re-tokenized jump may
            replace it).
        forced: ids the grammar forces after it (jump-forward; logprob 0).
        keep: False when the sampled token is a stop token the grammar forced: it is
            not an answer token and is not appended.
        reason: "stop" when the grammar has ended, else None.
    """

    token: int
    forced: list[int] = field(default_factory=list)
    keep: bool = True
    reason: str | None = None


class GuidedDecoding:
    """Masks, matcher advances and jump-forward for constrained requests (engine thread).

    Besides the grammar's mask, a row whose text ends with the lead byte of a UTF-8
    sequence whose second byte is restricted (0xe0, 0xed, 0xf0, 0xf4: Unicode 15,
    Table 3-7) may not continue with a token starting with a byte outside that range:
    xgrammar accepts UTF-8-encoded surrogates (0xed 0xa0-0xbf ...), which decode to
    three U+FFFD characters and break ``maxLength`` and patterns.

    Args:
        model: the loaded checkpoint (tokenizer, stop ids).
        grammars: the front end's grammar cache (its vocabulary bytes).
        jump_forward: append forced continuations at once (``--disable-jump-forward``
            turns it off).
    """

    def __init__(
        self, model: LoadedModel, grammars: GrammarCache, jump_forward: bool = True
    ) -> None:
        self.model = model
        self.grammars = grammars
        self.jump_forward = jump_forward
        self.stop_ids = list(model.eos_token_ids)
        self.stats = GuidedStats()
        self._shifts: torch.Tensor | None = None
        self._after_lead: dict[int, torch.Tensor] | None = None

    def apply_masks(
        self, reqs: Sequence[Request], rows: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor | list[torch.Tensor]:
        """Set every disallowed token of each constrained request's row to ``-inf``.

        Args:
            reqs: the requests whose next token is sampled from ``rows``.
            rows: fp32 logits ``[B, vocab]`` (or B rows of ``[vocab]``), row i for ``reqs[i]``.

        Returns:
            ``rows`` unchanged when no request is constrained; else the rows with the
            constrained ones replaced by masked copies. A row the grammar leaves no
            token for (a dead end) allows the end-of-sequence tokens, which end it.
        """
        idx = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not idx:
            return rows
        t0 = time.perf_counter()
        xgr = _xgrammar()
        out = list(rows)
        vocab = out[0].shape[-1]
        bitmask = xgr.allocate_token_bitmask(len(idx), vocab)
        for k, i in enumerate(idx):
            reqs[i].grammar.matcher.fill_next_token_bitmask(bitmask, k)
        allowed = self._unpack(bitmask.to(out[0].device), vocab)
        self._utf8_second_byte(allowed, [reqs[i] for i in idx])
        dead = ~allowed.any(dim=1)
        if bool(dead.any()):
            stop = torch.tensor(self.stop_ids, device=allowed.device)
            allowed[dead.nonzero().flatten().unsqueeze(1), stop] = True
        masked = torch.stack([out[i] for i in idx]).masked_fill(~allowed, float("-inf"))
        for k, i in enumerate(idx):
            out[i] = masked[k]
        s = self.stats
        s.mask_steps += 1
        s.masked_rows += len(idx)
        s.mask_seconds += time.perf_counter() - t0
        return out

    def _utf8_second_byte(self, allowed: torch.Tensor, reqs: Sequence[Request]) -> None:
        """Clear, in ``allowed`` (bool ``[k, vocab]``), tokens that would follow a trailing
        0xe0/0xed/0xf0/0xf4 lead byte with a second byte outside its valid range."""
        if self._after_lead is None:
            vocab = self.grammars.vocab_bytes()
            first = torch.tensor([v[0] if v else -1 for v in vocab])
            ranges = {
                0xE0: (0xA0, 0xBF),
                0xED: (0x80, 0x9F),
                0xF0: (0x90, 0xBF),
                0xF4: (0x80, 0x8F),
            }
            self._after_lead = {
                lead: ((first >= 0x80) & (first <= 0xBF) & ((first < lo) | (first > hi))).to(
                    allowed.device
                )
                for lead, (lo, hi) in ranges.items()
            }
        vocab = self.grammars.vocab_bytes()
        for k, req in enumerate(reqs):
            if req.output_ids:
                last = vocab[req.output_ids[-1]] if req.output_ids[-1] < len(vocab) else b""
                bad = self._after_lead.get(last[-1]) if last else None
                if bad is not None:
                    allowed[k] &= ~bad[: allowed.shape[1]]

    def _unpack(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """xgrammar's int32 bitmask ``[k, ceil(vocab/32)]`` (bit j of word w: token
        32w + j allowed) as bool ``[k, vocab]``, with torch ops on any device."""
        if self._shifts is None or self._shifts.device != bitmask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()

    def advance(self, req: Request, tok: int, logits: torch.Tensor) -> Advance:
        """Feed ``req``'s newly sampled token ``tok`` to its matcher, then jump forward
        where the grammar allows only one continuation. Writes nothing on ``req`` but
        its matcher: the engine applies the returned :class:`Advance`.

        Args:
            req: a constrained request; ``tok`` is not yet in ``req.output_ids``.
            tok: the token sampled from ``logits``.
            logits: the masked fp32 row ``[vocab]`` it was sampled from.

        Returns:
            The token to append (``tok``, or its re-tokenized replacement), the forced
            tokens after it (never beyond ``max_tokens``), whether ``tok`` is an answer
            token at all (a stop token sampled where the grammar allowed nothing else
            is not: the grammar forced it) and the finish reason: "stop" when the
            grammar has ended (a stop token accepted, a dead end, or, with jump-forward,
            nothing but a stop token left), else None.
        """
        m = req.grammar.matcher
        if tok in self.stop_ids and self._only_stop(m):
            return Advance(tok, keep=False, reason="stop")
        if not m.accept_token(tok) or m.is_terminated():
            return Advance(tok, reason="stop")
        if not self.jump_forward:
            return Advance(tok)
        room = req.params.max_tokens - len(req.output_ids) - 1
        if room <= 0:
            return Advance(tok)
        try:
            jump = m.find_jump_forward_string()
        except UnicodeDecodeError:  # forced bytes end inside a UTF-8 character: no jump
            jump = ""
        adv = self._jump(req, tok, jump, room) if jump else Advance(tok)
        room -= len(adv.forced)
        if room > 0 and m.is_completed() and self._only_stop(m):
            adv.reason = "stop"  # only end-of-sequence may follow: not appended, not an answer
        return adv

    def _jump(self, req: Request, sampled: int, jump: str, room: int) -> Advance:
        """Tokens for the forced string ``jump`` after ``sampled``: re-tokenizing the
        sampled token's text with it where that decodes to the same text, else ``jump``
        alone; the first candidate the matcher accepts wins.

        Only the last :data:`JUMP_CONTEXT` output ids are decoded (the check compares
        the text a window gives before and after the change, so its cost does not grow
        with the answer)."""
        out = [*req.output_ids[-JUMP_CONTEXT:], sampled]
        tok = self.model.tokenizer
        m = req.grammar.matcher

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        full = decode(out)
        prev = decode(out[:-1])
        candidates: list[tuple[int, list[int]]] = []
        tail = full[len(prev) :]
        if full.startswith(prev) and tail and "\ufffd" not in tail:
            ids = encode(tail + jump)
            if ids and decode(out[:-1] + ids) == full + jump:
                candidates.append((1, ids))  # re-tokenized: replaces the sampled token
        ids = encode(jump)
        if ids and decode(out + ids) == full + jump:
            candidates.append((0, ids))  # the jump string alone, after the sampled token
        for drop, ids in candidates:
            ids = ids[: room + drop]
            if drop and ids == [sampled]:
                continue  # nothing new
            if not _accept_all(m, sampled, drop, ids):
                continue
            s = self.stats
            s.jumps += 1
            s.jumped_tokens += len(ids) - drop
            s.retokenized += bool(drop and ids[0] != sampled)
            if drop:
                return Advance(ids[0], forced=ids[1:])
            return Advance(sampled, forced=ids)
        return Advance(sampled)

    def _only_stop(self, m: Any) -> bool:
        """Whether the matcher allows nothing but stop tokens next."""
        xgr = _xgrammar()
        vocab = self.model.decoder.shape.vocab_size
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(bitmask, 0)
        allowed = self._unpack(bitmask, vocab)[0]
        allowed[self.stop_ids] = False
        return not bool(allowed.any())


def _accept_all(m: Any, last: int, drop: int, ids: list[int]) -> bool:
    """Feed ``ids`` to ``m`` after rolling back ``drop`` (0 or 1) tokens; all or nothing."""
    if drop:
        m.rollback(1)
    for k, t in enumerate(ids):
        if not m.accept_token(t):
            if k:
                m.rollback(k)
            if drop:
                m.accept_token(last)
            return False
    return True
