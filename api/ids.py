"""The ids the server hands out, and the errors for ids it cannot use.

Five kinds: uploaded images (``img-`` + 32 hex digits, the image key), uploaded videos
(``vid-`` + 32 hex, xxh3-128 of the bytes), batch files (``file-`` + 24 hex),
batches (``batch_`` + 24 hex) and live video streams (``stream-`` + 32 hex). Images and
videos may also be written as ``mmserve://images/<id>`` / ``mmserve://videos/<id>``.

An id that is not of its kind's form never names anything, so it is told apart
from a well-formed id that is unknown (never uploaded, deleted or evicted): the
error says which, names the field and shows the expected form. A path parameter
answers 404 either way; a request field answers 400 for a malformed id.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from api.errors import APIError

T = TypeVar("T")
#: Longest piece of a client's value repeated in an error message (characters).
SHOWN_CHARS = 80
# what a client may mean as an id rather than a URL or a path: one token of id characters
_ID_LIKE = re.compile(r"^[A-Za-z0-9_\-]+$")


@dataclass(frozen=True)
class IdKind:
    """One kind of id.

    Attributes:
        name: what it names ("image", "video", "file", "batch").
        prefix: how every id of the kind starts.
        hex_digits: how many lowercase hex digits follow the prefix.
        scheme: the URL form's prefix (``mmserve://images/``), or "" for none.
        create: how a client makes one (``POST /v1/images``).
    """

    name: str
    prefix: str
    hex_digits: int
    scheme: str
    create: str

    @property
    def form(self) -> str:
        """The id's form in words: ``img- followed by 32 lowercase hex digits``."""
        return f"{self.prefix} followed by {self.hex_digits} lowercase hex digits"

    def parse(self, value: str) -> str | None:
        """The id in ``value`` (its URL form accepted), or None if it is not well formed."""
        ident = value.removeprefix(self.scheme) if self.scheme else value
        pattern = rf"{re.escape(self.prefix)}[0-9a-f]{{{self.hex_digits}}}"
        return ident if re.fullmatch(pattern, ident) else None

    def claims(self, value: str) -> bool:
        """Whether ``value`` is written as an id of this kind (well formed or not)."""
        v = value.lower()
        return v.startswith(self.prefix) or bool(self.scheme) and v.startswith(self.scheme)

    def malformed(self, value: str, param: str, status: int = 400) -> APIError:
        """The error for ``value`` at ``param`` that is not an id of this kind
        (``invalid_{name}_id``), worded as :meth:`not_found` and then why."""
        other = next((k for k in KINDS if k is not self and k.claims(value)), None)
        why = (
            f"that is {_a(other.name)} id, not {_a(self.name)} id"
            if other is not None and other.parse(value) is not None
            else f"the id is malformed: {_a(self.name)} id is {self.form}"
        )
        return self._error(value, param, status, f": {why}", f"invalid_{self.name}_id")

    def not_found(self, ident: str, param: str, status: int = 404) -> APIError:
        """The error for a well-formed id that names nothing (``{name}_not_found``): 404
        ``no image with id ...`` for a path parameter, 400 ``unknown image id ...`` for a
        request field."""
        gone = "never uploaded, deleted or evicted" if self.scheme else "never made or deleted"
        return self._error(ident, param, status, f" ({gone})", f"{self.name}_not_found")

    def _error(self, value: str, param: str, status: int, why: str, code: str) -> APIError:
        what = (
            f"no {self.name} with id {shown(value)}"
            if status == 404
            else f"unknown {self.name} id {shown(value)}"
        )
        return APIError(
            status,
            f"{param}: {what}{why}; create one with {self.create}",
            "not_found_error" if status == 404 else "invalid_request_error",
            param,
            code=code,
        )

    def deleted(self, ident: str, removed: bool, param: str) -> dict:
        """The answer to ``DELETE`` of ``ident`` (path parameter ``param``):
        ``{"id", "object": "<name>.deleted", "deleted": true}``.

        Raises:
            APIError: 404 (malformed or unknown id) when nothing was ``removed``.
        """
        if not removed:
            raise self.not_found(self.check(ident, param, 404), param)
        return {"id": ident, "object": f"{self.name}.deleted", "deleted": True}

    def find(
        self,
        value: str,
        param: str,
        get: Callable[[str], T | None],
        status: int = 400,
        missing: int | None = None,
    ) -> T:
        """What ``get`` finds for the id in ``value`` (the request field ``param``).

        Raises:
            APIError: :meth:`malformed` with ``status``; :meth:`not_found` with ``missing``
                (default: ``status``) when ``get`` finds nothing.
        """
        ident = self.check(value, param, status)
        entry = get(ident)
        if entry is None:
            raise self.not_found(ident, param, missing or status)
        return entry

    def check(self, value: str, param: str, status: int = 400) -> str:
        """The well-formed id in ``value``.

        Raises:
            APIError: :meth:`malformed` with ``status``.
        """
        ident = self.parse(value)
        if ident is None:
            raise self.malformed(value, param, status)
        return ident


def id_like(value: str) -> bool:
    """Whether ``value`` reads as an id (one token of letters, digits, ``-`` and ``_``, or one
    of our ``mmserve://`` URLs) rather than a URL, a data URL or a path."""
    return bool(_ID_LIKE.match(value)) or value.lower().startswith("mmserve://")


def shown(value: str) -> str:
    """``value`` as an error message repeats it: quoted, at most :data:`SHOWN_CHARS`."""
    cut = value[:SHOWN_CHARS]
    return repr(cut) + ("..." if len(value) > SHOWN_CHARS else "")


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


IMAGE = IdKind("image", "img-", 32, "mmserve://images/", "POST /v1/images")
VIDEO = IdKind("video", "vid-", 32, "mmserve://videos/", "POST /v1/videos")
FILE = IdKind("file", "file-", 24, "", "POST /v1/files")
BATCH = IdKind("batch", "batch_", 24, "", "POST /v1/batches")
STREAM = IdKind("stream", "stream-", 32, "", "POST /v1/streams")
KINDS = (IMAGE, VIDEO, FILE, BATCH, STREAM)
