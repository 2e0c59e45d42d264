"""One way to read a JSON request body, for every route that takes one.

:func:`parse_json_object` turns the raw bytes into a dict or raises a 400
:class:`~api.errors.APIError` that names the problem (and the field, where there is
one): an empty body, bytes that are not UTF-8, text that is not JSON (with line and
column), a top level that is not an object, nesting deeper than ``max_depth``, a
duplicate key, ``NaN``/``Infinity`` (not JSON, though Python's parser takes them), a
number too large for a double or an integer literal of more than
:data:`MAX_INT_DIGITS` digits. :class:`JSONBodyRoute` runs it before FastAPI sees a
route's body, so the pydantic models only ever validate a parsed object;
``api.uploads`` uses it for ``{"data": "<base64>"}`` uploads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fastapi import params
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from api.errors import APIError, field_path

#: Deepest nesting of arrays and objects accepted when the settings give none.
DEFAULT_MAX_DEPTH = 64
#: Longest integer literal (digits): far beyond any field's range, far below the cost
#: of converting one (Python refuses more than 4300 digits with an error of its own).
MAX_INT_DIGITS = 100
# bodies larger than this are parsed on a worker thread, not the event loop (bytes)
_THREAD_PARSE_BYTES = 1 << 20
_CODE = "invalid_json"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789E-", b"0000000000e+")
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)
# a JSON string as an unrolled loop: each repetition starts at a backslash, so on valid
# JSON it never backtracks
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_CHUNK = 1 << 22


class _Bad:
    """A number the parser met that JSON (or a double) cannot hold; reported with its path."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class _Duplicated(dict):
    """An object in which ``key`` appeared more than once."""

    def __init__(self, pairs: list[tuple[str, Any]], key: str) -> None:
        super().__init__(pairs)
        self.key = key


def _duplicate(pairs: list[tuple[str, Any]]) -> _Duplicated:
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            return _Duplicated(pairs, k)
        seen.add(k)
    raise AssertionError("no duplicate key")  # only called when the dict came out shorter


def _float(text: str) -> float | _Bad:
    value = float(text)
    return value if math.isfinite(value) else _Bad("number is too large")


def _int(text: str) -> int | _Bad:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Bad(f"integer of {digits} digits is too large")
    return int(text)


def _loads(text: str, raw: bytes) -> tuple[object, bool]:
    """``json.loads`` of ``text`` (``raw`` decoded) that marks what JSON (or a double)
    cannot hold; True if it met any.

    The number hooks cost a Python call per number, so they are used only when the text
    holds a long digit run or a 3-digit exponent, the only ways to overflow (found on a
    copy with every digit made ``0``, by substring search: C speed).
    """
    flagged: list[bool] = []

    def pairs(items: list[tuple[str, Any]]) -> dict:
        out = dict(items)
        if len(out) == len(items):
            return out
        flagged.append(True)
        return _duplicate(items)

    def constant(name: str) -> _Bad:
        flagged.append(True)
        return _Bad(f"{name} is not a JSON number")

    def marking(parse):
        def hook(literal: str) -> object:
            value = parse(literal)
            if type(value) is _Bad:
                flagged.append(True)
            return value

        return hook

    kw: dict[str, Any] = {"object_pairs_hook": pairs, "parse_constant": constant}
    digits = raw.translate(_DIGITS_AS_ZERO)
    long_run = _LONG_RUN in digits
    if long_run:
        kw["parse_int"] = marking(_int)
    if long_run or b"0e000" in digits or b"0e+000" in digits:
        kw["parse_float"] = marking(_float)
    return json.loads(text, **kw), bool(flagged)


def _depth(text: str, max_depth: int) -> int:
    """Deepest nesting of arrays and objects in valid JSON ``text`` (an upper bound when
    that is at most ``max_depth``), at C speed."""
    if text.count("[") + text.count("{") <= max_depth:
        return max_depth  # not enough containers to go deeper
    # valid JSON: every string is closed, so this strip is linear
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    deepest, level = 0, 0
    for i in range(0, len(brackets), _CHUNK):
        steps = np.frombuffer(brackets, np.uint8, count=min(_CHUNK, len(brackets) - i), offset=i)
        levels = np.cumsum(np.where((steps == 91) | (steps == 123), 1, -1), dtype=np.int64)
        deepest = max(deepest, level + int(levels.max()))
        level += int(levels[-1])
    return deepest


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string"}.get(
        type(value), "an array"
    )


def _error(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=_CODE)


def parse_json_object(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """The JSON object in ``raw`` (UTF-8, RFC 8259, no duplicate keys).

    Args:
        raw: the request body.
        max_depth: most nested arrays and objects (the top-level object counts 1).

    Raises:
        APIError: 400 ``invalid_json`` naming the problem; ``param`` names the field for
            a bad number or a duplicate key.
    """
    if not raw.strip():
        raise _error("request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        msg = f"request body is not valid UTF-8 (byte {e.start}); JSON must be UTF-8"
        raise _error(msg) from None
    try:
        value, flagged = _loads(text, raw)
    except json.JSONDecodeError as e:
        raise _error(
            f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except RecursionError:
        raise _error(f"request body is nested deeper than {max_depth} levels") from None
    if not isinstance(value, dict):
        kind = "a bad number" if isinstance(value, _Bad) else _kind(value)
        raise _error(f"request body must be a JSON object, not {kind}")
    # "\ud800" is valid JSON syntax for a string that is not Unicode text
    strings = _SURROGATE_ESCAPE.search(text) is not None
    if flagged or strings or _depth(text, max_depth) > max_depth:
        _check(value, max_depth, strings)  # finds the problem and its field
    return value


def _unicode(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = field_path(path) or None
        where = f"{param}: " if param else ""
        raise _error(f"{where}string holds an unpaired UTF-16 surrogate escape", param) from None


def _check(root: dict, max_depth: int, strings: bool = False) -> None:
    """Depth, bad numbers and duplicate keys (and with ``strings`` unpaired surrogates in
    keys and strings), without recursion (depth-first)."""
    stack: list[tuple[object, tuple, int]] = [(root, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            where = field_path(path[:1]) or None
            raise _error(f"request body is nested deeper than {max_depth} levels", where)
        if isinstance(node, _Duplicated):
            param = field_path((*path, node.key))
            raise _error(f"{param}: duplicate key {node.key!r} in a JSON object", param)
        if isinstance(node, dict):
            items = node.items()
        else:
            # most arrays hold scalars only: skip them at C speed
            if not strings and not _NESTED.intersection(map(type, node)):  # type: ignore[arg-type]
                continue
            items = enumerate(node)  # type: ignore[arg-type]
        for key, value in items:
            kind = type(value)
            if strings:
                if isinstance(key, str):
                    _unicode(key, path)
                if kind is str:
                    _unicode(value, (*path, key))
            if kind is _Bad:
                param = field_path((*path, key))
                raise _error(f"{param}: {value.why}", param)
            if kind is dict or kind is list or kind is _Duplicated:
                stack.append((value, (*path, key), depth + 1))


_NESTED = {dict, list, _Duplicated, _Bad}


def json_media_type(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` header names JSON (``application/json`` or
    ``application/*+json``) in UTF-8 (no charset, or ``utf-8``)."""
    if not content_type:
        return False
    media, *rest = (p.strip().lower() for p in content_type.split(";"))
    kind, _, sub = media.partition("/")
    if kind != "application" or not (sub == "json" or sub.endswith("+json")):
        return False
    for p in rest:
        name, _, value = p.partition("=")
        if name.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            return False
    return True


def max_depth_of(request: Request) -> int:
    """The app's ``max_json_depth`` setting (:data:`DEFAULT_MAX_DEPTH` without one)."""
    state = getattr(request.app.state, "mm", None)
    settings = getattr(state, "settings", None)
    return getattr(settings, "max_json_depth", DEFAULT_MAX_DEPTH)


async def read_json_object(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The body of ``request`` and the JSON object in it.

    Raises:
        APIError: 400 for a body that is not a JSON object sent as
            ``application/json`` (see :func:`parse_json_object`); 413 from the body
            limit passes through.
    """
    ctype = request.headers.get("content-type")
    raw = await request.body()
    if not json_media_type(ctype):
        got = f"Content-Type {ctype.strip()[:100]!r}" if ctype else "no Content-Type"
        raise _error(
            f"request body must be a JSON object sent with Content-Type: application/json "
            f"(UTF-8); got {got}"
        )
    depth = max_depth_of(request)
    if len(raw) > _THREAD_PARSE_BYTES:
        return raw, await run_in_threadpool(parse_json_object, raw, depth)
    return raw, parse_json_object(raw, depth)


async def refuse_body(request: Request) -> None:
    """For a POST route that takes no body: a body (other than whitespace) is a 400.

    Raises:
        APIError: 400 naming the route.
    """
    if (await request.body()).strip():
        raise _error(f"{request.method} {request.url.path} takes no request body")


class _ParsedRequest(Request):
    """A request whose body was read and parsed already."""

    def __init__(self, scope: Scope, receive: Receive, raw: bytes, parsed: dict) -> None:
        super().__init__(scope, receive)
        self._raw_body, self._parsed = raw, parsed

    async def body(self) -> bytes:
        return self._raw_body

    async def json(self) -> Any:
        return self._parsed


class JSONBodyRoute(APIRoute):
    """An ``APIRoute`` whose JSON body goes through :func:`read_json_object` before
    FastAPI validates it; routes without a body (or with form fields) are unchanged.

    Set it as ``route_class`` of every router (and of an app's own router) that has
    routes taking a pydantic body.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or isinstance(field.field_info, params.Form):
            return handler

        async def parse_first(request: Request) -> Response:
            raw, parsed = await read_json_object(request)
            return await handler(_ParsedRequest(request.scope, request.receive, raw, parsed))

        return parse_first
