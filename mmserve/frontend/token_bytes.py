"""Raw UTF-8 bytes of each token, for the ``bytes`` field of OpenAI logprobs.

Decoding one token on its own loses what a logprob needs: a byte-fallback token
(SentencePiece ``<0xE5>``) or a byte-level BPE token holding part of a character
(GPT-2 / Qwen2 style) decodes to U+FFFD, and a SentencePiece ``▁word`` decodes without
its space. :class:`TokenBytes` instead reads each id's bytes off the vocabulary once per
tokenizer, the way the tokenizer's own decoder turns token strings into text:

- byte-level BPE (``ByteLevel`` decoder): every character of the token string stands
  for one byte through GPT-2's printable byte alphabet (section 2.2 of Radford et al.,
  "Language Models are Unsupervised Multitask Learners", 2019), inverted here;
- SentencePiece (``Replace("▁", " ")`` / ``Metaspace`` decoders, ``ByteFallback``):
  ``▁`` is a space and ``<0xNN>`` is the byte 0xNN;
- added tokens (``<image>``, ``<|im_end|>``): their text, or nothing when decoding with
  ``skip_special_tokens=True`` (as the server does) drops them;
- anything else: the UTF-8 of the token decoded alone.

Joining the bytes of a sequence's tokens then gives the UTF-8 of its decoded text
(:meth:`TokenBytes.text_bytes`, property-tested against ``tokenizer.decode`` for each
bundled family in ``tests/test_token_bytes.py``), except where decoding itself replaces
invalid UTF-8 by U+FFFD or ``clean_up_tokenization_spaces`` edits spaces.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Iterable
from functools import lru_cache
from typing import Protocol

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


class Tokenizer(Protocol):
    """What the text side calls on a transformers tokenizer (``decode`` of one id list is a
    ``str``); its optional parts (the Rust backend, added tokens) are read with ``getattr``."""

    def __len__(self) -> int: ...

    def decode(self, token_ids: list[int], /, skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int], /) -> Iterable[str | None]: ...


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable character -> the byte it stands for.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for
    themselves; the other 68, in increasing order, take the characters U+0100, U+0101, ...
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for n, b in enumerate(shifted):
        out[chr(0x100 + n)] = b
    return out


_BYTE_LEVEL = _byte_alphabet()
#: ``str.translate`` table: an alphabet character becomes the Latin-1 character of its
#: byte; any other Latin-1 character becomes U+FFFF, so ``encode("latin-1")`` fails on
#: every string that is not byte-level text (characters above U+00FF fail by themselves).
_TO_LATIN1 = {cp: 0xFFFF for cp in range(256)} | {ord(c): b for c, b in _BYTE_LEVEL.items()}


def _byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level token string stands for, or None if it is not one."""
    try:
        return piece.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _decoder_types(tokenizer: object) -> set[str]:
    """Types of the Rust decoder and of the decoders nested in it ("ByteLevel", ...)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    types: set[str] = set()

    def walk(d: object) -> None:
        if isinstance(d, dict):
            if "type" in d:
                types.add(str(d["type"]))
            for v in d.get("decoders") or ():
                walk(v)

    walk(json.loads(decoder.__getstate__()))
    return types


def _token_strings(tokenizer: Tokenizer, n: int) -> list[str | None]:
    """Token string of every id below ``n`` (None where there is none)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return list(tokenizer.convert_ids_to_tokens(list(range(n))))
    out: list[str | None] = [None] * n
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= i < n:
            out[i] = piece
    return out


class TokenBytes:
    """Per-id raw bytes of a tokenizer's vocabulary, as its decoder writes them.

    Build with :func:`token_bytes` (cached per tokenizer). Building walks the whole
    vocabulary once (0.7 s for a 152k-id byte-level vocabulary, Qwen2's size, on one CPU core).

    Args:
        tokenizer: a transformers tokenizer; a fast one (Rust ``tokenizers`` backend)
            is read exactly, others through ``convert_ids_to_tokens`` and the
            SentencePiece conventions.

    Attributes:
        skipped: ids that ``decode(..., skip_special_tokens=True)`` drops (special
            added tokens); they add no bytes to the text.
        special_text: text of every added token (skipped or not), by id.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        types = _decoder_types(tokenizer)
        n = len(tokenizer)
        pieces = _token_strings(tokenizer, n)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_text: dict[int, str] = {i: str(t) for i, t in added.items() if i < n}
        self.skipped: frozenset[int] = frozenset(
            i for i in self.special_text if self._decode([i], skip=True) == ""
        )
        regular = [p for i, p in enumerate(pieces[:5000]) if p and i not in self.special_text]
        # without a Rust decoder to read (a Python tokenizer), judge by the token strings
        byte_level = "ByteLevel" in types or (
            not types and bool(regular) and all(_byte_level_bytes(p) is not None for p in regular)
        )
        sentencepiece = bool(types & {"Metaspace", "Replace", "ByteFallback"}) or (
            not types and not byte_level and any("\u2581" in p for p in regular)
        )
        table: list[bytes] = []
        for i, piece in enumerate(pieces):
            if i in self.special_text:
                out = b"" if i in self.skipped else self._decode([i], skip=False).encode()
            elif piece is None:
                out = self._decode([i], skip=False).encode()
            elif byte_level:
                level = _byte_level_bytes(piece)
                # not a byte-level string: trust the decoder
                out = level if level is not None else self._decode([i], skip=False).encode()
            elif sentencepiece:
                m = _BYTE_TOKEN.match(piece)
                out = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
            else:
                out = self._decode([i], skip=False).encode()
            table.append(out)
        self._table = table
        self._strips = lru_cache(maxsize=4096)(self._strips_leading_space)

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip)

    def __len__(self) -> int:
        return len(self._table)

    def raw(self, token_id: int) -> bytes:
        """Bytes ``token_id`` adds to decoded text after other tokens (b"" for a skipped
        special token). Ids outside the vocabulary: the UTF-8 of their decoded text."""
        if 0 <= token_id < len(self._table):
            return self._table[token_id]
        return self._decode([token_id], skip=True).encode()

    def _strips_leading_space(self, token_id: int) -> bool:
        raw = self.raw(token_id)
        return raw[:1] == b" " and not self._decode([token_id], skip=True).startswith(" ")

    def at(self, token_id: int, first: bool) -> bytes:
        """Bytes ``token_id`` adds to decoded text.

        Args:
            first: no text-bearing token comes before it (skipped specials aside):
                decoders that drop the space SentencePiece puts before the first word
                (a ``Strip`` or ``Metaspace`` decoder) drop it from this token.
        """
        raw = self.raw(token_id)
        if first and raw[:1] == b" " and self._strips(token_id):
            return raw[1:]
        return raw

    def text_bytes(self, ids: Iterable[int]) -> list[bytes]:
        """Each id's bytes in ``tokenizer.decode(ids, skip_special_tokens=True)`` (the
        first text-bearing id with :meth:`at`'s ``first`` set)."""
        out, first = [], True
        for i in ids:
            b = self.at(i, first)
            first = first and i in self.skipped
            out.append(b)
        return out


def token_bytes(tokenizer: Tokenizer) -> TokenBytes:
    """The :class:`TokenBytes` of ``tokenizer``, built once and cached while it lives."""
    with _cache_lock:
        try:
            return _cache[tokenizer]
        except (KeyError, TypeError):
            pass
    table = TokenBytes(tokenizer)
    with _cache_lock:
        try:
            _cache[tokenizer] = table
        except TypeError:  # not weak-referenceable: built again next time
            pass
    return table


def token_string(raw: bytes) -> str:
    """The ``token`` string for raw bytes: their text when they are whole UTF-8, else
    OpenAI's notation for a partial character, ``"bytes:\\xe5\\x8c"`` (every byte as
    ``\\xNN``), so that no token is shown as U+FFFD."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
