"""Incremental detokenization and stop strings, at a cost per token that does not grow
with the answer.

:class:`IncrementalDetokenizer` turns output ids into text piece by piece with the fast
tokenizer's own incremental decoder, ``tokenizers.decoders.DecodeStream`` (it decodes
the ids since the piece before last and emits what they add once the text does not end
in U+FFFD, an incomplete UTF-8 character; the offset scheme of vLLM's and
text-generation-inference's incremental decoders). One case it cannot take is handled
here, before it: a run of SentencePiece byte-fallback tokens decodes as one group, and if
the group is not valid UTF-8 every byte of it becomes U+FFFD (the ``ByteFallback``
decoder), so a character shown early could turn into U+FFFD later; the run's ids are held
here and handed on together with the token that ends it. Pieces join to exactly
``tokenizer.decode(ids, skip_special_tokens=True)`` (property-tested in
``tests/test_detokenizer.py`` on every family's tokenizer, byte-fallback and special
tokens and invalid byte sequences included). This module is the one place that decides
when text ending in U+FFFD is shown: never before the end of the answer, where it is what
one-shot decoding writes. A tokenizer without a Rust backend gets the same algorithm in
Python (:class:`_WindowDecoder`).

:class:`TextStream` adds stop strings on top: the earliest occurrence of any stop
string ends the text, and text that could still turn into a stop string is held back,
so a client never sees part of a stop string. Each piece is searched only together with
the text held back before it (a stop string cannot start earlier), and the answer is kept
as a list of pieces: no step copies the text so far.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from mmserve.frontend.token_bytes import Tokenizer

#: U+FFFD, what a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_byte_ids_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_classes(tokenizer: object) -> tuple[frozenset[int], frozenset[int]]:
    """``(byte_ids, special_ids)``, computed once per tokenizer.

    ``byte_ids`` are SentencePiece byte-fallback tokens (``<0xE5>``). A run of them
    decodes as one group: if the group is not valid UTF-8, every byte of it becomes
    U+FFFD (the ``tokenizers`` ByteFallback decoder), so text ending in such a run is
    not settled until a token of another kind follows. ``special_ids`` are the special
    tokens that skipping removes before decoding, so a run continues across them.
    """
    try:
        return _byte_ids_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    byte_ids = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.match(t))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, t in added.items() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
    out = (byte_ids, frozenset(special))
    try:
        _byte_ids_cache[tokenizer] = out
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return out


def _backend(tokenizer: object) -> RustTokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` behind a transformers tokenizer, when decoding
    through it gives the same text (no ``clean_up_tokenization_spaces``)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    backend = backend or getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, RustTokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class _WindowDecoder:
    """``DecodeStream``'s algorithm over a Python ``decode`` (tokenizers without a Rust
    backend): decode the ids since the piece before last, emit what they add once the
    text is longer than before and does not end in U+FFFD."""

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(context)
        self._prefix = decode(self._ids) if self._ids else ""
        self._start = 0

    def step(self, _backend: RustTokenizer | None, ids: int | list[int]) -> str | None:
        self._ids.extend(ids if isinstance(ids, list) else [ids])
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT):
            return None
        if not text.startswith(self._prefix):
            raise ValueError("invalid prefix")
        piece = text[len(self._prefix) :]
        del self._ids[: self._start]
        self._start = len(self._ids)
        self._prefix = self._decode(self._ids)
        return piece


class IncrementalDetokenizer:
    """Text of a growing list of token ids, one piece per :meth:`push`.

    Args:
        tokenizer: a transformers tokenizer; its Rust ``tokenizers`` backend drives a
            ``DecodeStream`` (a Python tokenizer: the same algorithm over its ``decode``).
        skip_special_tokens: drop special tokens from the text (as the server does).
        context: ids the text follows (the tail of a prompt that ends inside a message
            being continued): the pieces are the text the ids add after it, so a first
            token's leading space, which decoding alone drops, is kept.

    Attributes:
        text: the pieces so far, joined (built on each read: meant for tests).

    The cost of a push is that of decoding the ids since the piece before last,
    independent of how many ids came before.
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> None:
        skip = skip_special_tokens
        self._backend = be = _backend(tokenizer)
        self._decode: Callable[[list[int]], str]
        if be is not None:
            self._decode = lambda ids: be.decode(ids, skip_special_tokens=skip)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
        self._skip = skip
        self._byte_ids, special = token_classes(tokenizer)
        self._transparent = special if skip_special_tokens else frozenset()
        self._held: list[int] = []  # an open run of byte tokens, not yet decoded
        # ids since the piece before last: ``_window[:_read]`` decode to the text before
        # the last piece, the rest to it and to what is still pending
        self._window: list[int] = list(context)
        self._read = len(self._window)
        # the decoder starts empty and takes the context with the first ids; what it
        # emits then begins with the context's text, which is not the answer's (a
        # decoder given the context up front shows it again when that text ends inside
        # a character)
        self._lead = list(context)
        self._skip_chars = len(self._decode(self._lead)) if self._lead else 0
        self._stream = self._new_stream([])
        #: the last piece, the ids before it in its window and the ids it covers
        #: (before, covered, piece, skipped, first): the last piece, the ids before it
        #: in its window and those it covers, the context characters cut from its start,
        #: and whether it was the first (its text then counts from the context's start)
        self._last: tuple[list[int], list[int], str, int, bool] = ([], [], "", 0, True)
        self._moved = False  # a piece was emitted: the window no longer starts the text
        self._pieces: list[str] = []

    def _new_stream(self, context: list[int]) -> DecodeStream | _WindowDecoder:
        """A decoder that continues after ``context``; :attr:`_next` steps it."""
        be = self._backend
        if be is None:
            py = _WindowDecoder(self._decode, context)
            self._next: Callable[[int | list[int]], str | None] = functools.partial(py.step, None)
            return py
        rust = DecodeStream(list(context), skip_special_tokens=self._skip)
        self._next = functools.partial(rust.step, be)
        return rust

    @property
    def text(self) -> str:
        """Every piece pushed and flushed so far, joined."""
        return "".join(self._pieces)

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; returns the new text they complete ("" while a character, a run
        of byte tokens or a piece of a word is still incomplete)."""
        held = self._held
        byte_ids, transparent = self._byte_ids, self._transparent
        out = ""
        for tok in ids:
            held.append(tok)
            if tok in transparent or tok in byte_ids:
                continue  # an open run of byte tokens may still turn into U+FFFDs
            self._held = []
            out += self._step(held)
            held = self._held
        return out

    def _step(self, ids: list[int]) -> str:
        self._window.extend(ids)
        if self._lead:
            ids, self._lead = self._lead + ids, []
        try:
            raw = self._next(ids if len(ids) > 1 else ids[0])
        except Exception:  # noqa: BLE001 - the decoder's text changed before its end
            raw = self._recover()
        return self._emit(raw) if raw else ""

    def _emit(self, raw: str) -> str:
        """Record ``raw`` (the text after the last piece's window) as the next piece,
        less what is left of the context's text."""
        skip = min(self._skip_chars, len(raw))
        self._skip_chars -= skip
        piece = raw[skip:]
        w, r = self._window, self._read
        self._last = (w[:r], w[r:], piece, skip, not self._moved)
        self._moved = True
        self._window = w[r:]
        self._read = len(self._window)
        if piece:
            self._pieces.append(piece)
        return piece

    def _recover(self) -> str | None:
        """After a decoder error (text before the window's end changed: not seen with
        the bundled tokenizers), emit what the window adds and start a new stream."""
        raw = self._pending()
        if raw is None or raw.endswith(REPLACEMENT):
            return None
        self._stream = self._new_stream(self._window)
        self._lead = []
        return raw

    def _pending(self) -> str | None:
        """What the ids after the last piece add to the text (None: nothing pending),
        as :meth:`_emit` takes it (the context's text included while it is skipped)."""
        ids = self._window + self._held
        if len(ids) <= self._read:
            return None
        # until a piece is emitted the window's head is the context, whose text is what
        # _skip_chars counts: decode from the start of the ids then
        head = self._read if self._moved else 0
        before = self._decode(ids[:head]) if head else ""
        text = self._decode(ids)
        return text[len(before) :] if len(text) > len(before) else ""

    def peek(self) -> str:
        """The text the ids not yet shown would add if the answer ended now (U+FFFD for
        an incomplete character); nothing is consumed."""
        return (self._pending() or "")[self._skip_chars :]

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD,
        as one-shot decoding writes it)."""
        raw = self._pending()
        self._window.extend(self._held)
        self._held = []
        self._lead = []
        piece = self._emit(raw) if raw else ""
        self._window, self._read = [], 0
        return piece

    def decode_whole(self, ids: Sequence[int]) -> str:
        """The text of all of ``ids`` in one decode, for a detokenizer nothing was pushed
        to (a final-only answer without stop strings): what :meth:`push` and
        :meth:`flush` would give piece by piece (one-shot decoding after the context)."""
        piece = self._decode(self._lead + list(ids))[self._skip_chars :]
        self._lead, self._skip_chars, self._window, self._read = [], 0, [], 0
        self._pieces.append(piece)
        return piece

    def ids_behind(self, chars: int) -> tuple[int, int]:
        """``(needed, covered)``: of the ``covered`` ids whose text the last piece is
        (several after a run of byte tokens or an incomplete character), the first
        ``needed`` already decode to its first ``chars`` characters.

        Decodes the piece's window once per id until they do, so it costs
        ``covered`` decodes of a short window; it is called only when a stop string
        ends inside a piece."""
        before, covered, piece, skip, first = self._last
        base = (0 if first else len(self._decode(before))) + skip
        for k in range(1, len(covered)):
            text = self._decode(before + covered[:k])
            if text[base : base + chars] == piece[:chars]:
                return k, len(covered)
        return len(covered), len(covered)


class TextStream:
    """Output text of one request with stop strings applied.

    Args:
        tokenizer: see :class:`IncrementalDetokenizer`.
        stop: strings that end the text (the earliest occurrence of any of them wins,
            whatever their order; the text is cut before it).
        min_tokens: stop strings are not looked for before this many output tokens, and
            must end after the text of the first ``min_tokens - 1`` (as vLLM).
        context: prompt ids the text follows (see :class:`IncrementalDetokenizer`).

    Attributes:
        sent: characters :meth:`push` has released (the rest could still be the start
            of a stop string).
        stopped: a stop string was found (the request should end with "stop").
        num_tokens: output tokens pushed up to and including the one that stopped it:
            the first token whose text completes the stop string, also where that text
            was held back and shown only with later tokens (a run of byte tokens), so
            it may drop below the tokens pushed before the stop was found.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        context: Sequence[int] = (),
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, context=context)
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._released: list[str] = []  # text shown, in pieces
        self.sent = 0
        self._held = ""  # text after ``sent``: at most ``_holdback`` characters between pushes
        self.stopped = False
        self.num_tokens = 0
        self._floor = 0  # stop strings must end after this character (min_tokens)
        self._searched = False

    @property
    def text(self) -> str:
        """The answer so far (cut at a stop string once one is found), held-back text
        included; joined on each read."""
        return "".join(self._released) + self._held

    def push(self, ids: Sequence[int]) -> str:
        """Add output ids (after a stop: ignored); returns text now safe to show."""
        if not self.stop:  # nothing to look for: no need to go one token at a time
            self.num_tokens += len(ids)
            piece = self.detok.push(ids)
            if piece:
                self._held += piece
            return self._release(final=False)
        for tok in ids:  # one at a time: a stop ends the answer at its own token
            if self.stopped:
                break
            self.num_tokens += 1
            piece = self.detok.push([tok])
            if self.num_tokens == self.min_tokens - 1:
                # stop strings must end after the text of the first min_tokens - 1 tokens
                self._floor = self.sent + len(self._held) + len(piece) + len(self.detok.peek())
            if piece:
                self._add(piece)
        return self._release(final=self.stopped)

    def push_whole(self, ids: Sequence[int]) -> str:
        """All the output ids at once, in one decode, when there are no stop strings
        (:meth:`IncrementalDetokenizer.decode_whole`); returns the text."""
        assert not self.stop and not self.num_tokens
        self.num_tokens = len(ids)
        self._held = self.detok.decode_whole(ids)
        return self._release(final=True)

    def finish(self) -> str:
        """The rest of the text at the end of the request (held-back text included)."""
        if not self.stopped:
            piece = self.detok.flush()
            if piece:
                self._add(piece)
        return self._release(final=True)

    def _add(self, piece: str) -> None:
        base = self.sent  # where the searched window (held-back text + piece) starts
        start = base + len(self._held)
        window = self._held + piece
        self._held = window
        if not self.stop or self.num_tokens < self.min_tokens:
            return
        # a stop may begin up to len(stop) - 1 characters before the new piece (never in
        # text already released); the first search (min_tokens just reached) looks back
        # to the floor
        lo = (start if self._searched else self._floor) - self._holdback
        self._searched = True
        found = []
        for s in self.stop:
            i = window.find(s, max(0, lo - base, self._floor - len(s) + 1 - base))
            if i >= 0:
                found.append((base + i, base + i + len(s)))
        if found:
            cut, end = min(found)
            if end > start:  # the ids after the one whose text completes the stop go
                needed, covered = self.detok.ids_behind(end - start)
                self.num_tokens = max(self.num_tokens - covered + needed, self.min_tokens)
            self._held = window[: cut - base]
            self.stopped = True

    def _release(self, final: bool) -> str:
        held = self._held
        n = len(held) if final else len(held) - self._holdback
        if n <= 0:
            return ""
        out, self._held = held[:n], held[n:]
        self._released.append(out)
        self.sent += n
        return out


def first_stop(text: str, stops: Sequence[str], floor: int = 0) -> int | None:
    """Where ``text`` must end: the start of the earliest occurrence of any stop string
    (the one-shot reference of :class:`TextStream`).

    The list order does not matter (OpenAI's behaviour); ties start at one position.

    Args:
        text: the output text.
        stops: the stop strings (non-empty).
        floor: only occurrences that end after character ``floor`` count.

    Returns:
        The character index to cut at, or None when no stop string occurs.
    """
    found = [i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in stops) if i >= 0]
    return min(found) if found else None
