"""Compiling structured-output specs against one model's vocabulary (front end).

:class:`GrammarCache` compiles each distinct :class:`~mmserve.structured.spec.GuidedSpec`
once on an HTTP worker thread (a bounded LRU) and hands out each request's
:class:`GrammarState`; the engine thread only makes a fresh matcher from the compiled
grammar a message carries (:func:`new_state`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from mmserve.lru import LRU
from mmserve.structured.spec import (
    GRAMMAR_CACHE_SIZE,
    GrammarError,
    GuidedSpec,
    check_spec,
    describe_error,
    ebnf,
    load_xgrammar,
)

if TYPE_CHECKING:
    from mmserve.model.loader import LoadedModel


class GrammarState:
    """One request's position in its grammar (an xgrammar ``GrammarMatcher``).

    Args:
        matcher: a fresh matcher of the compiled grammar.
        spec: the spec it enforces.
    """

    def __init__(self, matcher: Any, spec: GuidedSpec) -> None:
        self.matcher = matcher
        self.spec = spec


def new_state(compiled: Any, spec: GuidedSpec) -> GrammarState:
    """A fresh matcher of an already compiled grammar (what the engine makes for each
    constrained request from its message)."""
    return GrammarState(load_xgrammar().GrammarMatcher(compiled), spec)


class GrammarCache:
    """Compiles specs against one model's vocabulary; a bounded LRU of compiled grammars.

    Thread-safe: HTTP worker threads compile here (never the engine thread); two
    callers asking for the same new spec compile it once. Special tokens other than
    end-of-sequence, and the model's never-sampled ids, are never allowed. For JSON
    outputs tokens holding control characters (bytes 0x00-0x1f, which JSON strings
    must escape; xgrammar's length-bounded strings would let them through) and bytes
    that never occur in UTF-8 (0xc0, 0xc1, 0xf5-0xff) are never allowed either.

    Args:
        model: the loaded checkpoint (tokenizer, vocabulary size, stop ids).
        capacity: compiled grammars kept (least recently used dropped first).

    Attributes:
        compiles: grammars compiled so far (cache misses).
    """

    def __init__(self, model: LoadedModel, capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self.model = model
        self.capacity = capacity
        self.compiles = 0
        self._lock = threading.Lock()
        self._cache: LRU[GuidedSpec, Any] = LRU(max_items=capacity)
        self._pending: dict[GuidedSpec, threading.Event] = {}
        self._compilers: tuple[Any, Any] | None = None
        self._vocab: list[bytes] | None = None

    def _get_compilers(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compilers is None:
                self._compilers, self._vocab = _make_compilers(self.model)
            return self._compilers

    def vocab_bytes(self) -> list[bytes]:
        """Each token id's bytes as decoded text holds them (``b""`` for special ids)."""
        self._get_compilers()
        assert self._vocab is not None  # set with the compilers
        return self._vocab

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of ``spec`` (cached).

        Raises:
            GrammarError: if the spec is refused or does not compile.
        """
        check_spec(spec)
        while True:
            with self._lock:
                compiled = self._cache.get(spec)
                if compiled is not None:
                    return compiled
                waiting = self._pending.get(spec)
                if waiting is None:
                    self._pending[spec] = threading.Event()
                    break
            waiting.wait()  # another thread compiles it; then look again
        try:
            compiled = self._compile(spec)
            with self._lock:
                self.compiles += 1
                self._cache.put(spec, compiled)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(spec).set()

    def _compile(self, spec: GuidedSpec) -> Any:
        full, json_only = self._get_compilers()
        try:
            if spec.kind == "json_schema":
                return json_only.compile_json_schema(
                    spec.spec, any_whitespace=False, strict_mode=True
                )
            if spec.kind == "json_object":
                return json_only.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.kind == "regex":
                return full.compile_regex(spec.spec)
            return full.compile_grammar(ebnf(spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError
            raise GrammarError(describe_error(spec, e), spec.param) from None

    def state(self, spec: GuidedSpec) -> GrammarState:
        """A fresh matcher for one request (compiling ``spec`` if needed).

        Raises:
            GrammarError: if the spec is refused or does not compile.
        """
        return new_state(self.compile(spec), spec)

    @property
    def hits(self) -> int:
        """Lookups answered from the cache."""
        return self._cache.hits

    def __len__(self) -> int:
        return len(self._cache)


def _make_compilers(model: LoadedModel) -> tuple[tuple[Any, Any], list[bytes]]:
    """Two ``GrammarCompiler`` (any text; JSON, control characters never allowed) and
    the vocabulary's bytes."""
    xgr = load_xgrammar()
    tok = model.tokenizer
    vocab_size = model.decoder.shape.vocab_size
    stop = list(model.eos_token_ids)
    base = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=stop)
    vocab = list(base.decoded_vocab)[:vocab_size]
    vocab += [b""] * (vocab_size - len(vocab))
    banned = set(getattr(tok, "all_special_ids", [])) | set(model.never_sample_ids)
    for i in banned - set(stop):
        if 0 <= i < vocab_size:
            vocab[i] = b""  # xgrammar never allows an empty token
    bad_json = set(range(0x20)) | {0xC0, 0xC1} | set(range(0xF5, 0x100))
    json_vocab = [b"" if any(c in bad_json for c in v) else v for v in vocab]
    for i in stop:
        json_vocab[i] = vocab[i]
    infos = [
        xgr.TokenizerInfo(v, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
        for v in (vocab, json_vocab)
    ]
    compilers = tuple(xgr.GrammarCompiler(i, max_threads=2, cache_enabled=False) for i in infos)
    return compilers, vocab
