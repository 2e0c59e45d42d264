"""Stored responses (``store``, ``previous_response_id``, retrieve, delete, input items),
the Conversations API and background responses, through the official ``openai`` client
against a uvicorn serving a tiny engine in this process."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from api.app import ServerSettings, create_app
from tests.helpers import MODEL
from tests.live_server import uvicorn_thread


def _serve(make_engine, **settings) -> Iterator[tuple[str, openai.OpenAI]]:
    app = create_app(make_engine(), ServerSettings(served_model_name=MODEL, **settings))
    with uvicorn_thread(app) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def served(make_engine) -> Iterator[tuple[str, openai.OpenAI]]:
    """``(base URL, client)`` of a server with a small memory store (4 objects of at
    most 64 KB)."""
    yield from _serve(make_engine, max_stored_responses=4, max_stored_object_bytes=64 << 10)


@pytest.fixture
def client(served) -> openai.OpenAI:
    return served[1]


def _image_turn(photo: bytes, question: str) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(photo).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": url},
                {"type": "input_text", "text": question},
            ],
        }
    ]


def _bad(exc: pytest.ExceptionInfo) -> dict:
    return exc.value.body  # type: ignore[attr-defined]


def test_three_turns_by_previous_response_id_cache_the_earlier_turns(client, photos) -> None:
    kw = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(input=_image_turn(photos["astronaut.png"], "What is it?"), **kw)
    assert first.store is True and first.status in ("completed", "incomplete")
    second = client.responses.create(previous_response_id=first.id, input="And its colour?", **kw)
    assert second.previous_response_id == first.id
    third = client.responses.create(previous_response_id=second.id, input="Why?", **kw)
    # the earlier turns (the image's 576 positions included) come from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert third.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + 1
    items = client.responses.input_items.list(third.id, order="asc", limit=100).data
    roles = [it.role for it in items]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    # the data URL is kept as the image's id in the image store
    assert items[0].content[0].image_url.startswith("img-")
    got = client.responses.retrieve(third.id)
    assert got.id == third.id and got.output_text == third.output_text
    # an uploaded image's id in a later turn: kept as given, the history still cached
    info = client.post(
        "/images", body={"data": base64.b64encode(photos["cat.png"]).decode()}, cast_to=object
    )
    part = {"type": "input_image", "image_url": info["id"]}
    fourth = client.responses.create(
        previous_response_id=third.id, input=[{"role": "user", "content": [part]}], **kw
    )
    assert fourth.usage.input_tokens_details.image_tokens == 2 * 576
    assert fourth.usage.input_tokens_details.cached_tokens >= third.usage.input_tokens
    last = client.responses.input_items.list(fourth.id, limit=1).data[0]
    assert last.content[0].image_url == info["id"]


def test_the_same_history_resent_gives_the_same_answer(client) -> None:
    kw = {"model": MODEL, "max_output_tokens": 5, "temperature": 0}
    first = client.responses.create(input="Name a fruit.", instructions="Be brief.", **kw)
    chained = client.responses.create(previous_response_id=first.id, input="Another.", **kw)
    history = [  # instructions are not carried over (as OpenAI)
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another."},
    ]
    resent = client.responses.create(input=history, store=False, **kw)
    assert resent.store is False
    assert chained.output_text == resent.output_text
    assert chained.usage.input_tokens == resent.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resent.id)  # store: false is not stored


def test_input_items_paginate_as_openai(client) -> None:
    msgs = [{"role": "user", "content": f"line {i}"} for i in range(5)]
    resp = client.responses.create(model=MODEL, input=msgs, max_output_tokens=1)
    page = client.responses.input_items.list(resp.id, limit=2)  # desc by default
    assert [it.content[0].text for it in page.data] == ["line 4", "line 3"]
    assert page.has_more is True and page.first_id == page.data[0].id
    rest = client.responses.input_items.list(resp.id, limit=10, after=page.last_id)
    assert [it.content[0].text for it in rest.data] == ["line 2", "line 1", "line 0"]
    assert rest.has_more is False
    for query, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.input_items.list(resp.id, **query)
        assert _bad(exc)["param"] == param


def test_delete_and_unknown_ids_are_404(client) -> None:
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    client.responses.delete(resp.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(resp.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=resp.id)
    assert _bad(exc)["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as exc:  # ids are at most 128 characters
        client.responses.create(model=MODEL, input="Hi", previous_response_id="r" * 129)
    assert _bad(exc)["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="Hi", conversation={"name": "x"})
    assert _bad(exc)["param"] == "conversation.id"


def test_count_bound_evicts_the_oldest(client) -> None:
    ids = [
        client.responses.create(model=MODEL, input=f"n {i}", max_output_tokens=1).id
        for i in range(5)
    ]
    with pytest.raises(openai.NotFoundError):  # the store keeps 4
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_object_bound_is_a_400_naming_input(client) -> None:
    big = "word " * 20_000  # 100 KB of items, over the 64 KB bound
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input=big, max_output_tokens=1)
    err = _bad(exc)
    assert err["param"] == "input" and "--max-stored-object-bytes" in err["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.conversations.create(items=[{"role": "user", "content": big}])
    assert _bad(exc)["param"] == "items"


def test_metadata_bounds_are_400(client) -> None:
    resp = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=1, metadata={"k": "v"}
    )
    assert client.responses.retrieve(resp.id).metadata == {"k": "v"}
    cases = [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata"),
        ({"k": "v" * 513}, "metadata.k"),
    ]
    for meta, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, metadata=meta)
        assert _bad(exc)["param"] == param
        with pytest.raises(openai.BadRequestError) as exc:
            client.conversations.create(metadata=meta)
        assert _bad(exc)["param"] == param


def test_conversation_collects_turns(client, photos) -> None:
    conv = client.conversations.create(
        items=[{"type": "message", "role": "system", "content": "Answer in one word."}],
        metadata={"topic": "pets"},
    )
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "pets"}
    kw = {"model": MODEL, "max_output_tokens": 3, "temperature": 0}
    one = client.responses.create(
        conversation=conv.id, input=_image_turn(photos["cat.png"], "What is it?"), **kw
    )
    two = client.responses.create(conversation={"id": conv.id}, input="Sure?", **kw)
    assert two.usage.input_tokens_details.cached_tokens >= one.usage.input_tokens - 1
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [it.role for it in items] == ["system", "user", "assistant", "user", "assistant"]
    assert items[2].content[0].text == one.output_text
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "Thanks."}]
    )
    item = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert item.content[0].text == "Thanks."
    client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id).data) == 5
    updated = client.conversations.update(conv.id, metadata={"topic": "cats"})
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "cats"} == updated.metadata
    with pytest.raises(openai.BadRequestError) as exc:
        client.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}] * 21)
    assert _bad(exc)["param"] == "items"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(conversation=conv.id, previous_response_id=one.id, input="x", **kw)
    assert _bad(exc)["param"] == "conversation"
    assert client.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(conversation=conv.id, input="x", **kw)
    assert _bad(exc)["param"] == "conversation"


def _poll(client: openai.OpenAI, rid: str, timeout: float = 30) -> object:
    deadline = time.time() + timeout
    while True:
        got = client.responses.retrieve(rid)
        if got.status not in ("queued", "in_progress") or time.time() > deadline:
            return got
        time.sleep(0.05)


def test_background_answers_queued_then_polls_to_completed(client) -> None:
    kw = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    queued = client.responses.create(input="Count to three.", background=True, **kw)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _poll(client, queued.id)
    plain = client.responses.create(input="Count to three.", store=False, **kw)
    assert done.status in ("completed", "incomplete")
    assert done.output_text == plain.output_text and done.background is True
    with pytest.raises(openai.BadRequestError) as exc:  # not a background response
        client.responses.cancel(client.responses.create(input="x", **kw).id)
    assert _bad(exc)["param"] == "response_id"
    for extra, param in [({"store": False}, "background"), ({"stream": True}, "stream")]:
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(input="x", background=True, **extra, **kw)
        assert _bad(exc)["param"] == param


def test_background_cancel(client) -> None:
    queued = client.responses.create(
        model=MODEL,
        input="Tell a long story.",
        background=True,
        max_output_tokens=2000,
        temperature=0,
    )
    with pytest.raises(openai.BadRequestError) as exc:  # no output to continue from yet
        client.responses.create(model=MODEL, input="x", previous_response_id=queued.id)
    assert _bad(exc)["param"] == "previous_response_id"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert _poll(client, queued.id).status == "cancelled"


def test_store_off_refuses_by_flag(make_engine) -> None:
    for url, client in _serve(make_engine, responses_store="off"):
        plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        assert plain.store is False
        for extra, param in [
            ({"store": True}, "store"),
            ({"background": True}, "background"),
            ({"previous_response_id": "resp_x"}, "previous_response_id"),
            ({"conversation": "conv_x"}, "conversation"),
        ]:
            with pytest.raises(openai.BadRequestError) as exc:
                client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, **extra)
            err = _bad(exc)
            assert err["param"] == param and "--responses-store off" in err["message"]
        r = httpx.post(f"{url}/v1/conversations", json={})
        assert r.status_code == 400 and "--responses-store off" in r.json()["error"]["message"]


def test_disk_store_survives_a_restart(make_engine, tmp_path: Path) -> None:
    kw = {"responses_store": "disk", "data_dir": str(tmp_path)}
    for _, client in _serve(make_engine, **kw):
        first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        conv = client.conversations.create(metadata={"a": "b"})
    # a background response the server stopped under (as a crash leaves it)
    from api.response_store import JsonStore

    js = JsonStore("response", 10, 1 << 20, 1 << 20, tmp_path / "responses")
    rec = js.get("default", first.id)
    assert rec is not None
    rec["id"] = rec["response"]["id"] = "resp_cut"
    rec["response"]["status"] = "in_progress"
    js.put(rec)
    for _, client in _serve(make_engine, **kw):
        assert client.responses.retrieve(first.id).output_text == first.output_text
        assert client.conversations.retrieve(conv.id).metadata == {"a": "b"}
        cut = client.responses.retrieve("resp_cut")
        assert cut.status == "failed" and cut.error.code == "server_restarted"
        nxt = client.responses.create(
            model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=1
        )
        assert nxt.usage.input_tokens > first.usage.input_tokens


def test_a_stream_is_stored_when_it_ends(client) -> None:
    kw = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    events = list(client.responses.create(input="Say a word.", stream=True, **kw))
    final = events[-1].response
    assert final.store is True
    got = client.responses.retrieve(final.id)
    assert got.output_text == final.output_text and got.status == final.status
    nxt = client.responses.create(previous_response_id=final.id, input="Again.", **kw)
    assert nxt.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens - 1


def test_batch_lines_refuse_the_stored_fields() -> None:
    from types import SimpleNamespace

    from api.endpoints.responses import RESPONSES
    from api.errors import APIError
    from api.schemas import ResponsesRequest

    st = SimpleNamespace(model_name=MODEL)
    stored = [("store", True), ("background", True),
              ("previous_response_id", "resp_1"), ("conversation", "conv_1")]  # fmt: skip
    for field, value in stored:
        body = ResponsesRequest.model_validate({"input": "x", field: value})
        with pytest.raises(APIError) as exc:
            RESPONSES.check(st, body, batch=True)  # type: ignore[arg-type]
        assert exc.value.status == 400 and exc.value.param == field
    RESPONSES.check(st, ResponsesRequest.model_validate({"input": "x"}), batch=True)  # type: ignore[arg-type]


def test_byte_bound_evicts_oldest_first_and_owners_are_apart(tmp_path: Path) -> None:
    from api.response_store import JsonStore

    for directory in (None, tmp_path):
        js = JsonStore("response", 100, 300, 200, directory)
        for i in range(4):  # ~90 bytes each: the fourth pushes the first out
            js.put({"id": f"r{i}", "owner": "a" if i % 2 else "b", "pad": "x" * 50})
        assert js.get("b", "r0") is None and js.get("a", "r1") is not None
        assert js.total_bytes <= 300 and len(js) == 3
        assert js.get("b", "r1") is None and not js.delete("b", "r1")  # a's, not b's
        assert js.delete("a", "r1") and js.get("a", "r1") is None
        with pytest.raises(Exception) as exc:
            js.put({"id": "big", "owner": "a", "pad": "x" * 300}, "input")
        assert exc.value.status == 400 and exc.value.param == "input"  # type: ignore[attr-defined]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2.json", "r3.json"]


def test_another_owner_gets_404_everywhere(make_engine, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"  # two tenants (--api-keys): the owner is the key's tenant
    keys.write_text("key-alice-1 alice\nkey-bob-22 bob\n")
    app = create_app(make_engine(), ServerSettings(served_model_name=MODEL, api_keys=str(keys)))
    with uvicorn_thread(app) as url:
        a, b = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0)
            for k in ("key-alice-1", "key-bob-22")
        )
        resp = a.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        conv = a.conversations.create(items=[{"role": "user", "content": "Hi"}])
        item = a.conversations.items.list(conv.id).data[0]
        calls = [
            lambda: b.responses.retrieve(resp.id),
            lambda: b.responses.input_items.list(resp.id),
            lambda: b.responses.cancel(resp.id),
            lambda: b.responses.delete(resp.id),
            lambda: b.responses.create(model=MODEL, input="x", previous_response_id=resp.id),
            lambda: b.responses.create(model=MODEL, input="x", conversation=conv.id),
            lambda: b.conversations.retrieve(conv.id),
            lambda: b.conversations.update(conv.id, metadata={"k": "v"}),
            lambda: b.conversations.items.list(conv.id),
            lambda: b.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
            lambda: b.conversations.items.retrieve(item.id, conversation_id=conv.id),
            lambda: b.conversations.items.delete(item.id, conversation_id=conv.id),
            lambda: b.conversations.delete(conv.id),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError):
                call()
        assert a.responses.retrieve(resp.id).id == resp.id  # still there for its owner
        assert len(a.conversations.items.list(conv.id).data) == 1
