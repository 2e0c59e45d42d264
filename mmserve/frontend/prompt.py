"""Turn chat messages or raw text plus images into token ids with image pseudo-tokens.

The tokenizer sees the text with one ``<image>`` placeholder per image, exactly
as transformers' ``LlavaProcessor`` would before it repeats the placeholder, and
each placeholder is then replaced by the image's N pseudo-token ids
(:mod:`mmserve.vision.hashing`). Text around a placeholder tokenizes the same
either way because the placeholder is a special token. The family chooses how each
image is processed given how many images the prompt holds
(:meth:`~mmserve.model.families.base.ModelFamily.image_mode`). On a family with a
video path each ``<video>`` placeholder becomes its frames' runs, each frame keyed by
its own pixels, then the video newline (:data:`~mmserve.vision.hashing.VIDEO_NEWLINE_ID`)
where the family has one (OneVision; not LLaVA-NeXT-Video).

Message texts are plain text: a typed special-token string (``</s>``, ``<s>``,
``<pad>``, ...) becomes the ids of its characters, so a user cannot end their own
turn and forge a conversation; only the chat template's own structure produces
special ids. This is the one documented difference from transformers, which reads
a typed ``</s>`` as the real token. A chat whose texts hold no special-token string
is tokenized as one string, exactly as transformers does.

A chat may end with an assistant message (:class:`ChatTemplateOptions`, vLLM's
``add_generation_prompt`` and ``continue_final_message``): continued, its text is the
start of the answer (the rendering is cut where its text ends, before the template's
end of turn, as transformers' ``apply_chat_template(..., continue_final_message=True)``);
otherwise it is a closed turn and the template must open a new assistant turn after it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from mmserve.model.families.base import FRAME_MODE
from mmserve.model.loader import LoadedModel
from mmserve.vision.hashing import VIDEO_NEWLINE_ID, PseudoIdCache
from mmserve.vision.inputs import ImageInput, ImageSpan


class PromptError(ValueError):
    """A prompt that cannot be built; the message says why (HTTP 400)."""


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How the chat template ends a prompt (vLLM's chat-completion fields of these names).

    Attributes:
        add_generation_prompt: open a new assistant turn after the last message.
        continue_final_message: the last message is an assistant message whose text is
            the start of the answer: no end of turn after it (needs
            ``add_generation_prompt`` false).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self, messages: Sequence[dict]) -> None:
        """Refuse options that do not fit ``messages``.

        Raises:
            PromptError: ``continue_final_message`` together with
                ``add_generation_prompt``, or without a final assistant message.
        """
        if not self.continue_final_message:
            return
        if self.add_generation_prompt:
            raise PromptError(
                "continue_final_message needs add_generation_prompt: false (a continued "
                "assistant message gets no new assistant turn after it)"
            )
        last = messages[-1].get("role") if messages else None
        if last != "assistant":
            raise PromptError(
                "continue_final_message continues a final assistant message, but the last "
                f"message's role is {last!r}"
            )


#: The default: a new assistant turn after the last message.
NEW_TURN = ChatTemplateOptions()


class PromptBuilder:
    """Builds ``(input_ids, image_spans)`` for the engine.

    Args:
        model: the loaded checkpoint (tokenizer, placeholder id, tokens per image).
        max_images: most images in one prompt.
    """

    def __init__(self, model: LoadedModel, max_images: int = 8) -> None:
        self.tokenizer = model.tokenizer
        self.image_token_id = model.image_token_id
        self.image_token = self.tokenizer.convert_ids_to_tokens(model.image_token_id)
        self.video_token_id = model.video_token_id
        self.placeholders = [self.image_token]
        if model.video_token_id is not None:
            self.placeholders.append(self.tokenizer.convert_ids_to_tokens(model.video_token_id))
        self.model = model
        self.max_images = max_images
        self.pseudo_ids = PseudoIdCache()
        self.max_context = model.decoder.shape.max_position_embeddings
        # No token spells more characters than the longest vocabulary entry, so a text
        # longer than context * that is too long without tokenizing it (which for
        # megabytes of text costs seconds and gigabytes).
        self.max_chars = self.max_context * max(len(t) for t in self.tokenizer.get_vocab())
        specials = sorted(
            {str(t) for t in self.tokenizer.all_special_tokens} | set(self.placeholders),
            key=len,
            reverse=True,
        )
        self.special_tokens = [t for t in specials if t]
        self._special_re = re.compile("|".join(re.escape(t) for t in self.special_tokens))
        probe = "a"
        bare = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = self.tokenizer(probe, add_special_tokens=True)["input_ids"]
        at = next(i for i in range(len(full)) if full[i : i + len(bare)] == bare)
        # what the tokenizer's post-processor puts around a whole prompt (BOS for LLaVA)
        self._prefix_ids, self._suffix_ids = full[:at], full[at + len(bare) :]

    def render_chat(self, messages: Sequence[dict], options: ChatTemplateOptions = NEW_TURN) -> str:
        """Render messages with the checkpoint's chat template.

        Each message is ``{"role": ..., "content": str | [parts]}`` with parts
        ``{"type": "text", "text": ...}``, ``{"type": "image"}`` or (a family with a
        video path) ``{"type": "video"}``. ``options`` says how the prompt ends (a new
        assistant turn by default; see :class:`ChatTemplateOptions`).

        A continued final message is rendered with a private-use sentinel after its text
        and the rendering is cut at the sentinel, so nothing the template puts after the
        text (end of turn, end of sequence) remains, and an empty text continues too.

        Raises:
            PromptError: user text containing the literal image (or video) placeholder
                (it would create a slot that has no image); options that do not fit
                the messages (:meth:`ChatTemplateOptions.check`); a template that does
                not render the text of the message to continue, opens no new turn
                after a final assistant message, or raises an error of its own.
        """
        for m in messages:
            for text in _texts(m):
                for token in self.placeholders:
                    if token in text:
                        what = "image" if token == self.image_token else "video"
                        raise PromptError(
                            f"message text contains the reserved {what} placeholder "
                            f"{token!r}; send {what}s as {what}_url content parts"
                        )
        options.check(messages)
        if options.continue_final_message:
            return self._render_continued(messages)
        rendered = self._apply(messages, options.add_generation_prompt)
        if (
            options.add_generation_prompt
            and messages
            and messages[-1].get("role") == "assistant"
            and rendered == self._apply(messages, False)
        ):
            # the model would generate after a closed turn with no role marker
            raise PromptError(
                "this model's chat template opens no new assistant turn after a final "
                "assistant message: end the messages with a user message, or continue the "
                "assistant message (continue_final_message: true, add_generation_prompt: "
                "false)"
            )
        return rendered

    def renders_media_after_text(self) -> bool:
        """Whether the chat template renders a user message's parts in order, so that an
        image given after text stays after it (a probe ``[text, image]`` rendered).

        Such a template makes part order matter to the prefix cache: two questions put
        before the same picture share only the prompt up to the first question, while a
        template that renders media first (as the released llava-hf ones do) puts the
        picture before either question. False when the probe cannot be rendered.
        """
        probe = "\ue000probe\ue000"
        content = [{"type": "text", "text": probe}, {"type": "image"}]
        try:
            rendered = self._apply([{"role": "user", "content": content}], True)
        except PromptError:
            return False
        text, image = rendered.find(probe), rendered.find(self.image_token)
        return 0 <= text < image

    def _apply(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's rendering; its own refusals (``raise_exception``, a role it does
        not know) become :class:`PromptError`."""
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as e:
            raise PromptError(f"the model's chat template refused these messages: {e}") from None

    def _render_continued(self, messages: Sequence[dict]) -> str:
        """The rendering of ``messages`` up to the end of the last message's text."""
        joined = "".join(_texts_all(messages))
        # a character no text holds (masked special strings use another private-use one)
        sentinel = _unused_char(joined, reversed(range(0xE001, 0xF900)))
        last = dict(messages[-1])
        content = last.get("content")
        if content is None or isinstance(content, str):
            last["content"] = (content or "") + sentinel
        else:
            parts = list(content)
            at = max((i for i, p in enumerate(parts) if p.get("type") == "text"), default=None)
            if at is None:
                parts.append({"type": "text", "text": sentinel})
            else:
                parts[at] = {**parts[at], "text": (parts[at].get("text") or "") + sentinel}
            last["content"] = parts
        rendered = self._apply([*messages[:-1], last], False)
        cut = rendered.rfind(sentinel)
        if cut < 0:
            raise PromptError(
                "this model's chat template does not render the final assistant message's "
                "text, so it cannot be continued"
            )
        return rendered[:cut]

    def from_messages(
        self,
        messages: Sequence[dict],
        images: Sequence[ImageInput],
        videos: Sequence[Sequence[ImageInput]] = (),
        options: ChatTemplateOptions = NEW_TURN,
        details: Sequence[str] = (),
    ) -> tuple[list[int], list[ImageSpan]]:
        """Token ids for a chat; ``images`` fill the image parts and ``videos`` (each a
        list of frames) the video parts, in order; ``options`` as :meth:`render_chat`,
        ``details`` as in :meth:`from_text`.

        Message texts are encoded as plain text (see the module docstring).

        Raises:
            PromptError: as :meth:`render_chat` and :meth:`from_text`.
        """
        texts = _texts_all(messages)
        if any(p in t for t in texts for p in self.placeholders):
            self.render_chat(messages, options)  # raises the placeholder error
        if not any(self._special_re.search(t) for t in texts):
            return self.from_text(self.render_chat(messages, options), images, videos, details)
        rendered, typed, mark = self._mask_specials(messages, options)
        self._check_text(rendered)
        ids = self.encode_plain_texts(rendered, typed, mark)
        return self._expand(ids, images, videos, details)

    def _mask_specials(
        self, messages: Sequence[dict], options: ChatTemplateOptions = NEW_TURN
    ) -> tuple[str, list[str], str]:
        """Render with every typed special string replaced by a private-use marker.

        Returns:
            ``(rendered, typed, mark)``: ``mark + str(k) + mark`` stands for ``typed[k]``.
        """
        joined = "".join(_texts_all(messages))
        mark = _unused_char(joined, range(0xE000, 0xF8FF))
        typed: list[str] = []

        def sub(match: re.Match) -> str:
            typed.append(match.group(0))
            return f"{mark}{len(typed) - 1}{mark}"

        def mask(text: str) -> str:
            return self._special_re.sub(sub, text)

        masked = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                content = mask(content)
            elif content is not None:
                content = [
                    {**p, "text": mask(p.get("text") or "")} if p.get("type") == "text" else p
                    for p in content
                ]
            masked.append({**m, "content": content})
        return self.render_chat(masked, options), typed, mark

    def encode_plain_texts(
        self, rendered: str, typed: Sequence[str] = (), mark: str = ""
    ) -> list[int]:
        """Token ids of ``rendered`` where only its own special-token strings are special.

        The string is cut at each special-token string (where the tokenizer cuts it
        anyway, so merges match one-string tokenization); the pieces between are
        tokenized with special tokens split into characters, after each private-use
        marker ``<mark>k<mark>`` is put back as ``typed[k]``.

        Args:
            rendered: the rendered chat, typed special strings masked.
            typed: the special strings the markers stand for.
            mark: the marker character ("" when nothing is masked).

        Returns:
            ids including what the tokenizer adds around a prompt (BOS).
        """
        ids = list(self._prefix_ids)
        pos = 0
        pieces: list[tuple[str, bool]] = []
        for m in self._special_re.finditer(rendered):
            pieces += [(rendered[pos : m.start()], False), (m.group(0), True)]
            pos = m.end()
        pieces.append((rendered[pos:], False))
        for text, special in pieces:
            if special:
                ids.append(self.tokenizer.convert_tokens_to_ids(text))
                continue
            if mark and typed:
                text = re.sub(
                    f"{re.escape(mark)}(\\d+){re.escape(mark)}",
                    lambda g: typed[int(g.group(1))],
                    text,
                )
            if text:
                ids += self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)[
                    "input_ids"
                ]
        return ids + list(self._suffix_ids)

    def from_text(
        self,
        text: str,
        images: Sequence[ImageInput],
        videos: Sequence[Sequence[ImageInput]] = (),
        details: Sequence[str] = (),
    ) -> tuple[list[int], list[ImageSpan]]:
        """Token ids for raw text whose ``<image>`` placeholders take ``images`` and whose
        ``<video>`` placeholders take ``videos`` (lists of frames), in order.

        ``details`` (empty: all "auto") gives each image's OpenAI ``detail``, which picks
        its view (:meth:`~mmserve.model.families.base.ModelFamily.detail_mode`).

        Returns:
            ``(input_ids, spans)``: ids with each placeholder expanded to the image's
            pseudo-token ids (a video: each frame's, then the video newline), and where
            each image or frame sits.

        Raises:
            PromptError: placeholder count differs from the number of images or videos,
                videos for a model without a video path, a video without frames, too
                many images, text that is not valid Unicode (an unpaired surrogate) or
                far longer than the context, ``details`` not one per image.
        """
        self._check_text(text)
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return self._expand(ids, images, videos, details)

    def _check_text(self, text: str) -> None:
        """Refuse text far longer than the context (before tokenizing) or not valid Unicode."""
        if len(text) > self.max_chars:
            raise PromptError(
                f"prompt text is {len(text)} characters, more than the model's context of "
                f"{self.max_context} tokens can hold"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptError(
                f"prompt text is not valid Unicode: {e.reason} at {e.start}"
            ) from None

    def _expand(
        self,
        ids: list[int],
        images: Sequence[ImageInput],
        videos: Sequence[Sequence[ImageInput]] = (),
        details: Sequence[str] = (),
    ) -> tuple[list[int], list[ImageSpan]]:
        """Replace each image placeholder id in ``ids`` by its image's pseudo-token ids (in
        the mode its ``detail`` gives it in a prompt of this many images) and each video
        placeholder by its frames' ids then the video newline."""
        if len(images) > self.max_images:
            raise PromptError(
                f"{len(images)} images in one request; the limit is {self.max_images}"
            )
        if videos and self.video_token_id is None:
            raise PromptError("this model has no video input; send a video's frames as images")
        media = (self.image_token_id, self.video_token_id)
        slots = [i for i, t in enumerate(ids) if t in media]
        n_images = sum(ids[i] == self.image_token_id for i in slots)
        if n_images != len(images):
            raise PromptError(
                f"prompt has {n_images} image placeholders but {len(images)} images were given"
            )
        if len(slots) - n_images != len(videos):
            raise PromptError(
                f"prompt has {len(slots) - n_images} video placeholders but {len(videos)} "
                "videos were given"
            )
        if details and len(details) != len(images):
            raise PromptError(f"{len(details)} details given for {len(images)} images")
        family = self.model.family
        modes = iter(
            family.detail_mode(d, len(images)) for d in (details or ["auto"] * len(images))
        )
        next_image, next_video = iter(images), iter(videos)
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0

        def add(image: ImageInput, mode: str) -> None:
            item = family.mode_item(image, mode)
            n = self.model.image_tokens(image.width, image.height, mode)
            modality = "video" if image.video or mode == FRAME_MODE else "image"
            spans.append(ImageSpan(len(out), n, item, modality))
            out.extend(self.pseudo_ids.get(item.key, n))

        for slot in slots:
            out.extend(ids[prev:slot])
            if ids[slot] == self.image_token_id:
                add(next(next_image), next(modes))
            else:
                frames = next(next_video)
                if not frames:
                    raise PromptError("a video has no frames")
                for frame in frames:
                    add(frame, FRAME_MODE)
                if family.video_newline:
                    out.append(VIDEO_NEWLINE_ID)
            prev = slot + 1
        out.extend(ids[prev:])
        return out, spans


def _texts(message: dict) -> list[str]:
    """The text of one message: its string content or its text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    return [p.get("text") or "" for p in content or [] if p.get("type") == "text"]


def _texts_all(messages: Sequence[dict]) -> list[str]:
    return [t for m in messages for t in _texts(m)]


def _unused_char(text: str, codes: Iterable[int]) -> str:
    """The first character of ``codes`` (private-use code points) that ``text`` lacks.

    Raises:
        PromptError: ``text`` holds every one of them (a crafted message).
    """
    present = set(text)
    for c in map(chr, codes):
        if c not in present:
            return c
    raise PromptError("the messages use every private-use character; remove some")
