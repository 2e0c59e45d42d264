"""The front end: request in, text out.

A client's messages, images and parameters become a tokenized
:class:`~mmserve.types.EngineRequest` on the caller's thread; the engine's
:class:`~mmserve.types.TokenDelta` messages become text, stop strings and a
:class:`~mmserve.types.GenerateResult` on the receiving side. The engine never
imports this package; it consumes only :mod:`mmserve.types`.

- :mod:`~mmserve.frontend.processor`: ``InputProcessor`` (decode, hash and preprocess
  images, chat template, tokenize, limits, the default ``max_tokens``), ``RequestError``.
- :mod:`~mmserve.frontend.prompt`: ``PromptBuilder`` (chat template, placeholders).
- :mod:`~mmserve.frontend.output`: ``OutputCollector``, ``StreamUpdate`` (deltas to text).
- :mod:`~mmserve.frontend.detokenizer`: incremental detokenization, stop strings.
- :mod:`~mmserve.frontend.token_bytes`: each token's text and raw bytes (logprobs).
- :mod:`~mmserve.frontend.frontend`: ``FrontEnd`` (built by the server and the replica
  ingress) and ``Engine`` (the engine core with its front end).
- :mod:`~mmserve.frontend.async_engine`: ``AsyncEngine``, the engine's thread for asyncio.
"""
