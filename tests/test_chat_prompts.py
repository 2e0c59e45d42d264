"""Chat prompts that end with an assistant message (vLLM's ``continue_final_message`` and
``add_generation_prompt``) on every family, against transformers' chat template and
``generate``; OpenAI's per-role message rules; ``user`` accepted and logged."""

from __future__ import annotations

import copy
import logging

import pytest

from mmserve.frontend.detokenizer import TextStream
from mmserve.frontend.prompt import ChatTemplateOptions, PromptBuilder, PromptError
from tests.helpers import (
    MODEL,
    TINY_FAMILIES,
    assert_error,
    assert_same_generation,
    greedy,
    reference_generate,
    run_python,
    stream_chunks,
    user,
)
from tests.live_server import app_client

CONTINUE = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
PREFILL = "The city is"
#: a chat whose last message is the start of the answer
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is the tower?"},
    {"role": "assistant", "content": PREFILL},
]


def _ref_ids(tok, text: str) -> list[int]:
    """transformers' ids of a rendered prompt (with what the tokenizer adds: BOS)."""
    return tok(text, add_special_tokens=True)["input_ids"]


# ---- token ids: the template's rendering of the unfinished turn ---------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize(
    "last",
    [PREFILL, "", "Two words ", [{"type": "text", "text": "A"}, {"type": "text", "text": "B c"}]],
    ids=["text", "empty", "trailing-space", "parts"],
)
def test_continued_message_ids_equal_transformers(families, family: str, last) -> None:
    prompts = families[family].make_engine().processor.prompts
    tok = families[family].ref[1].tokenizer
    msgs = [*CHAT[:2], {"role": "assistant", "content": last}]
    ours, _ = prompts.from_messages(msgs, [], (), CONTINUE)
    want = tok.apply_chat_template(msgs, tokenize=True, continue_final_message=True)
    # apply_chat_template tokenizes without the tokenizer's own additions (LLaVA's BOS)
    assert ours == prompts._prefix_ids + list(want["input_ids"])
    # the prompt ends with the message's text: no end of turn, no end of sequence
    text = last if isinstance(last, str) else last[-1]["text"]
    assert prompts.render_chat(msgs, CONTINUE).endswith(text)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_typed_end_of_sequence_in_the_prefill_stays_text(families, family: str) -> None:
    prompts = families[family].make_engine().processor.prompts
    tok = prompts.tokenizer
    msgs = [CHAT[1], {"role": "assistant", "content": f"a{tok.eos_token}b"}]
    ids, _ = prompts.from_messages(msgs, [], (), CONTINUE)
    rendered = prompts.render_chat(msgs, CONTINUE)
    assert rendered.endswith(f"a{tok.eos_token}b")
    # the typed string is its characters; the template's own end-of-turn ids remain
    assert ids.count(tok.eos_token_id) == rendered.count(tok.eos_token) - 1
    assert ids[-1] != tok.eos_token_id and tok.decode(ids).endswith(f"a{tok.eos_token}b")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_trailing_assistant_without_the_flag_gets_a_new_assistant_turn(families, family) -> None:
    prompts = families[family].make_engine().processor.prompts
    tok = families[family].ref[1].tokenizer
    ours, _ = prompts.from_messages(CHAT, [])
    render = tok.apply_chat_template
    assert ours == _ref_ids(tok, render(CHAT, tokenize=False, add_generation_prompt=True))
    # the new turn is the template's generation prompt, after the closed assistant turn
    one = CHAT[:2]
    opening = render(one, tokenize=False, add_generation_prompt=True)[
        len(render(one, tokenize=False, add_generation_prompt=False)) :
    ]
    assert opening.strip()
    closed = render(CHAT, tokenize=False, add_generation_prompt=False)
    assert ours == _ref_ids(tok, closed + opening)
    # add_generation_prompt false: the closed turn alone (vLLM's rendering)
    plain, _ = prompts.from_messages(CHAT, [], (), ChatTemplateOptions(False, False))
    assert plain == _ref_ids(tok, closed)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_end_of_sequence_only_between_turns(families, family: str) -> None:
    prompts = families[family].make_engine().processor.prompts
    tok = prompts.tokenizer
    render = tok.apply_chat_template
    one = CHAT[:2]
    opening = render(one, tokenize=False, add_generation_prompt=True)[
        len(render(one, tokenize=False, add_generation_prompt=False)) :
    ].strip()
    multi = [*CHAT[:2], {"role": "assistant", "content": "Paris."}, *CHAT[1:]]
    for msgs, options in [
        (CHAT, CONTINUE),
        (multi, CONTINUE),
        (CHAT, ChatTemplateOptions()),
        (multi[:-1], ChatTemplateOptions()),
        (one, ChatTemplateOptions()),
    ]:
        ids, _ = prompts.from_messages(msgs, [], (), options)
        text = tok.decode(ids, skip_special_tokens=False)
        # every end of sequence comes before the turn the model answers in, which the
        # template opened (a closed final turn is followed by a new opening)
        assert ids[-1] != tok.eos_token_id
        assert tok.eos_token not in text[text.rindex(opening) :], (msgs, text)
        assert text.count(tok.eos_token) == render(msgs, tokenize=False).count(tok.eos_token) - (
            options.continue_final_message and tok.eos_token in render(msgs[-1:], tokenize=False)
        )


def test_a_template_that_opens_no_turn_after_an_assistant_message_is_refused(
    families,
) -> None:
    prompts = PromptBuilder(families["llava"].loaded)
    prompts.tokenizer = copy.deepcopy(prompts.tokenizer)  # the shared model's stays as is
    # the generation prompt only after a user message (the fault of issue 31)
    prompts.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }}"
        "{% if loop.last and add_generation_prompt %} ASSISTANT:{% endif %}"
        "{% else %} ASSISTANT: {{ m['content'] }}</s>{% endif %}{% endfor %}"
    )
    with pytest.raises(PromptError, match="opens no new assistant turn"):
        prompts.render_chat(CHAT[1:])
    assert prompts.render_chat(CHAT[1:], CONTINUE) == "USER: Where is the tower? ASSISTANT: " + (
        PREFILL
    )
    # a template's own refusal is a prompt error (a 400), not a crash
    prompts.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(PromptError, match="roles must alternate"):
        prompts.render_chat(CHAT[1:])


# ---- greedy tokens: transformers' generate on the continued prompt -------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_continued_generation_equals_transformers(families, photos, family: str) -> None:
    fam = families[family]
    eng = fam.make_engine()
    img = eng.processor.prepare_image(photos["cat.png"])
    msgs = [*user(None, "Which city?"), {"role": "assistant", "content": PREFILL}]
    ref_tok = fam.ref[1].tokenizer
    text = ref_tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert eng.processor.prompts.render_chat(msgs, CONTINUE) == text
    req = eng.processor.make_request(
        messages=msgs, images=[img], params=greedy(8), template=CONTINUE
    )
    (res,) = eng.generate([req])
    ids, logits, n = reference_generate(fam.ref, text, [img.image], eng.model.never_sample_ids)
    assert res.prompt_tokens == n
    assert_same_generation(res.output_ids, ids, res.logits, logits, f"{family} continued")
    # the answer is only what follows the prefill, decoded after its last tokens
    ctx = list(req.input_ids[-3:])  # the prefill's last tokens (text, no image)
    whole = ref_tok.decode(ctx + res.output_ids, skip_special_tokens=True)
    assert res.text == whole[len(ref_tok.decode(ctx, skip_special_tokens=True)) :]
    assert not res.text.startswith(PREFILL)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("text", ["The city is Paris", "Le café, 日本 ok", "a  b\n c"])
def test_continued_text_is_what_the_output_adds(families, family: str, text: str) -> None:
    tok = families[family].loaded.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        ctx, out = ids[:cut], ids[cut:]
        stream = TextStream(tok, context=ctx)
        pieces = [stream.push([t]) for t in out] + [stream.finish()]
        want = tok.decode(ids)[len(tok.decode(ctx)) :]
        assert "".join(pieces) == stream.text == want, (ctx, out)
    # SentencePiece drops a first token's leading space when decoded alone; in context not
    if family == "llava-next" and text.endswith("Paris"):
        stream = TextStream(tok, context=ids[:3])
        stream.push(ids[3:])
        stream.finish()
        assert stream.text == " Paris" != tok.decode(ids[3:]) == "Paris"


# ---- over HTTP ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(families):
    engine = families["llava"].make_engine(max_total_tokens=4096)
    with app_client(engine) as c:
        c.engine = engine
        yield c


def _post(client, messages: list, route: str = "/v1/chat/completions", **kw):
    if route == "/v1/responses":
        body = {"model": MODEL, "input": messages, "max_output_tokens": 4, "temperature": 0}
    else:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    return client.post(route, json={**body, **kw})


def test_continued_answer_over_http_and_cached_prefix(client) -> None:
    proc = client.engine.processor
    req = proc.make_request(messages=CHAT, params=greedy(4), template=CONTINUE)
    (want,) = client.engine.generate([req])
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    first = _post(client, CHAT, **flags)
    assert first.status_code == 200, first.text
    out = first.json()
    assert out["choices"][0]["message"]["content"] == want.text
    assert out["usage"]["prompt_tokens"] == len(req.input_ids)
    chunks = stream_chunks(client, {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                    "temperature": 0, **flags})  # fmt: skip
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want.text
    again = _post(client, CHAT, **flags).json()
    assert again["choices"][0]["message"]["content"] == want.text
    # the continued prompt is in the prefix cache: all of it but the last token
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == again["usage"]["prompt_tokens"] - 1 > 0
    # the same through /v1/responses (an assistant input item last)
    resp = _post(client, CHAT, "/v1/responses", **flags)
    assert resp.status_code == 200, resp.text
    assert resp.json()["output"][0]["content"][0]["text"] == want.text
    assert resp.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    # without the flags: a new assistant turn, another prompt and answer
    new = _post(client, CHAT).json()
    turn = proc.make_request(messages=CHAT, params=greedy(4))
    assert new["usage"]["prompt_tokens"] == len(turn.input_ids) != len(req.input_ids)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize(
    "messages, flags, words",
    [
        (CHAT, {"continue_final_message": True}, "add_generation_prompt: false"),
        (
            CHAT,
            {"continue_final_message": True, "add_generation_prompt": True},
            "add_generation_prompt: false",
        ),
        (CHAT[:2], {"continue_final_message": True, "add_generation_prompt": False}, "'user'"),
    ],
    ids=["default-generation-prompt", "both-true", "no-final-assistant"],
)
def test_continue_final_message_refusals(client, route, messages, flags, words) -> None:
    err = assert_error(_post(client, messages, route, **flags), 400, words)
    assert err["param"] == "continue_final_message"


# ---- OpenAI's per-role message rules ------------------------------------------------------

CALL = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
#: (message placed second, after a user message; extra message after it or None) ->
#: (status, param of the 400)
ROLE_RULES = [
    ({"role": "user", "content": None}, 400, "messages[1].content"),
    ({"role": "user"}, 400, "messages[1].content"),
    ({"role": "user", "content": ""}, 200, None),
    ({"role": "user", "content": []}, 400, "messages[1].content"),
    ({"role": "user", "content": [{"type": "text", "text": ""}]}, 200, None),
    ({"role": "system", "content": None}, 400, "messages[1].content"),
    ({"role": "system", "content": ""}, 200, None),
    ({"role": "developer", "content": None}, 400, "messages[1].content"),
    ({"role": "assistant", "content": None}, 400, "messages[1].content"),
    ({"role": "assistant", "content": ""}, 200, None),
    ({"role": "assistant", "content": [{"type": "text", "text": "ok"}]}, 200, None),
    # null content is allowed with tool_calls; tool turns are then refused (no template)
    ({"role": "assistant", "content": None, "tool_calls": CALL}, 400, "messages[1].tool_calls"),
    ({"role": "tool", "content": "42"}, 400, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "42", "tool_call_id": ""}, 400, "messages[1].tool_call_id"),
    ({"role": "tool", "content": None, "tool_call_id": "call_1"}, 400, "messages[1].content"),
    ({"role": "tool", "content": "42", "tool_call_id": "call_1"}, 400, "messages[1].role"),
    ({"role": "user", "content": "x", "tool_call_id": "call_1"}, 400, "messages[1].tool_call_id"),
    ({"role": "function", "content": "x", "name": "f"}, 400, "messages[1].role"),
    # images in user messages only (as OpenAI)
    (
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "IMG"}}]},
        400,
        "messages[1].content[0]",
    ),  # fmt: skip
    (
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "IMG"}}]},
        400,
        "messages[1].content[0]",
    ),  # fmt: skip
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "IMG"}}]}, 200, None),
]


@pytest.mark.parametrize(
    "message, status, param", ROLE_RULES, ids=[repr(r[0])[:60] for r in ROLE_RULES]
)
def test_message_rules_per_role(client, photos, message, status, param) -> None:
    if "IMG" in repr(message):
        image_id = client.post("/v1/images", files={"file": ("a.png", photos["cat.png"])})
        url = image_id.json()["id"]
        message = {**message, "content": [{"type": "image_url", "image_url": {"url": url}}]}
    msgs = [{"role": "user", "content": "Hi"}, message]
    if message["role"] != "user":
        msgs.append({"role": "user", "content": "Go on."})
    r = _post(client, msgs)
    if status == 200:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    else:
        err = assert_error(r, status, param)
        assert err["param"] == param and err["message"].startswith(param + ": "), err


def test_user_and_safety_identifier_are_accepted_and_logged(client, caplog) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    with caplog.at_level(logging.INFO, logger="api.generation"):
        r = _post(client, msgs, user="alice\nforged", safety_identifier="h-1")
        assert r.status_code == 200, r.text
        resp = _post(client, msgs, "/v1/responses", user="bob")
        assert resp.status_code == 200, resp.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "api.generation"]
    assert any("user='alice\\nforged' safety_identifier='h-1'" in ln for ln in lines), lines
    assert any("user='bob' safety_identifier=None" in ln for ln in lines), lines
    assert all("\n" not in ln for ln in lines)
    err = assert_error(_post(client, msgs, user="u" * 257), 400, "user")
    assert err["param"] == "user"


def test_serve_shows_the_end_user_line() -> None:
    # mmserve serve hands uvicorn this config: the api loggers' INFO lines reach stderr
    code = (
        "import logging.config, types\n"
        "from api.cli import log_config\n"
        "from api.generation import log_end_user\n"
        "from api.schemas import EndUserFields\n"
        "logging.config.dictConfig(log_config('info'))\n"
        "log_end_user(EndUserFields(user='alice'), [types.SimpleNamespace(rid='r1')])\n"
        "logging.getLogger('api.generation').debug('hidden')\n"
    )
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "requests r1: user='alice' safety_identifier=None" in out.stderr
    assert "hidden" not in out.stderr
