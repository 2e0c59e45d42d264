"""The load generators of ``python -m benchmarks host``: all of a concurrency level's chats
sent at once, each answer's completion tokens checked.

Two clients, because the load generator shares the benchmark machine's cores with the
server it measures:

- ``aiohttp`` (the default; vLLM's ``benchmark_serving`` uses it too): streamed answers
  are read line by line, and only the lines that are not plain content chunks are parsed
  as JSON (the usage chunk, an error event): a content chunk of a request that asked for
  ``include_usage`` carries ``"usage": null``, which no JSON string inside it can spell
  (its quotes would be escaped), so the line is counted, not parsed.
- ``httpx``: what the benchmark used first; every event is parsed as JSON. It costs the
  machine about twice the API process's CPU per streamed token, so it measures a slow
  client as much as the server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import httpx

#: The load generators ``--client`` may name.
CLIENTS = ("aiohttp", "httpx")
#: What a content chunk of a stream with ``include_usage`` holds and no other event does.
_NO_USAGE = b'"usage": null'
_JSON = {"Content-Type": "application/json"}


class AnswerError(RuntimeError):
    """An answer failed: HTTP status, an error event, no usage chunk, or the wrong number
    of completion tokens."""


def _check(n: int | None, tokens: int, events: int | None) -> int:
    """``n`` (the usage's completion tokens) when it is ``tokens`` and a streamed answer
    (``events``: its content chunks, None when plain) had between 1 and ``tokens`` of
    them (several tokens merge into one chunk when the reader is behind).

    Raises:
        AnswerError: otherwise.
    """
    if n is None:
        raise AnswerError("no usage chunk")
    if n != tokens:
        raise AnswerError(f"{n} completion tokens, {tokens} asked for (ignore_eos)")
    if events is not None and not 1 <= events <= tokens:
        raise AnswerError(f"{events} content chunks for {tokens} tokens")
    return n


async def _aiohttp_one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, tokens: int
) -> int:
    async with session.post(url, data=body, headers=_JSON) as r:
        if r.status != 200:
            raise AnswerError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
        if not stream:
            return _check(
                int(json.loads(await r.read())["usage"]["completion_tokens"]), tokens, None
            )
        n, events = None, 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if _NO_USAGE in line:  # a content, role or finish chunk: counted, not parsed
                events += b'"delta": {"content": "' in line and b'"content": ""' not in line
                continue
            if line.startswith(b"data: [DONE]"):
                break
            n = _usage_tokens(json.loads(line[6:]), n)
        return _check(n, tokens, events)


def _usage_tokens(chunk: dict, n: int | None) -> int | None:
    """The completion tokens a streamed chunk's usage reports, else ``n`` (as before).

    Raises:
        AnswerError: for an error chunk.
    """
    if "error" in chunk:
        raise AnswerError(str(chunk["error"])[:300])
    return int(chunk["usage"]["completion_tokens"]) if chunk.get("usage") else n


async def _httpx_one(
    client: httpx.AsyncClient, url: str, body: bytes, stream: bool, tokens: int
) -> int:
    if not stream:
        r = await client.post(url, content=body, headers=_JSON)
        r.raise_for_status()
        return _check(int(r.json()["usage"]["completion_tokens"]), tokens, None)
    n, events = None, 0
    async with client.stream("POST", url, content=body, headers=_JSON) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            n = _usage_tokens(chunk, n)
            for choice in chunk.get("choices") or ():
                events += bool((choice.get("delta") or {}).get("content"))
    return _check(n, tokens, events)


def send_all(
    client: str, url: str, bodies: Sequence[dict[str, Any]], stream: bool, tokens: int
) -> list[int]:
    """Send every chat body at once to the server at ``url`` with ``client`` (one of
    :data:`CLIENTS`, one connection per request) and wait for all answers.

    Returns:
        each answer's completion tokens (each is ``tokens``).

    Raises:
        AnswerError: an answer failed or had the wrong token count.
        ValueError: an unknown ``client``.
    """
    chat = url + "/v1/chat/completions"
    raw = [json.dumps(b).encode() for b in bodies]

    async def go() -> list[int]:
        if client == "aiohttp":
            timeout = aiohttp.ClientTimeout(total=600)
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
                return await asyncio.gather(
                    *(_aiohttp_one(session, chat, b, stream, tokens) for b in raw)
                )
        if client == "httpx":
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(timeout=600, limits=limits) as http:
                return await asyncio.gather(
                    *(_httpx_one(http, chat, b, stream, tokens) for b in raw)
                )
        raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")

    return asyncio.run(go())
