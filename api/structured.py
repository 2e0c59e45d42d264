"""Structured-output request fields -> a checked :class:`~mmserve.structured.spec.GuidedSpec`.

OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``; ``{"type": "text"}`` is no
constraint) and vLLM's extension fields ``guided_regex``, ``guided_choice`` and
``guided_grammar`` (EBNF, root rule ``root``). At most one may be given. The spec is
checked on the request's thread (keywords xgrammar would not enforce, malformed
schemas, regexes and grammars get a 400 naming the field); compiling against the
vocabulary happens in the front end (:class:`~mmserve.frontend.processor.InputProcessor`).

Tool calling (:func:`tool_calling`) rides on the same machinery: ``tool_choice``
``"required"`` or a named function becomes a JSON-schema spec built from the tools'
``parameters``, and the answer is read back as OpenAI ``tool_calls``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from api.errors import APIError
from api.schemas import ChatCompletionRequest, SamplingFields
from mmserve.structured.spec import GrammarError, GuidedSpec, check_spec

#: The structured-output fields, in the order they are named in errors.
FIELDS = ("response_format", "guided_regex", "guided_choice", "guided_grammar")


def guided_spec(body: SamplingFields) -> GuidedSpec | None:
    """The structured output ``body`` asks for, checked; None for free text.

    Raises:
        APIError: 400 for more than one structured-output field, a ``json_schema``
            without a schema, a schema keyword that would not be enforced, or a
            schema, regex, choice list or grammar that is malformed.
    """
    rf = body.response_format
    given = [
        name
        for name, value in (
            ("response_format", rf if rf is not None and rf.type != "text" else None),
            ("guided_regex", body.guided_regex),
            ("guided_choice", body.guided_choice),
            ("guided_grammar", body.guided_grammar),
        )
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise APIError(
            400,
            f"give at most one structured-output field; got {', '.join(given)}",
            param=given[1],
        )
    try:
        if given[0] == "response_format":
            spec = _response_format(body)
        elif given[0] == "guided_regex":
            spec = GuidedSpec("regex", body.guided_regex, "guided_regex")
        elif given[0] == "guided_choice":
            spec = GuidedSpec.choice(body.guided_choice, "guided_choice")
        else:
            spec = GuidedSpec("grammar", body.guided_grammar, "guided_grammar")
        check_spec(spec)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or given[0]) from None
    return spec


def _response_format(body: SamplingFields) -> GuidedSpec:
    rf = body.response_format
    if rf.type == "json_object":
        return GuidedSpec("json_object", "", "response_format")
    js = rf.json_schema
    if js is None or js.schema_ is None:
        field = "response_format.json_schema" + ("" if js is None else ".schema")
        raise GrammarError(
            f"{field}: required for type json_schema (give the JSON Schema the output must match)",
            field,
        )
    return GuidedSpec.json_schema(js.schema_, "response_format.json_schema.schema")


# ---- tool calling ----------------------------------------------------------------------
#: Most calls in one answer with ``"required"`` (the grammar closes the array there),
#: so that a model that keeps adding calls ends before ``max_tokens``.
MAX_PARALLEL_TOOL_CALLS = 8

#: Schema keywords holding subschemas: by name, in a list, or one.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "prefixItems"})
_SCHEMA_VALUES = frozenset({"items", "additionalProperties"})


@dataclass(frozen=True)
class ToolCalling:
    """An enforced tool call: the grammar of the answer, and how to read it back.

    With a named function (``tool_choice: {"type": "function", "function": {"name"}}``)
    the answer is that function's arguments, a JSON object valid under its
    ``parameters``. With ``"required"`` it is a JSON array of ``{"name": <one of the
    tools>, "arguments": <valid under that tool's parameters>}``: 1 to
    :data:`MAX_PARALLEL_TOOL_CALLS` calls, exactly one when ``parallel_tool_calls`` is
    false.

    Attributes:
        spec: the JSON-schema spec the answer is decoded under.
        name: the named function; None for ``"required"``.
        parallel: whether several calls may be made (``"required"`` only).
    """

    spec: GuidedSpec
    name: str | None
    parallel: bool

    #: the tools' names (``"required"``: a name cut short is completed when one fits)
    names: tuple[str, ...] = ()

    def parse(self, text: str) -> list[dict] | None:
        """OpenAI ``tool_calls`` (``[{"id": "call_...", "type": "function", "function":
        {"name", "arguments"}}]``, arguments a JSON string) from a complete answer.

        Each call's ``arguments`` is its text as generated (what a stream sends in pieces).

        Returns:
            None when ``text`` is not a complete answer of the expected shape (cut by
            ``max_tokens`` or a stop string).
        """
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [tool_call(self.name, text)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        for call in value:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            if not isinstance(call.get("arguments"), dict):
                return None
        calls = self.split(text)
        if len(calls) != len(value):
            return None
        return [tool_call(name, args) for name, args in calls]

    def split(self, text: str) -> list[tuple[str, str]]:
        """The calls readable in ``text`` so far, complete or not: ``(name, arguments
        text so far)`` each, in order. A named function's is always there (its arguments
        are the whole text); with ``"required"`` a call appears once its name is known
        (a name cut short counts when exactly one tool's name starts with it), with
        ``""`` as arguments until they begin. Each call's arguments only grow as
        ``text`` does, so a stream sends the difference."""
        if self.name is not None:
            return [(self.name, text)]
        return _required_calls(text, self.names)


def _skip(text: str, pos: int, chars: str = " \t\n\r") -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _value_end(text: str, pos: int) -> int | None:
    """One past the JSON object or array starting at ``text[pos]``; None when ``text``
    ends inside it (strings and escapes are skipped over)."""
    depth, in_str, esc = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _required_calls(text: str, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """:meth:`ToolCalling.split` of a ``"required"`` answer: the JSON array
    ``[{"name": ..., "arguments": {...}}, ...]`` the grammar produces, read up to where
    ``text`` ends."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = _skip(text, 0)
    if not text.startswith("[", pos):
        return calls
    pos += 1
    while True:
        pos = _skip(text, pos, " \t\n\r,")
        if not text.startswith("{", pos):
            return calls
        pos += 1
        name: str | None = None
        args = ""
        while True:
            pos = _skip(text, pos, " \t\n\r,")
            if text.startswith("}", pos):
                pos += 1
                break
            try:
                key, pos = decoder.raw_decode(text, pos)
                pos = _skip(text, pos)
                if not text.startswith(":", pos):
                    raise ValueError("cut before the colon")
                pos = _skip(text, pos + 1)
            except ValueError:  # cut inside a key
                return calls + ([(name, args)] if name is not None else [])
            if key == "name":
                try:
                    name, pos = decoder.raw_decode(text, pos)
                except ValueError:  # cut inside the name: complete it if only one fits
                    prefix = text[pos + 1 :]
                    fits = [n for n in names if n.startswith(prefix)]
                    return calls + ([(fits[0], "")] if len(fits) == 1 else [])
            elif key == "arguments":
                end = _value_end(text, pos)
                if end is None:
                    return calls + ([(name, text[pos:])] if name is not None else [])
                args, pos = text[pos:end], end
            else:  # no other key: the grammar forbids them
                return calls
        if name is not None:
            calls.append((name, args))


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call with a fresh ``call_...`` id; ``arguments`` is JSON text."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def refuse_tool_fields(tool_choice: object, parallel_tool_calls: object, hint: str) -> None:
    """Without tools, refuse the tool fields unless at a value that asks for nothing:
    ``tool_choice`` null or ``"none"``, ``parallel_tool_calls`` null or true (OpenAI's
    default). Chat completions without ``tools`` and every ``/v1/responses`` body (which
    runs no tools) go through here.

    Raises:
        APIError: 400 naming ``tool_choice`` or ``parallel_tool_calls``; ``hint`` says
            what to do instead.
    """
    for name, asks_nothing in (
        ("tool_choice", tool_choice is None or tool_choice == "none"),
        ("parallel_tool_calls", parallel_tool_calls is None or parallel_tool_calls is True),
    ):
        if not asks_nothing:
            raise APIError(
                400,
                f"{name} needs tools: it is not acted on without them, so it is refused "
                f"rather than ignored; {hint}, or drop {name}",
                param=name,
            )


def tool_calling(body: ChatCompletionRequest) -> ToolCalling | None:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls``; the enforced tool
    call they ask for, or None for a plain answer.

    Rules: every tool's ``parameters`` must be an object schema the grammar enforces
    (checked like ``response_format`` schemas; absent means no arguments), and names
    are unique. ``tool_choice`` ``"none"`` answers in text, ignoring the tools;
    ``"auto"`` (the default when tools are given) is refused, since the server has no
    parser to find tool calls in free text. Tools cannot be combined with
    ``response_format`` or ``guided_*``.

    Raises:
        APIError: 400 naming the field: a bad or duplicate tool, ``tool_choice`` (or
            ``parallel_tool_calls: false``) without tools, ``"auto"``, a named
            function that is not among the tools, or a structured-output field as well.
    """
    choice = body.tool_choice
    if body.tools is None:
        refuse_tool_fields(choice, body.parallel_tool_calls, "give the functions in tools")
        return None
    schemas = _tool_schemas(body)
    given = _structured_fields(body)
    if given:
        raise APIError(
            400,
            f"{given[0]} cannot be combined with tools: a tool call's arguments already "
            "follow the tool's parameters schema; give one or the other",
            param=given[0],
        )
    if choice is None or choice == "auto":
        raise APIError(
            400,
            'tool_choice "auto" (the default when tools are given) needs a tool-call parser, '
            'which this server does not have; set tool_choice to "required" (the model '
            'calls one of the tools), {"type": "function", "function": {"name": ...}} (it '
            'calls that one) or "none" (it answers in text)',
            param="tool_choice",
        )
    if choice == "none":
        return None
    if choice == "required":
        parallel = body.parallel_tool_calls is not False
        spec = GuidedSpec.json_schema(_calls_schema(schemas, parallel), "tools")
        _check(spec)
        return ToolCalling(spec, None, parallel, tuple(schemas))
    name = choice.function.name
    if name not in schemas:
        raise APIError(
            400,
            f"tool_choice.function.name: no tool is named {name!r}; the tools are "
            f"{', '.join(repr(n) for n in schemas)}",
            param="tool_choice.function.name",
        )
    index = list(schemas).index(name)
    spec = GuidedSpec.json_schema(schemas[name], f"tools[{index}].function.parameters")
    return ToolCalling(spec, name, False)


def _structured_fields(body: SamplingFields) -> list[str]:
    rf = body.response_format
    values = (rf if rf is not None and rf.type != "text" else None,) + tuple(
        getattr(body, f) for f in FIELDS[1:]
    )
    return [f for f, v in zip(FIELDS, values, strict=True) if v is not None]


def _tool_schemas(body: ChatCompletionRequest) -> dict[str, dict]:
    """Each tool's arguments schema by name, checked (object type added if absent)."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(body.tools or []):
        fn = tool.function
        if fn.name in out:
            param = f"tools[{i}].function.name"
            raise APIError(400, f"{param}: {fn.name!r} names two tools", param=param)
        param = f"tools[{i}].function.parameters"
        schema = {"type": "object", "properties": {}} if fn.parameters is None else fn.parameters
        kind = schema.get("type", "object")
        if kind != "object":
            raise APIError(
                400,
                f"{param}.type: a function's arguments are a JSON object, so its "
                f'parameters schema must have type "object"; got {kind!r}',
                param=f"{param}.type",
            )
        schema = {"type": "object", **schema}
        spec = GuidedSpec.json_schema(schema, param)
        _check(spec)
        out[fn.name] = schema
    return out


def _check(spec: GuidedSpec) -> None:
    try:
        check_spec(spec)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or spec.param) from None


def _calls_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """The schema of ``"required"``: an array of ``{"name", "arguments"}`` calls.

    Each tool's schema moves to ``$defs.tool<i>`` with its local references
    (``#/...``) rebased there, so that its own ``$defs`` keep resolving.
    """
    defs, cases = {}, []
    for i, (name, schema) in enumerate(schemas.items()):
        base = f"#/$defs/tool{i}"
        defs[f"tool{i}"] = _rebase_refs(schema, base)
        cases.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": {"$ref": base}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    out: dict[str, Any] = {
        "type": "array",
        "items": {"anyOf": cases},
        "minItems": 1,
        "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1,
        "$defs": defs,
    }
    return out


def _rebase_refs(schema: Any, base: str) -> Any:
    """A copy of ``schema`` (already checked) with every ``$ref`` ``#<pointer>`` made
    ``<base><pointer>``; data (``enum``, ``const``, ...) is left as it is."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _rebase_refs(v, base) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_rebase_refs(v, base) for v in value]
        elif key in _SCHEMA_VALUES:
            out[key] = _rebase_refs(value, base)
        else:
            out[key] = value
    return out
