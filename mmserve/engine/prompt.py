"""Turn chat messages or raw text plus images into token ids with image pseudo-tokens.

The tokenizer sees the text with one ``<image>`` placeholder per image, exactly
as transformers' ``LlavaProcessor`` would before it repeats the placeholder, and
each placeholder is then replaced by the image's N pseudo-token ids
(:mod:`mmserve.vision.hashing`). Text around a placeholder tokenizes the same
either way because the placeholder is a special token.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.engine.request import ImageInput, ImageSpan
from mmserve.model.loader import LoadedModel
from mmserve.vision.hashing import PseudoIdCache


class PromptError(ValueError):
    """A prompt that cannot be built; the message says why (HTTP 400)."""


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
        self.num_image_tokens = model.num_image_tokens
        self.max_images = max_images
        self.pseudo_ids = PseudoIdCache()
        self.max_context = model.decoder.shape.max_position_embeddings
        # No token spells more characters than the longest vocabulary entry, so a text
        # longer than context * that is too long without tokenizing it (which for
        # megabytes of text costs seconds and gigabytes).
        self.max_chars = self.max_context * max(len(t) for t in self.tokenizer.get_vocab())

    def render_chat(self, messages: Sequence[dict]) -> str:
        """Render messages with the checkpoint's chat template and a generation prompt.

        Each message is ``{"role": ..., "content": str | [parts]}`` with parts
        ``{"type": "text", "text": ...}`` or ``{"type": "image"}``.

        Raises:
            PromptError: if user text contains the literal image placeholder
                (it would create an image slot that has no image).
        """
        for m in messages:
            content = m.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for p in parts or []:
                if p.get("type") == "text" and self.image_token in (p.get("text") or ""):
                    raise PromptError(
                        f"message text contains the reserved image placeholder "
                        f"{self.image_token!r}; send images as image_url content parts"
                    )
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )

    def from_messages(
        self, messages: Sequence[dict], images: Sequence[ImageInput]
    ) -> tuple[list[int], list[ImageSpan]]:
        """Token ids for a chat; ``images`` fill the image parts in order."""
        return self.from_text(self.render_chat(messages), images)

    def from_text(
        self, text: str, images: Sequence[ImageInput]
    ) -> tuple[list[int], list[ImageSpan]]:
        """Token ids for raw text whose ``<image>`` placeholders take ``images`` in order.

        Returns:
            ``(input_ids, spans)``: ids with each placeholder expanded to the image's
            pseudo-token ids, and where each image sits.

        Raises:
            PromptError: placeholder count differs from the number of images, too
                many images, text that is not valid Unicode (an unpaired surrogate) or
                far longer than the context.
        """
        if len(images) > self.max_images:
            raise PromptError(
                f"{len(images)} images in one request; the limit is {self.max_images}"
            )
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
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise PromptError(
                f"prompt has {len(slots)} image placeholders but {len(images)} images were given"
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for slot, image in zip(slots, images, strict=True):
            out.extend(ids[prev:slot])
            spans.append(ImageSpan(len(out), self.num_image_tokens, image))
            out.extend(self.pseudo_ids.get(image.key, self.num_image_tokens))
            prev = slot + 1
        out.extend(ids[prev:])
        return out, spans
