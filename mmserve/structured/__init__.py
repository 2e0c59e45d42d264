"""Structured output: grammar-constrained decoding with xgrammar, and jump-forward decoding.

A request may carry a :class:`GuidedSpec` (a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar). The front end
(:class:`~mmserve.frontend.processor.InputProcessor`) checks it, compiles it once per
distinct spec into xgrammar's token-level automaton (a bounded LRU,
:class:`GrammarCache`, on the caller's thread) and gives the request its own
``GrammarMatcher``. On the engine thread, :class:`GuidedDecoding` fills every
constrained row's token bitmask for the whole batch, applies them to the logits
before sampling, advances each matcher with the sampled token, and runs
jump-forward decoding (SGLang, Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", arXiv 2312.07104, Section 4, "compressed
finite state machine"): where the grammar admits exactly one continuation string
(``GrammarMatcher.find_jump_forward_string``), its tokens are appended at once and
computed in one extend step instead of one decode step per token.

Re-tokenization at the boundary (the paper's fix for the token-boundary problem):
the token just sampled has no K/V yet, so its text and the jump string are
tokenized together and replace it (``{`` + ``"name": "`` may become ``{"``,
``name``, ...), as the tokenizer would have produced them; the K/V already computed
never changes. A candidate is used only if it decodes to exactly the old text plus
the jump string and the matcher accepts every token; otherwise the jump string is
tokenized alone after the sampled token, and if that fails too the request decodes
token by token.

Logprobs are taken after the grammar mask: the distribution the token was drawn
from (the model's unscaled distribution restricted to what the grammar allows,
renormalized). A re-tokenized boundary token reports its logprob from the same
masked row; the other jumped tokens were not sampled and report ``0.0``
(probability 1: the grammar allowed nothing else), with themselves as the only
alternative.

An end-of-sequence token the grammar forces (the grammar has ended, or reached a dead
end, and allows nothing else) is not part of the answer: it is never appended, or,
decoding token by token, it is removed again once sampled, and the request ends with
"stop". One the model chose while the grammar allowed more stays, like any token.
An output the grammar accepts (``is_completed``) on the last token ``max_tokens``
allows also ends with "stop", not "length": it is complete, even where the grammar
would have allowed more.

xgrammar is imported lazily, so an engine serving no constrained request never
loads it. It is installed with ``pip install --no-deps`` (its Linux package
declares triton, which it does not need on the CPU; see the README).

The package has three layers, each importing only those before it:

- :mod:`mmserve.structured.spec`: :class:`GuidedSpec`, :class:`GrammarError` and the
  checks made before a request is queued (JSON-schema keywords, sizes, xgrammar's
  parser); no torch, no tokenizer, so the HTTP layer uses it directly.
- :mod:`mmserve.structured.compile`: :class:`GrammarCache` (compiling against the
  model's vocabulary on request threads, a bounded LRU) and each request's
  :class:`GrammarState`.
- :mod:`mmserve.structured.decode`: :class:`GuidedDecoding` on the engine thread
  (masks, matcher advances, jump-forward; the :class:`Advance` it returns).
"""
