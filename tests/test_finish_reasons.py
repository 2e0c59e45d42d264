"""Finish reasons at the edge of the token budget: an output that is complete on the
``max_tokens``-th token ended because it was complete, not because the budget ran out.

For every constrained kind (``response_format`` json_schema and json_object,
``guided_regex``, ``guided_choice``, ``guided_grammar``, a named and a required tool
call) and for stop strings, the natural length L of the greedy answer (its
``completion_tokens`` at a large budget: the answer's tokens, the end-of-sequence token
the grammar forces not counted) is measured, then the same request runs with
``max_tokens`` L - 1 (``length``), L and L + 1 (``stop`` / ``tool_calls``, the same
answer), plain and streamed, with ``n`` 1 and 2, with jump-forward on and off; and on
``/v1/responses`` (``incomplete`` vs ``completed``).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import MODEL, stream_chunks
from tests.live_server import app_client

PROMPT = "Describe the weather."
#: A budget no answer here reaches (the natural length is measured under it).
LARGE = 300

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
WEATHER = {
    "type": "object",
    "properties": {
        "sky": {"enum": ["clear", "cloudy", "rain"]},
        "degrees": {"type": "integer", "minimum": -40, "maximum": 50},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["sky", "degrees", "note"],
}

#: Chat fields of each constrained kind; none of them accepts a proper prefix of its
#: answer, so L - 1 tokens are never a complete output.
CHAT_KINDS: dict[str, dict] = {
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER},
        }
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "guided_regex": {"guided_regex": "[a-z]{3}-[0-9]{3}"},
    "guided_choice": {"guided_choice": ["yes please", "no thanks", "maybe"]},
    "guided_grammar": {"guided_grammar": 'root ::= "say " ("hi" | "bye") "!"'},
    "tool_named": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "tool_required": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
}
RESPONSES_KINDS: dict[str, dict] = {
    "json_schema": {"type": "json_schema", "name": "weather", "schema": WEATHER},
    "json_object": {"type": "json_object"},
}


@pytest.fixture(scope="module", params=[False, True], ids=["jump-forward", "token-by-token"])
def client(request, make_engine):
    engine = make_engine(max_total_tokens=8192, disable_jump_forward=request.param)
    with app_client(engine, max_n=4) as c:
        yield c


def chat_body(max_tokens: int, **kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }


def complete(client, max_tokens: int, **kw) -> dict:
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens, **kw))
    assert r.status_code == 200, r.text
    return r.json()


def answer(choice: dict) -> object:
    """What a plain choice answered: its content, or its calls' names and arguments."""
    msg = choice["message"]
    if msg.get("tool_calls") is None:
        return msg["content"]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]


def streamed(client, max_tokens: int, **kw) -> tuple[dict[int, str], dict[int, object]]:
    """Each streamed choice's finish reason and answer (content, or the calls' names and
    arguments joined from the ``tool_calls`` deltas)."""
    finish: dict[int, str] = {}
    text: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    for chunk in stream_chunks(client, chat_body(max_tokens, **kw)):
        for ch in chunk["choices"]:
            i, delta = ch["index"], ch["delta"]
            if ch["finish_reason"] is not None:
                assert i not in finish, "two finish reasons for one choice"
                finish[i] = ch["finish_reason"]
            text[i] = text.get(i, "") + (delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                got = calls.setdefault(i, {}).setdefault(call["index"], ["", ""])
                got[0] += fn.get("name") or ""
                got[1] += fn.get("arguments") or ""
    answers: dict[int, object] = dict(text)
    for i, by_index in calls.items():
        answers[i] = [tuple(by_index[k]) for k in sorted(by_index)]
    return finish, answers


@pytest.mark.parametrize("kind", list(CHAT_KINDS))
def test_constrained_chat_complete_on_the_last_token(client, kind: str) -> None:
    fields = CHAT_KINDS[kind]
    done = "tool_calls" if kind.startswith("tool") else "stop"
    natural = complete(client, LARGE, **fields)
    assert natural["choices"][0]["finish_reason"] == done, natural
    n_tokens = natural["usage"]["completion_tokens"]
    full = answer(natural["choices"][0])
    assert n_tokens >= 2, natural  # L - 1 must leave a cut answer
    for budget, want in ((n_tokens - 1, "length"), (n_tokens, done), (n_tokens + 1, done)):
        plain = complete(client, budget, **fields)
        got = plain["choices"][0]
        assert (budget, got["finish_reason"]) == (budget, want), plain
        assert plain["usage"]["completion_tokens"] == min(budget, n_tokens)
        if want != "length":
            assert answer(got) == full
        finish, answers = streamed(client, budget, **fields)
        assert (budget, finish) == (budget, {0: want})
        assert answers[0] == answer(got)
    # n > 1: every choice (greedy: the same answer) ends the same way, plain and streamed
    for budget, want in ((n_tokens - 1, "length"), (n_tokens, done)):
        plain = complete(client, budget, n=2, **fields)
        assert [c["finish_reason"] for c in plain["choices"]] == [want, want], plain
        finish, _ = streamed(client, budget, n=2, **fields)
        assert finish == {0: want, 1: want}


def test_a_complete_output_that_could_go_on_is_stop_at_the_limit(client) -> None:
    """A grammar in an accepting state that still allows more (more digits, more
    letters) ends with "stop" at the limit: the output is complete."""
    fields = {"guided_regex": "[a-z]{2,30}-[0-9]{1,40}"}
    natural = complete(client, LARGE, **fields)
    text = natural["choices"][0]["message"]["content"]
    assert "-" in text
    # the answer's tokens up to the one that completes the first digit: complete from there on
    lps = complete(client, LARGE, logprobs=True, **fields)["choices"][0]["logprobs"]["content"]
    seen = b""
    first_complete = None
    for k, entry in enumerate(lps, 1):
        seen += bytes(entry["bytes"])
        if first_complete is None and b"-" in seen and seen.split(b"-")[1][:1].isdigit():
            first_complete = k
    assert first_complete is not None
    for budget in range(first_complete - 1, first_complete + 2):
        got = complete(client, budget, **fields)["choices"][0]
        want = "length" if budget < first_complete else "stop"
        assert (budget, got["finish_reason"]) == (budget, want), got
        finish, _ = streamed(client, budget, **fields)
        assert finish == {0: want}


def responses_body(max_output_tokens: int, fmt: dict, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "input": PROMPT,
        "max_output_tokens": max_output_tokens,
        "temperature": 0,
        "text": {"format": fmt},
        "stream": stream,
    }


def respond(client, max_output_tokens: int, fmt: dict) -> dict:
    r = client.post("/v1/responses", json=responses_body(max_output_tokens, fmt))
    assert r.status_code == 200, r.text
    return r.json()


def respond_streamed(client, max_output_tokens: int, fmt: dict) -> tuple[str, dict]:
    """The type of a streamed response's last event and the response it carries."""
    body = responses_body(max_output_tokens, fmt, stream=True)
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    return events[-1]["type"], events[-1]["response"]


@pytest.mark.parametrize("kind", list(RESPONSES_KINDS))
def test_responses_complete_on_the_last_token_is_completed(client, kind: str) -> None:
    fmt = RESPONSES_KINDS[kind]
    natural = respond(client, LARGE, fmt)
    assert natural["status"] == "completed", natural
    n_tokens = natural["usage"]["output_tokens"]
    text = natural["output"][0]["content"][0]["text"]
    for budget in (n_tokens - 1, n_tokens, n_tokens + 1):
        cut = budget < n_tokens
        status = "incomplete" if cut else "completed"
        details = {"reason": "max_output_tokens"} if cut else None
        got = respond(client, budget, fmt)
        assert (budget, got["status"], got["incomplete_details"]) == (budget, status, details)
        assert got["output"][0]["status"] == status
        assert got["usage"]["output_tokens"] == min(budget, n_tokens)
        if not cut:
            assert got["output"][0]["content"][0]["text"] == text
        last, resp = respond_streamed(client, budget, fmt)
        assert (budget, last, resp["status"]) == (budget, f"response.{status}", status)
        assert resp["incomplete_details"] == details


def stop_length(entries: list[dict], stop: str) -> int:
    """The number of tokens whose text (their ``bytes`` joined, decoded as a reader
    would) first contains ``stop``."""
    seen = b""
    for k, entry in enumerate(entries, 1):
        seen += bytes(entry["bytes"])
        if stop in seen.decode("utf-8", errors="replace"):
            return k
    raise AssertionError(f"{stop!r} is not in the answer")


@pytest.fixture(scope="module", params=["llava", "llava-next"])
def family_client(request, families):
    """The app on a tiny family: llava's byte-level BPE, llava-next's SentencePiece with
    byte fallback (a run of byte tokens is text only once it ends)."""
    engine = families[request.param].make_engine(max_total_tokens=8192)
    with app_client(engine, max_n=4) as c:
        yield c


def stop_cases(client) -> list[tuple[str, dict]]:
    """Stop strings (and the fields they go with) taken from the greedy free answer: one
    that is a whole token's text, one that ends inside a token, and a character spelt by
    byte tokens (its text shown only after the byte run: the held-back case)."""
    free = complete(client, 40, logprobs=True)["choices"][0]["logprobs"]["content"]
    words = [k for k, e in enumerate(free) if len(e["bytes"]) >= 4 and k >= 4]
    assert len(words) >= 2, free
    whole = bytes(free[words[0]]["bytes"]).decode()
    before = bytes(free[words[1] - 1]["bytes"]).decode("utf-8", errors="replace")
    inside = before[-1] + bytes(free[words[1]]["bytes"]).decode()[:2]
    spelt = {"guided_regex": "[a-z]{2}\ua66e[a-z]{2}"}  # U+A66E: in no tiny vocabulary
    return [(whole, {}), (inside, {}), ("\ua66e", spelt)]


def test_stop_string_completed_by_the_last_token(family_client) -> None:
    client = family_client
    for stop, fields in stop_cases(client):
        free = complete(client, LARGE, logprobs=True, **fields)["choices"][0]
        entries = free["logprobs"]["content"]
        n_tokens = stop_length(entries, stop)
        text = free["message"]["content"]
        cut = text[: text.index(stop)]
        natural = complete(client, LARGE, stop=[stop], logprobs=True, **fields)
        case = (stop, fields)
        assert natural["usage"]["completion_tokens"] == n_tokens, case
        assert natural["choices"][0]["message"]["content"] == cut, case
        assert len(natural["choices"][0]["logprobs"]["content"]) == n_tokens, case
        for budget in (n_tokens - 1, n_tokens, n_tokens + 1):
            want = "length" if budget < n_tokens else "stop"
            got = complete(client, budget, stop=[stop], **fields)
            choice = got["choices"][0]
            assert (case, budget, choice["finish_reason"]) == (case, budget, want), got
            assert got["usage"]["completion_tokens"] == min(budget, n_tokens)
            if want == "stop":
                assert choice["message"]["content"] == cut
            else:
                assert stop not in choice["message"]["content"]
            finish, answers = streamed(client, budget, stop=[stop], **fields)
            assert (case, budget, finish) == (case, budget, {0: want})
            assert answers[0] == choice["message"]["content"]
        # streamed logprobs: one entry per counted token, none for the ids after the stop
        chunks = stream_chunks(
            client, chat_body(n_tokens + 1, stop=[stop], logprobs=True, n=2, **fields)
        )
        for i in (0, 1):
            entries = [
                e
                for c in chunks
                for ch in c["choices"]
                if ch["index"] == i and ch["logprobs"] is not None
                for e in ch["logprobs"]["content"]
            ]
            assert len(entries) == n_tokens, (case, i)
