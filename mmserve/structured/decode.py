"""Constrained decoding on the engine thread: grammar masks over a batch's logits,
matcher advances and jump-forward (:class:`GuidedDecoding`); see :mod:`mmserve.structured`
for the method and its sources.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mmserve.structured.spec import load_xgrammar

if TYPE_CHECKING:
    from mmserve.model.loader import LoadedModel
    from mmserve.structured.compile import GrammarCache, GrammarState


class ConstrainedRequest(Protocol):
    """What :class:`GuidedDecoding` reads of a request (the engine's
    :class:`~mmserve.engine.request.Request`; it writes only the matcher)."""

    @property
    def grammar(self) -> GrammarState | None:
        """The request's matcher, or None when it is not constrained."""

    @property
    def output_ids(self) -> list[int]:
        """Tokens appended so far."""

    @property
    def params(self) -> Any:
        """Its sampling parameters (``max_tokens`` is read)."""


def _matcher(req: ConstrainedRequest) -> Any:
    """The xgrammar matcher of a constrained request (one with a grammar)."""
    grammar = req.grammar
    assert grammar is not None, "not a constrained request"
    return grammar.matcher


@dataclass
class GuidedStats:
    """Counters of constrained decoding since start.

    Attributes:
        mask_steps: batches whose logits got grammar masks.
        masked_rows: rows masked (constrained requests x steps).
        mask_seconds: wall time filling and applying masks (seconds).
        jumps: jump-forward appends.
        jumped_tokens: tokens appended by jump-forward (beyond the sampled ones).
        retokenized: jumps whose boundary token was replaced by re-tokenization.
    """

    mask_steps: int = 0
    masked_rows: int = 0
    mask_seconds: float = 0.0
    jumps: int = 0
    jumped_tokens: int = 0
    retokenized: int = 0


#: Output ids decoded around a jump-forward (enough for any token's text to settle).
JUMP_CONTEXT = 16


@dataclass
class Advance:
    """What a constrained request's grammar makes of its sampled token.

    Attributes:
        token: the id to append for the sampled token (a re-tokenized jump may
            replace it).
        forced: ids the grammar forces after it (jump-forward; logprob 0).
        keep: False when the sampled token is a stop token the grammar forced: it is
            not an answer token and is not appended.
        reason: "stop" when the grammar has ended, else None.
    """

    token: int
    forced: list[int] = field(default_factory=list)
    keep: bool = True
    reason: str | None = None


class GuidedDecoding:
    """Masks, matcher advances and jump-forward for constrained requests (engine thread).

    Besides the grammar's mask, a row whose text ends with the lead byte of a UTF-8
    sequence whose second byte is restricted (0xe0, 0xed, 0xf0, 0xf4: Unicode 15,
    Table 3-7) may not continue with a token starting with a byte outside that range:
    xgrammar accepts UTF-8-encoded surrogates (0xed 0xa0-0xbf ...), which decode to
    three U+FFFD characters and break ``maxLength`` and patterns.

    Args:
        model: the loaded checkpoint (tokenizer, stop ids).
        grammars: the front end's grammar cache (its vocabulary bytes).
        jump_forward: append forced continuations at once (``--disable-jump-forward``
            turns it off).
    """

    def __init__(
        self, model: LoadedModel, grammars: GrammarCache, jump_forward: bool = True
    ) -> None:
        self.model = model
        self.grammars = grammars
        self.jump_forward = jump_forward
        self.stop_ids = list(model.eos_token_ids)
        self.stats = GuidedStats()
        self._shifts: torch.Tensor | None = None
        self._after_lead: dict[int, torch.Tensor] | None = None

    def apply_masks(
        self, reqs: Sequence[ConstrainedRequest], rows: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor | Sequence[torch.Tensor]:
        """Set every disallowed token of each constrained request's row to ``-inf``.

        Args:
            reqs: the requests whose next token is sampled from ``rows``.
            rows: fp32 logits ``[B, vocab]`` (or B rows of ``[vocab]``), row i for ``reqs[i]``.

        Returns:
            ``rows`` unchanged when no request is constrained; else the rows with the
            constrained ones replaced by masked copies. A row the grammar leaves no
            token for (a dead end) allows the end-of-sequence tokens, which end it.
        """
        idx = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not idx:
            return rows
        t0 = time.perf_counter()
        xgr = load_xgrammar()
        out = list(rows)
        vocab = out[0].shape[-1]
        bitmask = xgr.allocate_token_bitmask(len(idx), vocab)
        for k, i in enumerate(idx):
            _matcher(reqs[i]).fill_next_token_bitmask(bitmask, k)
        allowed = self._unpack(bitmask.to(out[0].device), vocab)
        self._utf8_second_byte(allowed, [reqs[i] for i in idx])
        dead = ~allowed.any(dim=1)
        if bool(dead.any()):
            stop = torch.tensor(self.stop_ids, device=allowed.device)
            allowed[dead.nonzero().flatten().unsqueeze(1), stop] = True
        masked = torch.stack([out[i] for i in idx]).masked_fill(~allowed, float("-inf"))
        for k, i in enumerate(idx):
            out[i] = masked[k]
        s = self.stats
        s.mask_steps += 1
        s.masked_rows += len(idx)
        s.mask_seconds += time.perf_counter() - t0
        return out

    def _utf8_second_byte(self, allowed: torch.Tensor, reqs: Sequence[ConstrainedRequest]) -> None:
        """Clear, in ``allowed`` (bool ``[k, vocab]``), tokens that would follow a trailing
        0xe0/0xed/0xf0/0xf4 lead byte with a second byte outside its valid range."""
        if self._after_lead is None:
            vocab = self.grammars.vocab_bytes()
            first = torch.tensor([v[0] if v else -1 for v in vocab])
            ranges = {
                0xE0: (0xA0, 0xBF),
                0xED: (0x80, 0x9F),
                0xF0: (0x90, 0xBF),
                0xF4: (0x80, 0x8F),
            }
            self._after_lead = {
                lead: ((first >= 0x80) & (first <= 0xBF) & ((first < lo) | (first > hi))).to(
                    allowed.device
                )
                for lead, (lo, hi) in ranges.items()
            }
        vocab = self.grammars.vocab_bytes()
        for k, req in enumerate(reqs):
            if req.output_ids:
                last = vocab[req.output_ids[-1]] if req.output_ids[-1] < len(vocab) else b""
                bad = self._after_lead.get(last[-1]) if last else None
                if bad is not None:
                    allowed[k] &= ~bad[: allowed.shape[1]]

    def _unpack(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """xgrammar's int32 bitmask ``[k, ceil(vocab/32)]`` (bit j of word w: token
        32w + j allowed) as bool ``[k, vocab]``, with torch ops on any device."""
        if self._shifts is None or self._shifts.device != bitmask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()

    def advance(self, req: ConstrainedRequest, tok: int, logits: torch.Tensor) -> Advance:
        """Feed ``req``'s newly sampled token ``tok`` to its matcher, then jump forward
        where the grammar allows only one continuation. Writes nothing on ``req`` but
        its matcher: the engine applies the returned :class:`Advance`.

        Args:
            req: a constrained request; ``tok`` is not yet in ``req.output_ids``.
            tok: the token sampled from ``logits``.
            logits: the masked fp32 row ``[vocab]`` it was sampled from.

        Returns:
            The token to append (``tok``, or its re-tokenized replacement), the forced
            tokens after it (never beyond ``max_tokens``), whether ``tok`` is an answer
            token at all (a stop token sampled where the grammar allowed nothing else
            is not: the grammar forced it) and the finish reason: "stop" when the
            grammar has ended (a stop token accepted, a dead end, or, with jump-forward,
            nothing but a stop token left) or when these tokens reach ``max_tokens``
            with the output complete (the matcher in an accepting state:
            ``is_completed``), else None (the engine then says "length" at the limit).
        """
        m = _matcher(req)
        if tok in self.stop_ids and self._only_stop(m):
            return Advance(tok, keep=False, reason="stop")
        if not m.accept_token(tok) or m.is_terminated():
            return Advance(tok, reason="stop")
        room = req.params.max_tokens - len(req.output_ids) - 1  # left after ``tok``
        adv = Advance(tok)
        if self.jump_forward and room > 0:
            try:
                jump = m.find_jump_forward_string()
            except UnicodeDecodeError:  # forced bytes end inside a UTF-8 character: no jump
                jump = ""
            if jump:
                adv = self._jump(req, tok, jump, room)
                room -= len(adv.forced)
        if m.is_completed():
            if room <= 0:
                # the last allowed token ends a complete output: the grammar's end, not
                # the budget, ends it (even where more, such as digits, was allowed)
                adv.reason = "stop"
            elif self.jump_forward and self._only_stop(m):
                adv.reason = "stop"  # only end-of-sequence may follow: not appended
        return adv

    def _jump(self, req: ConstrainedRequest, sampled: int, jump: str, room: int) -> Advance:
        """Tokens for the forced string ``jump`` after ``sampled``: re-tokenizing the
        sampled token's text with it where that decodes to the same text, else ``jump``
        alone; the first candidate the matcher accepts wins.

        Only the last :data:`JUMP_CONTEXT` output ids are decoded (the check compares
        the text a window gives before and after the change, so its cost does not grow
        with the answer)."""
        out = [*req.output_ids[-JUMP_CONTEXT:], sampled]
        tok = self.model.tokenizer
        m = _matcher(req)

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        full = decode(out)
        prev = decode(out[:-1])
        candidates: list[tuple[int, list[int]]] = []
        tail = full[len(prev) :]
        if full.startswith(prev) and tail and "\ufffd" not in tail:
            ids = encode(tail + jump)
            if ids and decode(out[:-1] + ids) == full + jump:
                candidates.append((1, ids))  # re-tokenized: replaces the sampled token
        ids = encode(jump)
        if ids and decode(out + ids) == full + jump:
            candidates.append((0, ids))  # the jump string alone, after the sampled token
        for drop, ids in candidates:
            ids = ids[: room + drop]
            if drop and ids == [sampled]:
                continue  # nothing new
            if not _accept_all(m, sampled, drop, ids):
                continue
            s = self.stats
            s.jumps += 1
            s.jumped_tokens += len(ids) - drop
            s.retokenized += bool(drop and ids[0] != sampled)
            if drop:
                return Advance(ids[0], forced=ids[1:])
            return Advance(sampled, forced=ids)
        return Advance(sampled)

    def _only_stop(self, m: Any) -> bool:
        """Whether the matcher allows nothing but stop tokens next."""
        xgr = load_xgrammar()
        vocab = self.model.decoder.shape.vocab_size
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(bitmask, 0)
        allowed = self._unpack(bitmask, vocab)[0]
        allowed[self.stop_ids] = False
        return not bool(allowed.any())


def _accept_all(m: Any, last: int, drop: int, ids: list[int]) -> bool:
    """Feed ``ids`` to ``m`` after rolling back ``drop`` (0 or 1) tokens; all or nothing."""
    if drop:
        m.rollback(1)
    for k, t in enumerate(ids):
        if not m.accept_token(t):
            if k:
                m.rollback(k)
            if drop:
                m.accept_token(last)
            return False
    return True
