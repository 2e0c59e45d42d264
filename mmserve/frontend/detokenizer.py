"""Incremental detokenization and stop strings, at a cost per token that does not grow
with the answer.

:class:`IncrementalDetokenizer` turns output ids into text piece by piece. It decodes
only a short window of recent ids each time (the offset scheme of vLLM's and
text-generation-inference's incremental decoders, written here for our tokenizers):
``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``, emitted only when it does
not end in an incomplete UTF-8 character nor in a run of byte-fallback tokens. UTF-8 is
self-synchronising, so once the window's text ends on a whole character outside such a
run, later tokens cannot change it, and the pieces
join to exactly ``tokenizer.decode(ids, skip_special_tokens=True)`` (property-tested in
``tests/test_detokenizer.py`` on every family's tokenizer, byte-fallback tokens and
invalid byte sequences included).

:class:`TextStream` adds stop strings on top: the earliest occurrence of any stop
string ends the text, and text that could still turn into a stop string is held back,
so a client never sees part of a stop string.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

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


class IncrementalDetokenizer:
    """Text of a growing list of token ids, one piece per :meth:`push`.

    Args:
        tokenizer: a transformers tokenizer (its Rust ``tokenizers`` backend is used
            directly when it has one: same text, without transformers' per-call
            conversion of the id list).
        skip_special_tokens: drop special tokens from the text (as the server does).
        context: ids the text follows (the tail of a prompt that ends inside a message
            being continued): the pieces are the text the ids add after it, so a first
            token's leading space, which decoding alone drops, is kept.

    The cost of a push is that of decoding the ids since the last emitted piece plus
    a few earlier ones, independent of how many ids came before.
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> None:
        skip = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        if backend is not None and hasattr(backend, "decode") and not cleanup:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
        self._byte_ids, special = token_classes(tokenizer)
        self._transparent = special if skip_special_tokens else frozenset()
        self._in_byte_run = False
        self.ids: list[int] = list(context)
        self._prefix = 0  # window start: ids before it are settled text
        self._read = len(self.ids)  # ids up to here are emitted
        #: characters of the context's text (not part of :attr:`text`)
        self.context_chars = len(self._decode(self.ids)) if self.ids else 0
        self.text = ""
        #: the last piece and the window it was decoded in: (prefix, read, piece)
        self._last: tuple[int, int, str] = (0, 0, "")

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; returns the new text they complete ("" while a character or a
        piece of a word is still incomplete)."""
        self.ids.extend(ids)
        for tok in ids:
            if tok not in self._transparent:
                self._in_byte_run = tok in self._byte_ids
        if self._in_byte_run:
            return ""  # an open run of byte tokens may still turn into U+FFFDs
        window = self.ids[self._prefix :]
        prefix_text = self._decode(window[: self._read - self._prefix])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        piece = new_text[len(prefix_text) :]
        self._last = (self._prefix, self._read, piece)
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD,
        as one-shot decoding writes it)."""
        window = self.ids[self._prefix :]
        prefix_text = self._decode(window[: self._read - self._prefix])
        new_text = self._decode(window)
        piece = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        if piece:
            self._last = (self._prefix, self._read, piece)
        self._prefix = self._read = len(self.ids)
        self.text += piece
        return piece

    def ids_behind(self, chars: int) -> tuple[int, int]:
        """``(needed, covered)``: of the ``covered`` ids whose text the last piece is
        (several after a run of byte tokens or an incomplete character), the first
        ``needed`` already decode to its first ``chars`` characters.

        Decodes the piece's window once per id until they do, so it costs
        ``covered`` decodes of a short window; it is called only when a stop string
        ends inside a piece."""
        prefix, read, piece = self._last
        covered = len(self.ids) - read
        base = len(self._decode(self.ids[prefix:read]))
        for k in range(1, covered):
            text = self._decode(self.ids[prefix : read + k])
            if text[base : base + chars] == piece[:chars]:
                return k, covered
        return covered, covered


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
        text: the answer so far (cut at a stop string once one is found).
        sent: how much of :attr:`text` :meth:`push` has released (the rest could
            still be the start of a stop string).
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
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.num_tokens = 0
        self._floor = 0  # stop strings must end after this character (min_tokens)
        self._searched = False

    def push(self, ids: Sequence[int]) -> str:
        """Add output ids (after a stop: ignored); returns text now safe to show."""
        for tok in ids:  # one at a time: a stop ends the answer at its own token
            if self.stopped:
                break
            self.num_tokens += 1
            piece = self.detok.push([tok])
            if self.num_tokens == self.min_tokens - 1:
                # stop strings must end after the text of the first min_tokens - 1 tokens
                self._floor = len(self.detok._decode(self.detok.ids)) - self.detok.context_chars
            if piece:
                self._add(piece)
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text at the end of the request (held-back text included)."""
        if not self.stopped:
            piece = self.detok.flush()
            if piece:
                self._add(piece)
        return self._release(final=True)

    def _add(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        if not self.stop or self.num_tokens < self.min_tokens:
            return
        # a stop may begin up to len(stop) - 1 characters before the new piece; the
        # first search (min_tokens just reached) looks back to the floor
        lo = (start if self._searched else self._floor) - self._holdback
        self._searched = True
        hits = (self.text.find(s, max(0, lo, self._floor - len(s) + 1)) for s in self.stop)
        found = [(i, i + len(s)) for i, s in zip(hits, self.stop, strict=True) if i >= 0]
        if found:
            cut, end = min(found)
            if end > start:  # the ids after the one whose text completes the stop go
                needed, covered = self.detok.ids_behind(end - start)
                self.num_tokens = max(self.num_tokens - covered + needed, self.min_tokens)
            self.text = self.text[:cut]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.sent, len(self.text) - self._holdback)
        out = self.text[self.sent : end]
        self.sent = end
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
