"""Structured-output request fields -> a checked :class:`~mmserve.engine.grammar.GuidedSpec`.

OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``; ``{"type": "text"}`` is no
constraint) and vLLM's extension fields ``guided_regex``, ``guided_choice`` and
``guided_grammar`` (EBNF, root rule ``root``). At most one may be given. The spec is
checked on the request's thread (keywords xgrammar would not enforce, malformed
schemas, regexes and grammars get a 400 naming the field); compiling against the
vocabulary happens in the front end (:class:`~mmserve.engine.processor.InputProcessor`).
"""

from __future__ import annotations

from api.errors import APIError
from api.schemas import SamplingFields
from mmserve.engine.grammar import GrammarError, GuidedSpec, check_spec

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
