"""The front end: from an API-level request to a tokenized :class:`Request`.

Image decoding and hashing, the chat template, tokenization and every limit
check happen here, on the caller's thread (HTTP workers), never on the engine
thread. The engine only accepts the :class:`Request` objects this builds:
token ids, image spans with their content keys and decoded images (pixels are
preprocessed by the model runner only when the vision tower must run), and the
sampling parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.config import EngineConfig
from mmserve.engine.grammar import GrammarCache, GrammarError
from mmserve.engine.messages import EngineRequest
from mmserve.engine.prompt import PromptBuilder, PromptError
from mmserve.engine.request import ImageInput, ParamError, SamplingParams, new_rid
from mmserve.model.loader import LoadedModel
from mmserve.vision.hashing import image_key, processor_fingerprint
from mmserve.vision.image import decode_image


class RequestError(ValueError):
    """A request the front end refuses; the message says why (HTTP 400).

    Args:
        message: what is wrong, in words for the client.
        param: the request field at fault ("messages", "max_tokens", ...), if known.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputProcessor:
    """Turns messages (or a raw prompt), images and sampling parameters into a Request.

    Thread-safe for concurrent callers: it reads the model's tokenizer and image
    processor settings and touches no engine state.

    Args:
        model: the loaded checkpoint (tokenizer, image processor, tokens per image).
        config: engine settings (image limits, images per request, device).
        kv_capacity_tokens: tokens the KV pool holds; a request must fit in it.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig, kv_capacity_tokens: int) -> None:
        self.model = model
        self.config = config
        self.max_context = model.decoder.shape.max_position_embeddings
        self.kv_capacity_tokens = kv_capacity_tokens
        self.prompts = PromptBuilder(model, config.max_images_per_request)
        self.fingerprint = processor_fingerprint(model.processor.image_processor)
        self.shortest_edge = shortest_edge(model.processor.image_processor)
        #: compiled structured-output grammars (built here, off the engine thread)
        self.grammars = GrammarCache(model)
        #: ids a client may name (``logit_bias``): the tokenizer's, padding rows excluded
        self.vocab_size = len(model.tokenizer)

    def prepare_image(self, data: bytes) -> ImageInput:
        """Decode and hash an encoded image (no preprocessing).

        Raises:
            ImageError: for empty, corrupt, over-size or degenerate images.
        """
        im = decode_image(data, self.config.image_limits, self.shortest_edge)
        return ImageInput(image_key(im, self.fingerprint), im)

    def make_request(
        self,
        *,
        messages: Sequence[dict] | None = None,
        prompt: str | None = None,
        images: Sequence[ImageInput] = (),
        params: SamplingParams | None = None,
        rid: str | None = None,
        videos: Sequence[Sequence[ImageInput]] = (),
    ) -> EngineRequest:
        """Build a validated, tokenized request message from chat ``messages`` or a raw
        ``prompt``.

        ``images`` fill the image placeholders and ``videos`` (each its frames, decoded
        and hashed like images) the video placeholders of a model with a video path.

        A constrained request (``params.guided``) carries its compiled grammar, compiled
        here once per distinct spec (:class:`GrammarCache`); the engine makes the
        request's matcher.

        Raises:
            RequestError: bad sampling parameters, placeholder/image mismatch, a
                prompt plus ``max_tokens`` beyond the context or the KV pool, or a
                structured-output spec that is refused or does not compile.
        """
        params = params or SamplingParams()
        try:
            params.validate(vocab_size=self.vocab_size)
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        try:
            if (messages is None) == (prompt is None):
                raise RequestError("give exactly one of messages or prompt")
            if messages is not None:
                ids, spans = self.prompts.from_messages(messages, list(images), list(videos))
            else:
                ids, spans = self.prompts.from_text(prompt, list(images), list(videos))
        except RequestError:
            raise
        except (PromptError, ValueError) as e:
            raise RequestError(str(e), param="messages") from None
        counts = [s.length for s in spans]
        limit = self.config.max_image_tokens_per_request
        if sum(counts) > limit:
            raise RequestError(
                f"the images need {_image_tokens(counts)}, more than the limit of {limit} "
                "image tokens per request (--max-image-tokens-per-request): send fewer or "
                "smaller images",
                param="messages",
            )
        self.check_length(len(ids), params.max_tokens, counts)
        grammar = None
        if params.guided is not None:
            try:
                grammar = self.grammars.compile(params.guided)
            except GrammarError as e:
                raise RequestError(str(e), param=e.param) from None
        return EngineRequest(
            tuple(ids), tuple(spans), params, rid=rid or new_rid(), grammar=grammar
        )

    def check_length(
        self, prompt_len: int, max_tokens: int, image_tokens: Sequence[int] = ()
    ) -> None:
        """Refuse a prompt that leaves no room for output, or ``max_tokens`` beyond the room.

        A prompt that alone fills the context or the KV pool is blamed on the prompt
        ("messages"), never on ``max_tokens``.

        Args:
            prompt_len: prompt tokens (each image counts its pseudo-tokens).
            max_tokens: most output tokens asked for.
            image_tokens: each image's pseudo-token count (named in the message).

        Raises:
            RequestError: with ``param`` "messages" or "max_tokens".
        """
        detail = f" (the images need {_image_tokens(image_tokens)})" if image_tokens else ""
        for limit, what in (
            (self.max_context, "the model's context"),
            (self.kv_capacity_tokens, "the KV pool"),
        ):
            if prompt_len >= limit:
                raise RequestError(
                    f"prompt is {prompt_len} tokens{detail}; {what} holds {limit} tokens, "
                    f"which leaves no room for output: shorten the messages or send fewer "
                    f"or smaller images",
                    param="messages",
                )
            if prompt_len + max_tokens > limit:
                raise RequestError(
                    f"prompt ({prompt_len} tokens{detail}) plus max_tokens ({max_tokens}) is "
                    f"{prompt_len + max_tokens} tokens; {what} holds {limit} tokens: set "
                    f"max_tokens to at most {limit - prompt_len}",
                    param="max_tokens",
                )

    def image_tokens(self, image: ImageInput) -> int:
        """Pseudo-tokens ``image`` becomes for the served model."""
        return self.model.image_tokens(image.image.width, image.image.height)

    def output_room(self, prompt_len: int) -> int:
        """Most output tokens a prompt of ``prompt_len`` tokens leaves room for."""
        return min(self.max_context, self.kv_capacity_tokens) - prompt_len


def _image_tokens(counts: Sequence[int]) -> str:
    each = ", ".join(str(c) for c in counts)
    return f"{each} tokens" if len(counts) == 1 else f"{each} tokens ({sum(counts)} in all)"


def shortest_edge(image_processor: object) -> int:
    """The processor's resize target for an image's short side (pixels; 336 if unset)."""
    size = getattr(image_processor, "size", None) or {}
    if isinstance(size, dict):
        return int(
            size.get("shortest_edge") or min(size.get("height", 336), size.get("width", 336))
        )
    return int(getattr(size, "shortest_edge", None) or 336)
