"""The front end: from an API-level request to a tokenized request message.

Image decoding, hashing and preprocessing (the checkpoint's transformers image
processor), the chat template, tokenization and every limit check happen here, on
the caller's thread (HTTP workers), never on the engine thread. The engine only
accepts the :class:`~mmserve.types.EngineRequest` messages this builds:
token ids, image spans whose items carry their content key and either the tower's
input (``pixels``) or, where the embedding cache already held them, a reference to
their features; and the sampling parameters.

Images are handled one at a time (decode, hash, preprocess, drop the decoded image),
so a request holds about one decoded image at once; the decoded bytes all requests
hold together are bounded by a :class:`~mmserve.vision.budget.DecodeBudget`, the
pixels of one request by :class:`~mmserve.vision.budget.RequestPixels`. Work for a
request whose client left stops between these steps (:func:`mmserve.cancel.check_cancelled`
raises :class:`~mmserve.cancel.Cancelled`), its budget released.

Why a request keeps pixels (or features) until it finishes rather than only until
the tower ran: the embedding cache may evict an image's features between the front
end's look-up and the engine's, or before a retracted request computes its image
positions again; the request then still has what the tower needs, and the engine
never needs a decoded image.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mmserve.cache.salt import salted_image_key
from mmserve.cancel import check_cancelled
from mmserve.config import EngineConfig
from mmserve.frontend.prompt import NEW_TURN, ChatTemplateOptions, PromptBuilder, PromptError
from mmserve.model.families.base import FRAME_MODE
from mmserve.model.loader import LoadedModel
from mmserve.structured.compile import GrammarCache
from mmserve.structured.spec import GrammarError
from mmserve.types import EngineRequest, ParamError, SamplingParams, new_rid
from mmserve.vision.budget import DecodeBudget, RequestPixels, decoded_bytes
from mmserve.vision.embedding_cache import EmbeddingCache, FeatureKeys
from mmserve.vision.hashing import image_key, processor_fingerprint
from mmserve.vision.image import ImageError, decode_image
from mmserve.vision.inputs import Frame, ImageInput, ImageSpan
from mmserve.vision.video import (
    FrameCost,
    FrameFailure,
    FrameSelection,
    Video,
    VideoError,
    VideoLimits,
    undecodable_message,
)

if TYPE_CHECKING:
    from PIL import Image

    from mmserve.vision.pixels import Pixels


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
        embedding_cache: the engine's cache of image features, only peeked at; or its
            keys (:class:`FeatureKeys`: an engine process, sent such images by key);
            None: a front end without an engine, which always prepares pixels.
        grammars: the engine's compiled-grammar cache, filled here (None: a new one).

    Attributes:
        decode_budget: decoded image bytes all callers hold at once
            (``config.max_decoded_image_bytes``).
    """

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        kv_capacity_tokens: int,
        embedding_cache: EmbeddingCache | FeatureKeys | None = None,
        grammars: GrammarCache | None = None,
    ) -> None:
        self.model = model
        self.embedding_cache = embedding_cache
        self.decode_budget = DecodeBudget(
            config.max_decoded_image_bytes, config.decoded_image_wait_seconds
        )
        self.config = config
        self.max_context = model.decoder.shape.max_position_embeddings
        self.kv_capacity_tokens = kv_capacity_tokens
        self.prompts = PromptBuilder(model, config.max_images_per_request)
        self.fingerprint = processor_fingerprint(model.processor.image_processor)
        self.shortest_edge = shortest_edge(model.processor.image_processor)
        #: compiled structured-output grammars (built here, off the engine thread)
        self.grammars = grammars if grammars is not None else GrammarCache(model)
        #: ids a client may name (``logit_bias``): the tokenizer's, padding rows excluded
        self.vocab_size = len(model.tokenizer)

    def request_pixels(self) -> RequestPixels:
        """A fresh per-request pixel count (``config.max_request_image_pixels``)."""
        return RequestPixels(self.config.max_request_image_pixels)

    def image_mode(self, num_images: int, detail: str = "auto") -> str:
        """The mode an image sent with ``detail`` in a prompt with ``num_images`` images
        (videos not counted) is prepared in (see
        :meth:`~mmserve.model.families.base.ModelFamily.detail_mode`).

        Raises:
            ValueError: for a ``detail`` other than "auto", "low" and "high".
        """
        return self.model.family.detail_mode(detail, num_images)

    def prepare_image(
        self,
        data: bytes,
        mode: str | None = None,
        pixels: RequestPixels | None = None,
        known: ImageInput | None = None,
    ) -> ImageInput:
        """Decode, hash and (given ``mode``) preprocess an encoded image.

        With ``mode`` (the front end's path) the result holds the image's key, size, the
        encoded ``source`` and, unless the embedding cache already holds the features of
        the image in that mode, its tower input (``pixels``); the decoded image is
        dropped before returning, so the caller never holds it. Without ``mode`` the
        decoded image is kept (``image``) and preprocessing is left to
        :meth:`make_request`.

        Args:
            data: the encoded file.
            mode: the mode to prepare the image in (:meth:`image_mode`), or None.
            pixels: the request's pixel count, charged with this image before decoding.
            known: the same bytes' image from a store (key and size known): it is
                charged, and decoded again only when its tower input is needed.

        Raises:
            ImageError: for empty, corrupt, over-size or degenerate images, or
                (``PixelBudgetError``) beyond the request's pixel budget.
            DecodeBusyError: the server-wide decoded-image budget stayed full.
            Cancelled: the current :class:`~mmserve.cancel.CancelToken` was cancelled
                (checked before decoding and after; the budget is released).
        """
        if known is not None:
            if pixels is not None:
                pixels.charge(known.width, known.height)
            base = dataclasses.replace(known, image=None, pixels=None, features=None, source=data)
            if mode is None or self._cached(base, mode):
                return base
            return self._decoded(data, None, lambda im: self._prepared(base, im, mode))

        def use(im: Image.Image) -> ImageInput:
            item = ImageInput(image_key(im, self.fingerprint), im, source=data)
            if mode is None:
                return item
            return self._prepared(item, im, mode)

        return self._decoded(data, pixels, use)

    def _cached(self, item: ImageInput, mode: str) -> bool:
        """Whether the engine holds the features of ``item`` in ``mode``."""
        cache = self.embedding_cache
        if cache is None:
            return False
        key = self.model.family.mode_item(item, mode).key
        return key in cache if isinstance(cache, FeatureKeys) else cache.peek(key) is not None

    def _prepared(self, item: ImageInput, im: Image.Image, mode: str) -> ImageInput:
        """``item`` without its decoded image, with its tower input in ``mode`` unless
        the embedding cache holds its features."""
        ready = None if self._cached(item, mode) else self._preprocess(im, mode)
        return dataclasses.replace(item, image=None, pixels=ready, features=None)

    def _preprocess(self, im: Image.Image, mode: str) -> Pixels:
        return self.model.family.preprocess([im], mode)[0]

    def _decoded(
        self, data: bytes, pixels: RequestPixels | None, use: Callable[[Image.Image], ImageInput]
    ) -> ImageInput:
        """``use(decoded image)`` with the decoded bytes held in the server-wide budget
        (and charged to ``pixels``) from the header check until ``use`` returns."""
        held = 0

        def before(im) -> None:
            nonlocal held
            check_cancelled()  # the client left: no decode
            if pixels is not None:
                pixels.charge(im.width, im.height)
            n = decoded_bytes(im.width, im.height, im.mode)
            self.decode_budget.acquire(n)
            held = n

        try:
            im = decode_image(data, self.config.image_limits, self.shortest_edge, before)
            check_cancelled()  # decoded; no hash or preprocessing for a client gone
            out = use(im)
            del im  # gone before the release, which may hand the heap back to the system
            return out
        finally:
            if held:
                self.decode_budget.release(held)

    def prepare_frames(self, items: Sequence[ImageInput], mode: str) -> list[ImageInput]:
        """Video frames (decoded and hashed, ``image`` set) with their tower input in
        ``mode``, their decoded images dropped (the caller's list keeps them until it
        lets go). A frame has no encoded source to decode again, so its pixels are made
        even when its features are cached now (they may be evicted before the request
        is built)."""
        out: list[ImageInput] = []
        done: dict[bytes, ImageInput] = {}
        for it in items:
            check_cancelled()  # between frames
            if it.key not in done:
                assert it.image is not None  # frames come decoded (see above)
                pixels = self._preprocess(it.image, mode)
                done[it.key] = dataclasses.replace(it, image=None, pixels=pixels, features=None)
            out.append(done[it.key])
        return out

    def frame_cost(self, width: int, height: int, mode: str | None = None) -> FrameCost:
        """Pseudo-tokens a video's frames of ``width`` x ``height`` pixels take in ``mode``:
        on the video path (:data:`~mmserve.model.families.base.FRAME_MODE`) each frame's run
        plus one video newline per video where the family has one (OneVision); elsewhere
        each frame's count as an image in ``mode`` (None: the video path where the model
        has one, else a frame alone in its prompt). Text around the frames (``Frame at
        1.5s:`` labels) is not counted."""
        video_path = self.model.video_token_id is not None
        if mode is None:
            mode = FRAME_MODE if video_path else self.image_mode(1)
        per_video = int(mode == FRAME_MODE and self.model.family.video_newline)
        return FrameCost(self.model.image_tokens(width, height, mode), per_video)

    def open_video(self, data: bytes, limits: VideoLimits) -> Video:
        """Open and probe an encoded video against ``limits`` and the image limits (its
        frames are images of this model).

        Raises:
            VideoError: naming the problem.
        """
        return Video(data, limits, self.config.image_limits, self.shortest_edge)

    def sample_frames(
        self,
        video: Video,
        selection: FrameSelection,
        mode: str | None = None,
        pixels: RequestPixels | None = None,
        skip: bool = False,
    ) -> tuple[list[Frame], list[FrameFailure]]:
        """Decode the selected frames and hash each as an image (equal pixels: one key);
        given ``mode``, prepare each one's tower input and drop its decoded image
        (:meth:`prepare_frames`).

        The frames' decoded bytes are held in the server-wide :attr:`decode_budget` from
        before decoding until they are prepared (or returned); every selected frame is
        charged to ``pixels``.

        Args:
            skip: leave out selected frames that do not decode (returned as failures)
                rather than refuse the video.

        Returns:
            ``(frames, skipped)``: frames in selection order, and each undecodable frame
            once, ascending by index (empty unless ``skip``).

        Raises:
            VideoError: a bad selection; a selected frame that does not decode (unless
                ``skip``), or none that does (the message names each such frame).
            PixelBudgetError, ImageError: past the request's pixel budget, or frames
                larger than the whole server budget.
            DecodeBusyError: the server-wide budget stayed full.
            Cancelled: the current :class:`~mmserve.cancel.CancelToken` was cancelled
                (checked before decoding and between frames; the budget is released).
        """
        w, h = video.info.width, video.info.height
        indices = video.indices(selection, self.frame_cost(w, h, mode))
        if pixels is not None:
            for _ in indices:
                pixels.charge(w, h, "video frame")
        held = len(set(indices)) * decoded_bytes(w, h, "RGB")
        check_cancelled()
        self.decode_budget.acquire(held)
        try:
            got = video.decode(indices)
            check_cancelled()
            items: dict[int, ImageInput] = {}
            for i in dict.fromkeys(indices):
                im = got.images.get(i)
                if im is not None:
                    items[i] = ImageInput(image_key(im, self.fingerprint), im, video=True)
            if mode is not None:  # the tower input made here, the decoded frames dropped
                items = dict(
                    zip(items, self.prepare_frames(list(items.values()), mode), strict=True)
                )
            frames = [Frame(i, video.info.frame_times[i], items[i]) for i in indices if i in items]
            failed = list(got.failed)
            del got
        finally:
            self.decode_budget.release(held)
        if failed and (not skip or not frames):
            decoded = len({f.index for f in frames})
            raise VideoError(undecodable_message(failed, len(failed) + decoded))
        return frames, failed

    def _finish_spans(self, spans: Sequence[ImageSpan], by_key: bool = True) -> list[ImageSpan]:
        """Each span's item as the engine gets it: features from the embedding cache (a
        reference), else its tower input for its mode (made here when the item's pixels
        are missing or for another mode, from its decoded image or by decoding its source
        again); never a decoded image, nor the encoded source but for an item the engine
        process holds (:class:`FeatureKeys`: by key, kept for :meth:`with_pixels`).

        Raises:
            RequestError: an item that has none of these (a frame prepared for another
                mode: a bug in the caller).
        """
        done: dict[bytes, ImageInput] = {}
        out = []
        for span in spans:
            item = span.image
            if item.key not in done:
                check_cancelled()  # between images
                done[item.key] = self._finish_item(item, by_key)
            out.append(dataclasses.replace(span, image=done[item.key]))
        return out

    def _finish_item(self, item: ImageInput, by_key: bool = True) -> ImageInput:
        cache, has_pixels = self.embedding_cache, item.has_pixels
        if isinstance(cache, FeatureKeys):
            if by_key and item.key in cache and (has_pixels or item.source is not None):
                # the engine holds its features: it goes by key; what remakes its pixels
                # stays here (never a decoded image) in case the engine dropped them since
                return dataclasses.replace(item, features=None, image=None)
        elif cache is not None and (feats := cache.peek(item.key)) is not None:
            return dataclasses.replace(item, pixels=None, features=feats, image=None, source=None)
        if has_pixels:
            return dataclasses.replace(item, features=None, image=None, source=None)
        ready: Pixels | None
        if item.image is not None:
            ready = self._preprocess(item.image, item.mode)
        elif item.source is not None:

            def use(im: Image.Image) -> ImageInput:
                return dataclasses.replace(item, pixels=self._preprocess(im, item.mode))

            try:
                ready = self._decoded(item.source, None, use).pixels
            except ImageError as e:  # decoded before; limits changed since
                raise RequestError(f"an image can no longer be decoded: {e}", "messages") from None
        else:
            raise RequestError(
                f"an image (key {item.key.hex()}) was prepared for another mode and has no "
                f"decoded image or source to prepare it as {item.mode!r}",
                param="messages",
            )
        return dataclasses.replace(item, pixels=ready, features=None, image=None, source=None)

    def with_pixels(self, req: EngineRequest) -> EngineRequest:
        """``req`` with every image's tower input, made again where it went by key to an
        engine process that no longer holds its features (RequestError, Cancelled)."""
        return dataclasses.replace(req, spans=tuple(self._finish_spans(req.spans, False)))

    def make_request(
        self,
        *,
        messages: Sequence[dict] | None = None,
        prompt: str | None = None,
        images: Sequence[ImageInput] = (),
        params: SamplingParams | None = None,
        rid: str | None = None,
        videos: Sequence[Sequence[ImageInput]] = (),
        template: ChatTemplateOptions = NEW_TURN,
        details: Sequence[str] = (),
        default_max_tokens: int | None = None,
        cache_salt: str = "",
    ) -> EngineRequest:
        """Build a validated, tokenized request message from chat ``messages`` or a raw
        ``prompt``.

        ``cache_salt`` (the effective salt, :func:`mmserve.cache.salt.combine`) re-keys
        every image and frame (:func:`~mmserve.cache.salt.salted_image_key`) before its
        pseudo-ids are derived and rides on the request, so that the engine keys its
        prefix caches in the salt's namespace: nothing cached under another salt is used.

        With ``default_max_tokens`` set, ``params.max_tokens == 0`` means "not given": the
        request gets :meth:`default_max_tokens` of the tokenized prompt (checked first
        as if one output token were asked for, so a prompt too long is blamed on the
        prompt). Without it, ``max_tokens`` must be given (>= 1).

        ``images`` fill the image placeholders and ``videos`` (each its frames, decoded
        and hashed like images) the video placeholders of a model with a video path.
        ``template`` says how the chat template ends the prompt (a continued final
        assistant message also sets the request's ``text_context``); ``details`` (empty:
        all "auto") is each image's OpenAI ``detail`` ("low": the family's single base
        view, its own key).

        A constrained request (``params.guided``) carries its compiled grammar, compiled
        here once per distinct spec (:class:`GrammarCache`); the engine makes the
        request's matcher.

        Raises:
            RequestError: bad sampling parameters, placeholder/image mismatch, a
                prompt plus ``max_tokens`` beyond the context or the KV pool, or a
                structured-output spec that is refused or does not compile, or
                (``max_tokens`` not given) ``min_tokens`` beyond the room the prompt
                leaves.
            Cancelled: the current :class:`~mmserve.cancel.CancelToken` was cancelled
                (checked before and after templating and tokenizing, and between images).
        """
        check_cancelled()
        if cache_salt:
            images = [_salted(im, cache_salt) for im in images]
            videos = [[_salted(f, cache_salt) for f in v] for v in videos]
        params = params or SamplingParams()
        default = None if params.max_tokens else default_max_tokens  # None: given (or required)
        try:  # not given: checked as one token, min_tokens once the prompt's length is known
            checked = params
            if default is not None:
                checked = dataclasses.replace(params, max_tokens=1, min_tokens=0)
            checked.validate(vocab_size=self.vocab_size)
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        try:
            if (messages is None) == (prompt is None):
                raise RequestError("give exactly one of messages or prompt")
            if messages is not None:
                ids, spans = self.prompts.from_messages(
                    messages, list(images), list(videos), template, details
                )
            else:
                assert prompt is not None  # exactly one of messages and prompt, checked above
                ids, spans = self.prompts.from_text(prompt, list(images), list(videos), details)
        except RequestError:
            raise
        except (PromptError, ValueError) as e:
            raise RequestError(str(e), param="messages") from None
        check_cancelled()  # templated and tokenized
        counts = [s.length for s in spans]
        limit = self.config.max_image_tokens_per_request
        if sum(counts) > limit:
            raise RequestError(
                f"the images need {_image_tokens(counts)}, more than the limit of {limit} "
                "image tokens per request (--max-image-tokens-per-request): send fewer or "
                "smaller images",
                param="messages",
            )
        self.check_length(len(ids), checked.max_tokens, counts)
        total = sum(s.image.width * s.image.height for s in spans)
        if total > self.config.max_request_image_pixels:
            raise RequestError(
                f"the images and video frames have {total} pixels in all, more than the "
                f"{self.config.max_request_image_pixels} decoded pixels a request may have "
                "(--max-request-image-pixels): send fewer or smaller images",
                param="messages",
            )
        spans = self._finish_spans(spans)
        check_cancelled()
        grammar = None
        if params.guided is not None:
            try:
                grammar = self.grammars.compile(params.guided)
            except GrammarError as e:
                raise RequestError(str(e), param=e.param) from None
        if default is not None:
            params = self.default_max_tokens(params, len(ids), default)
        context: tuple[int, ...] = ()
        if messages is not None and template.continue_final_message:
            context = text_tail(ids)
        return EngineRequest(
            tuple(ids),
            tuple(spans),
            params,
            rid=rid or new_rid(),
            grammar=grammar,
            text_context=context,
            cache_salt=cache_salt,
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

    def image_tokens(self, image: ImageInput, detail: str = "auto") -> int:
        """Pseudo-tokens ``image`` becomes for the served model, alone in its prompt and
        sent with ``detail``."""
        return self.model.image_tokens(image.width, image.height, self.image_mode(1, detail))

    def default_max_tokens(
        self, params: SamplingParams, prompt_len: int, default: int
    ) -> SamplingParams:
        """``params`` with the ``max_tokens`` a client left out: up to ``default`` (or
        ``params.min_tokens`` if more), capped at what the context and the KV pool leave
        after a prompt of ``prompt_len`` tokens (at least 1).

        Raises:
            RequestError: ``param`` "min_tokens", when ``min_tokens`` is beyond that room.
        """
        room = self.output_room(prompt_len)
        if params.min_tokens > room:
            raise RequestError(
                f"min_tokens ({params.min_tokens}) is more than the {room} tokens the "
                f"context and the KV pool leave after the {prompt_len}-token prompt",
                param="min_tokens",
            )
        want = max(default, params.min_tokens)
        chosen = dataclasses.replace(params, max_tokens=max(1, min(want, room)))
        try:  # the chosen value with the client's min_tokens
            chosen.validate(vocab_size=self.vocab_size)
        except ParamError as e:
            raise RequestError(str(e), param=e.param) from None
        return chosen

    def output_room(self, prompt_len: int) -> int:
        """Most output tokens a prompt of ``prompt_len`` tokens leaves room for."""
        return min(self.max_context, self.kv_capacity_tokens) - prompt_len


#: Prompt ids an output is decoded after when it continues the prompt's text (vLLM's
#: incremental detokenizer starts this many tokens back too).
TEXT_CONTEXT_IDS = 5


def _salted(item: ImageInput, salt: str) -> ImageInput:
    """``item`` under its salted key (its features, cached under the unsalted key, dropped)."""
    return dataclasses.replace(item, key=salted_image_key(item.key, salt), features=None)


def text_tail(ids: Sequence[int]) -> tuple[int, ...]:
    """The last :data:`TEXT_CONTEXT_IDS` ids of ``ids`` after its last image or video
    position (pseudo-token ids are negative)."""
    tail: list[int] = []
    for t in reversed(ids):
        if t < 0 or len(tail) == TEXT_CONTEXT_IDS:
            break
        tail.append(t)
    return tuple(reversed(tail))


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
