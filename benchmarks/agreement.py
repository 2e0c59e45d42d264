"""Greedy agreement between mmserve and llama.cpp on the same weights, before any timing.

Ten text-only chats (eight single-turn, four with the system prompt and four without,
and two with a canned chat history) and three image chats go to both servers: greedy,
``max_tokens`` 16, stopping at end-of-sequence; llama.cpp gets ``logit_bias`` -inf on
the ids mmserve never samples (the image placeholder and padding), so both pick from
the same vocabulary. Answers are compared as token ids, not text (the two detokenizers
differ: llama.cpp keeps the first token's leading space, and they render invalid
UTF-8 from byte-fallback tokens differently). llama.cpp's ids come from ``/completion``
with ``return_tokens`` on its own rendering of the chat (its text is checked against its
chat endpoint's answer); mmserve's from its engine in-process on the same checkpoint
(the same greedy ids the server streams; its text is checked against the server's).

A pair that differs gets a reason, checked in this order:

1. template: llama.cpp's ``/apply-template`` renders another prompt string than
   mmserve's chat template (text chats);
2. tokenizer: the same string, other prompt ids (llama.cpp's ``/tokenize``); then
   llama.cpp's ``/completion`` is given mmserve's prompt ids directly, and when that
   answer equals mmserve's the model agrees and the tokenizer is the whole story. For
   an image chat, another prompt length: llama.cpp tokenizes the text after an image
   as its own chunk, and its SentencePiece tokenizer puts a "▁" at the start of every
   chunk and after every special token, where transformers' (``legacy=False``) does
   not. Image chats go to llama.cpp with a "\\n" before the text after the image,
   which mmserve's template writes and llama.cpp's flattening of the parts drops;
3. preprocessing: an image that is not square (LLaVA-1.5 in llama.cpp pads the image to
   a square; transformers' CLIP processor, which mmserve follows, resizes the short
   side and crops the centre);
4. float order: everything above equal, and mmserve's top-2 log-probabilities at the
   first differing token within ``NEAR_TIE``: a near tie that another summation order
   (ggml's kernels, f16 input to its patch convolution) can flip;
5. otherwise "unexplained", with that gap.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.request
from typing import Any

from benchmarks import workloads
from benchmarks.loadgen import data_url
from mmserve.engine.engine import Engine
from mmserve.engine.request import SamplingParams

#: Top-2 log-probability gap below which a divergence counts as a near tie.
NEAR_TIE = 0.05
#: Text-only chats that must agree (of 10) for the check to pass.
MIN_TEXT_AGREE = 8


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def text_chats() -> list[list[dict]]:
    """Ten text-only chats: 4 with the system prompt, 4 bare, 2 with a chat history."""
    sys_msg = {"role": "system", "content": workloads.SYSTEM_PROMPT}
    q = workloads.QUESTIONS
    chats = [[sys_msg, {"role": "user", "content": q[i]}] for i in (0, 2, 5, 8)]
    chats += [[{"role": "user", "content": q[i]}] for i in (1, 10, 14, 12)]
    for t in (1, 2):
        msgs: list[dict] = [sys_msg, {"role": "user", "content": q[3]}]
        for j in range(t):
            msgs.append({"role": "assistant", "content": workloads.CANNED_ANSWERS[j]})
            msgs.append({"role": "user", "content": workloads.FOLLOW_UPS[j]})
        chats.append(msgs)
    return chats


def image_chats() -> list[tuple[str, bytes, list[dict], list[dict]]]:
    """``(label, image bytes, engine messages, OpenAI messages)``: two photos (not square)
    and a 336 x 336 video frame, each with the system prompt and one question."""
    frame = workloads.pan_frames(2, repeat_every=0)[1]
    items = [
        ("cat.png", workloads.photo_bytes("cat.png")),
        ("rocket.jpg", workloads.photo_bytes("rocket.jpg")),
        ("pan frame 336x336", frame),
    ]
    sys_msg = {"role": "system", "content": workloads.SYSTEM_PROMPT}
    q = workloads.QUESTIONS[1]
    out = []
    for label, data in items:
        eng_msgs = [
            sys_msg,
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]},
        ]
        oai = [
            sys_msg,
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(data)}},
                    {"type": "text", "text": q},
                ],
            },
        ]
        out.append((label, data, eng_msgs, oai))
    return out


def _newline_after_image(msgs: list[dict]) -> list[dict]:
    """``msgs`` with "\\n" before the text that follows an image part.

    llama.cpp flattens a message's parts into one string before the chat template sees
    it, with its media marker where the image was, so the template's ``<image>\\n`` loses
    its newline; this puts it back, so both servers see the same prompt text.
    """
    out = []
    for m in msgs:
        content = m["content"]
        if isinstance(content, list):
            parts, after_image = [], False
            for p in content:
                if p["type"] == "text" and after_image:
                    p = {**p, "text": "\n" + p["text"]}
                after_image = p["type"] == "image_url"
                parts.append(p)
            content = parts
        out.append({**m, "content": content})
    return out


def _is_square(data: bytes) -> bool:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.width == im.height


class _Mmserve:
    """mmserve's greedy answers: ids from the in-process engine, text from the server."""

    def __init__(self, url: str, engine: Engine, max_tokens: int) -> None:
        self.url = url
        self.engine = engine
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2)
        self.max_tokens = max_tokens

    def answer(self, eng_msgs: list[dict], oai_msgs: list[dict], images: list[bytes]) -> dict:
        eng = self.engine
        req = eng.processor.make_request(
            messages=eng_msgs,
            images=[eng.processor.prepare_image(b) for b in images],
            params=self.params,
        )
        res = eng.generate([req])[0]
        http = _post(
            f"{self.url}/v1/chat/completions",
            {"messages": oai_msgs, "max_tokens": self.max_tokens, "temperature": 0.0},
        )
        return {
            "ids": list(res.output_ids),
            "prompt_ids": list(req.input_ids),
            "prompt_tokens": http["usage"]["prompt_tokens"],
            "text": http["choices"][0]["message"]["content"] or "",
            "engine_text_equals_http": res.text == (http["choices"][0]["message"]["content"] or ""),
            "top2_gaps": [
                (lp.top[0][1] - lp.top[1][1]) if len(lp.top) > 1 else None
                for lp in res.logprobs or []
            ],
        }


def _llamacpp(
    url: str, msgs: list[dict], max_tokens: int, bias: list, images: list[bytes] = ()
) -> dict:
    """llama.cpp's greedy answer as ids: its own template (``/apply-template``), then
    ``/completion`` with ``return_tokens`` (the chat endpoint's logprobs leave out tokens
    that end inside a UTF-8 character, so they cannot give the ids)."""
    rendered = _post(f"{url}/apply-template", {"messages": msgs})["prompt"]
    prompt: Any = rendered
    if images:
        prompt = {
            "prompt_string": rendered,
            "multimodal_data": [base64.b64encode(b).decode() for b in images],
        }
    r = _post(
        f"{url}/completion",
        {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "logit_bias": bias,
            "cache_prompt": False,
            "return_tokens": True,
        },
    )
    chat = _post(
        f"{url}/v1/chat/completions",
        {
            "messages": msgs,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logit_bias": bias,
            "cache_prompt": False,
        },
    )
    text = chat["choices"][0]["message"]["content"] or ""
    return {
        "ids": list(r.get("tokens") or []),
        "prompt_tokens": chat["usage"]["prompt_tokens"],
        "text": text,
        "completion_equals_chat": (r.get("content") or "") == text,
    }


def _first_diff(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check(
    mm_url: str,
    ll_url: str,
    engine: Engine,
    never_sample_ids: list[int],
    max_tokens: int = 16,
) -> dict[str, Any]:
    """Compare greedy answers of mmserve (``mm_url``) and llama.cpp (``ll_url``).

    Args:
        engine: an in-process engine on the checkpoint mmserve serves (for token ids).
        never_sample_ids: ids mmserve masks out of sampling.

    Returns:
        ``{"text": [...], "image": [...], "text_agree", "image_agree", "passed", ...}``;
        each item holds both answers' texts, ``agree`` and, when they differ, ``reason``.
    """
    bias = [[i, False] for i in never_sample_ids]
    mm = _Mmserve(mm_url, engine, max_tokens)
    tok = engine.model.tokenizer
    out: dict[str, Any] = {"text": [], "image": [], "max_tokens": max_tokens}
    for msgs in text_chats():
        a = mm.answer(msgs, msgs, [])
        b = _llamacpp(ll_url, msgs, max_tokens, bias)
        item: dict[str, Any] = {
            "prompt": msgs[-1]["content"][:60],
            "messages": len(msgs),
            "mmserve": a["text"],
            "llamacpp": b["text"],
            "prompt_tokens": [a["prompt_tokens"], b["prompt_tokens"]],
            "engine_text_equals_http": a["engine_text_equals_http"],
            "llamacpp_completion_equals_chat": b["completion_equals_chat"],
            "agree": a["ids"] == b["ids"],
        }
        if not item["agree"]:
            k = _first_diff(a["ids"], b["ids"])
            gap = a["top2_gaps"][k] if k < len(a["top2_gaps"]) else None
            item.update(token_index=k, top2_gap=gap)
            rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ll_rendered = _post(f"{ll_url}/apply-template", {"messages": msgs})["prompt"]
            ll_ids = _post(
                f"{ll_url}/tokenize",
                {"content": rendered, "add_special": True, "parse_special": True},
            )["tokens"]
            if ll_rendered != rendered:
                item["reason"] = "template"
            elif list(ll_ids) != a["prompt_ids"]:
                j = _first_diff(list(ll_ids), a["prompt_ids"])
                same = _post(
                    f"{ll_url}/completion",
                    {
                        "prompt": a["prompt_ids"],
                        "n_predict": max_tokens,
                        "temperature": 0.0,
                        "logit_bias": bias,
                        "cache_prompt": False,
                        "return_tokens": True,
                    },
                ).get("tokens")
                item["llamacpp_from_mmserve_prompt_ids_agrees"] = same == a["ids"]
                item["reason"] = (
                    f"tokenizer: prompt ids differ from position {j} ("
                    f"{tok.convert_ids_to_tokens(a['prompt_ids'][j : j + 2])} vs "
                    f"{tok.convert_ids_to_tokens(list(ll_ids)[j : j + 2])}: llama.cpp puts '▁' "
                    "after a special token); given mmserve's prompt ids, llama.cpp's answer "
                    + ("equals mmserve's" if same == a["ids"] else "still differs")
                )
            elif gap is not None and gap < NEAR_TIE:
                item["reason"] = f"float order (near tie at token {k}: top-2 gap {gap:.3g})"
            else:
                item["reason"] = f"unexplained (token {k}, top-2 gap {gap})"
        out["text"].append(item)
    for label, data, eng_msgs, oai in image_chats():
        a = mm.answer(eng_msgs, oai, [data])
        b = _llamacpp(ll_url, _newline_after_image(oai), max_tokens, bias, [data])
        item = {
            "image": label,
            "mmserve": a["text"],
            "llamacpp": b["text"],
            "prompt_tokens": [a["prompt_tokens"], b["prompt_tokens"]],
            "engine_text_equals_http": a["engine_text_equals_http"],
            "llamacpp_completion_equals_chat": b["completion_equals_chat"],
            "agree": a["ids"] == b["ids"],
        }
        if not item["agree"]:
            k = _first_diff(a["ids"], b["ids"])
            gap = a["top2_gaps"][k] if k < len(a["top2_gaps"]) else None
            item.update(token_index=k, top2_gap=gap)
            reasons = []
            if a["prompt_tokens"] != b["prompt_tokens"]:
                reasons.append(
                    f"tokenizer ({a['prompt_tokens']} vs {b['prompt_tokens']} prompt tokens: "
                    "llama.cpp tokenizes the text after the image as its own chunk, with a "
                    "leading '▁')"
                )
            if not _is_square(data):
                reasons.append(
                    "preprocessing (llama.cpp pads to a square; transformers and mmserve "
                    "resize the short side to 336 and crop the centre)"
                )
            if not reasons:
                g = "-" if gap is None else f"{gap:.3g}"
                reasons.append(
                    "float order (same pixels and prompt; ggml's patch conv takes f16 input "
                    f"and sums in another order; top-2 gap {g})"
                )
            item["reason"] = "; ".join(reasons)
        out["image"].append(item)
    out["text_agree"] = sum(i["agree"] for i in out["text"])
    out["image_agree"] = sum(i["agree"] for i in out["image"])
    out["text_total"] = len(out["text"])
    out["image_total"] = len(out["image"])
    items = out["text"] + out["image"]
    out["unexplained"] = sum("unexplained" in i.get("reason", "") for i in items)
    out["engine_equals_http"] = all(i["engine_text_equals_http"] for i in items)
    out["llamacpp_completion_equals_chat"] = sum(
        i["llamacpp_completion_equals_chat"] for i in items
    )
    out["items"] = len(items)
    out["passed"] = out["text_agree"] >= MIN_TEXT_AGREE and not out["unexplained"]
    return out
