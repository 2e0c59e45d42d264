"""llama.cpp's ``llama-server`` as the baseline on the benchmark's own weights: the setup
helpers of ``scripts/setup_llamacpp.sh`` and the greedy agreement check with mmserve
(what each does and why: ``benchmarks/README.md``)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import tempfile
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.over_http import post_json, server
from benchmarks.workloads import ROOT, Prompt

DEFAULT_DIR = ROOT / ".llamacpp"
#: llama.cpp's media marker, pinned (it is random otherwise).
MEDIA_MARKER = "<__media__>"
NEAR_TIE = 0.05
MIN_TEXT_AGREE = 8


@dataclass
class LlamaCppSetup:
    """What ``scripts/setup_llamacpp.sh`` left in ``dir``: the ``llama-server`` binary, the
    f32 language model and CLIP+projector GGUFs, the Hugging Face checkpoint they came from
    (which mmserve serves), the chat template, and ``info`` (the rest of ``setup.json``)."""

    dir: Path
    server: Path
    model_gguf: Path
    mmproj_gguf: Path
    hf_dir: Path
    chat_template: Path
    info: dict = field(default_factory=dict)


def find_setup(path: str | Path | None = None) -> tuple[LlamaCppSetup | None, str]:
    """The setup in ``path`` (default ``$MMSERVE_LLAMACPP_DIR`` or ``.llamacpp``):
    ``(setup, "")``, or ``(None, why)`` when absent or incomplete."""
    d = Path(path or os.environ.get("MMSERVE_LLAMACPP_DIR") or DEFAULT_DIR)
    if not (d / "setup.json").is_file():
        return None, f"no llama.cpp setup in {d} (run scripts/setup_llamacpp.sh; not done in CI)"
    info = json.loads((d / "setup.json").read_text(encoding="utf-8"))
    keys = ("server", "model_gguf", "mmproj_gguf", "hf_dir", "chat_template")
    s = LlamaCppSetup(d, *(d / info[k] for k in keys), info=info)
    missing = [str(getattr(s, k)) for k in keys if not getattr(s, k).exists()]
    if missing:
        return None, f"llama.cpp setup in {d} is incomplete (missing {', '.join(missing)})"
    return s, ""


def llama_server(
    setup: LlamaCppSetup,
    threads: int = 1,
    slots: int = 4,
    log_path: Path | None = None,
) -> AbstractContextManager[tuple[str, Any]]:
    """``llama-server`` on 127.0.0.1: ``threads`` for generation, batches and the CLIP
    encoder, ``slots`` requests decoded together (4,096 context tokens each), f32 KV cache,
    prompt cache on (``--cache-ram`` 1 GiB), mmserve's chat template; yields ``(url,
    process)`` once healthy."""
    cmd = [
        str(setup.server), "-m", str(setup.model_gguf), "--mmproj", str(setup.mmproj_gguf),
        "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads), "-np", str(slots),
        "-c", str(slots * 4096), "-b", "2048", "-ub", "2048", "-ctk", "f32",
        "-ctv", "f32", "--jinja", "--chat-template-file", str(setup.chat_template),
        "--no-warmup", "-a", setup.hf_dir.name, "--cache-ram", "1024",
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(threads), "LLAMA_MEDIA_MARKER": MEDIA_MARKER}
    return server(cmd, env, log_path, timeout=120)


# ---- checkpoint and conversion helpers (scripts/setup_llamacpp.sh) -------------------------


def make_sp_checkpoint(out: Path, size: str = "small", seed: int = 0) -> Path:
    """``make_checkpoint(out, size, seed)`` with a SentencePiece tokenizer (same weights:
    the initialisation is seeded by parameter name, and the vocabulary has the same ids),
    written through a temporary sibling renamed into place."""
    from mmserve.testing.checkpoints import checkpoint_spec, write_checkpoint

    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    spec = checkpoint_spec(size, "llava")
    spec["tokenizer"] = checkpoint_spec(size, "llava-next")["tokenizer"]  # SentencePiece
    try:
        write_checkpoint(tmp, spec, seed)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_language_model(hf_dir: Path, out: Path) -> Path:
    """The checkpoint's Llama language model (with ``lm_head``) and tokenizer in ``out``."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    lm = LlamaForCausalLM(model.config.text_config)
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    shutil.copy(Path(hf_dir) / "tokenizer.model", out / "tokenizer.model")
    return out


def write_vit_dir(hf_dir: Path, surgery_dir: Path, out: Path) -> Path:
    """A ``CLIPVisionModel`` directory from ``llava_surgery_v2.py -C``'s ``llava.clip``
    (``vision_tower.*`` renamed ``vision_model.*``), the checkpoint's ``vision_config``
    plus ``vision_feature_layer`` (so the converter keeps the layers LLaVA reads), and
    the projector beside it."""
    import torch

    cfg = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    vision = {**cfg["vision_config"], "model_type": "clip_vision_model"}
    vision["architectures"] = ["CLIPVisionModel"]
    vision["vision_feature_layer"] = cfg.get("vision_feature_layer", -2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vision, indent=2), encoding="utf-8")
    clip = torch.load(surgery_dir / "llava.clip", map_location="cpu")
    prefix = "vision_tower."
    clip = {
        ("vision_model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in clip.items()
    }
    torch.save(clip, out / "pytorch_model.bin")
    shutil.copy(surgery_dir / "llava.projector", out / "llava.projector")
    return out


def export_qwen2_lm(hf_dir: Path, out: Path) -> Path:
    """The language model of a LLaVA-OneVision checkpoint (its Qwen2 decoder, with the LM
    head, tied or not) as a ``Qwen2ForCausalLM`` directory in ``out``: ``config.json``
    from ``text_config``, the ``language_model.*`` tensors renamed as that class names them
    (bytes unchanged, same dtype), and the tokenizer files copied.

    Raises:
        ValueError: if the checkpoint's language model is not Qwen2.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    text = dict(cfg["text_config"])
    if text.get("model_type") != "qwen2":
        raise ValueError(f"{hf_dir}: text model {text.get('model_type')!r}, expected qwen2")
    text["architectures"] = ["Qwen2ForCausalLM"]
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    text.setdefault("torch_dtype", cfg.get("torch_dtype", cfg.get("dtype", "bfloat16")))
    tensors = {}
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.startswith("language_model.model."):  # transformers' old layout
                tensors[k[len("language_model.") :]] = f.get_tensor(k)
            elif k.startswith("model.language_model."):  # transformers 5's layout
                tensors["model." + k[len("model.language_model.") :]] = f.get_tensor(k)
            elif k in ("lm_head.weight", "language_model.lm_head.weight"):
                tensors["lm_head.weight"] = f.get_tensor(k)
    if text["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(text, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out / name)
    return out


def byte_level_pre_tokenizer(model_dir: Path) -> str | None:
    """llama.cpp's name for ``model_dir``'s BPE pre-tokenizer when ``tokenizer.json`` says
    exactly what it is: ``"gpt-2"`` for a lone ``ByteLevel`` pre-tokenizer with its regex
    (GPT-2's split, which llama.cpp's ``gpt-2`` pre-tokenizer implements); else None."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text(encoding="utf-8"))
    pre = tok.get("pre_tokenizer") or {}
    model = tok.get("model") or {}
    if model.get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return None


def convert_lm(src: Path, model_dir: Path, outfile: Path, outtype: str = "f16") -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` from the source tree ``src`` on
    ``model_dir``. The converter names a BPE pre-tokenizer by hashing the token ids of a
    test string and refuses a hash it does not list (NotImplementedError): our trained
    tokenizers are in no list. Only then, and only when :func:`byte_level_pre_tokenizer`
    identifies the pre-tokenizer from ``tokenizer.json``, that name is written instead;
    any other tokenizer is still refused.

    Raises:
        NotImplementedError: the converter's refusal, for a pre-tokenizer not identified.
    """
    import runpy
    import sys

    src, path, argv = Path(src), list(sys.path), sys.argv
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion import base  # llama.cpp's converter package, from ``src``

    listed = base.TextModel.get_vocab_base_pre

    def pre(self: Any, tokenizer: Any) -> str:
        try:
            return listed(self, tokenizer)
        except NotImplementedError:
            name = byte_level_pre_tokenizer(Path(model_dir))
            if name is None:
                raise
            print(f"unlisted BPE pre-tokenizer; tokenizer.json says {name!r}", file=sys.stderr)
            return name

    base.TextModel.get_vocab_base_pre = pre  # type: ignore[method-assign]
    sys.argv = [str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype]
    sys.argv += ["--outfile", str(outfile)]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:  # a second call wraps the listed method again, not this call's wrapper
        base.TextModel.get_vocab_base_pre = listed  # type: ignore[method-assign]
        sys.argv, sys.path[:] = argv, path
    return Path(outfile)


# ---- agreement ------------------------------------------------------------------------------


def chats() -> list[tuple[str | None, bytes | None, list[dict]]]:
    """``(label, image bytes, messages)``: ten text-only chats (4 with the system prompt, 4
    bare, 2 with a chat history; no label or image), then two non-square photos and a
    336-px frame."""
    sys_msg, q = {"role": "system", "content": workloads.SYSTEM_PROMPT}, workloads.QUESTIONS
    chats = [[sys_msg, {"role": "user", "content": q[i]}] for i in (0, 2, 5, 8)]
    chats += [[{"role": "user", "content": q[i]}] for i in (1, 10, 14, 12)]
    for t in (1, 2):
        history = [(workloads.CANNED_ANSWERS[j], workloads.FOLLOW_UPS[j]) for j in range(t)]
        chats.append([sys_msg, {"role": "user", "content": q[3]}])
        for a, u in history:
            chats[-1] += [{"role": "assistant", "content": a}, {"role": "user", "content": u}]
    ims = workloads.photos(4)
    ims = {"cat.png": ims["cat.png"], "rocket.jpg": ims["rocket.jpg"]}
    ims["pan frame 336x336"] = workloads.pan_frames(2, repeat_every=0)[1]
    return [(None, None, m) for m in chats] + [(n, b, workloads.ask(q[1])) for n, b in ims.items()]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))


def agreement(
    mm_url: str, ll_url: str, engine: Any, never: list[int], max_tokens: int = 16
) -> dict:
    """Compare greedy answers of mmserve (``mm_url``; token ids from ``engine``, in-process
    on the same checkpoint) and llama.cpp (``ll_url``), giving each difference a reason.

    Returns:
        ``items`` (per chat: label, prompt tokens of both, ``agree``, ``reason``), counts
        ``text_agree``/``text_total``/``image_agree``/``image_total``, ``unexplained``,
        ``engine_equals_http`` and ``passed`` (>= :data:`MIN_TEXT_AGREE` text chats equal,
        nothing unexplained).
    """
    from PIL import Image

    from mmserve.types import SamplingParams

    bias = [[i, False] for i in never]
    gen = {"n_predict": max_tokens, "temperature": 0.0, "logit_bias": bias}
    gen.update(cache_prompt=False, return_tokens=True)
    completion = lambda prompt: post_json(f"{ll_url}/completion", {"prompt": prompt, **gen})  # noqa: E731
    items = []
    for label, data, msgs in chats():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2)
        imgs = [engine.processor.prepare_image(data)] if data else []
        req = engine.processor.make_request(messages=msgs, images=imgs, params=params)
        mine = engine.generate([req])[0]
        urls = {label: workloads.data_url(data)} if data else {}
        oai = workloads.openai_messages(Prompt(msgs, [label] if data else []), urls)
        body = {"messages": oai, "max_tokens": max_tokens, "temperature": 0.0}
        http = post_json(f"{mm_url}/v1/chat/completions", body)
        if data:  # llama.cpp flattens parts and drops the template's "\n" after <image>
            oai[-1]["content"][1] = {"type": "text", "text": "\n" + oai[-1]["content"][1]["text"]}
        rendered = post_json(f"{ll_url}/apply-template", {"messages": oai})["prompt"]
        b64 = [base64.b64encode(data).decode()] if data else []
        prompt = {"prompt_string": rendered, "multimodal_data": b64} if data else rendered
        a, b = list(mine.output_ids), completion(prompt).get("tokens") or []
        ll_body = {**body, "messages": oai, "logit_bias": bias, "cache_prompt": False}
        ll_chat = post_json(f"{ll_url}/v1/chat/completions", ll_body)
        item = {
            "chat": label or f"text, {len(msgs)} messages: {msgs[-1]['content'][:40]!r}",
            "kind": "image" if data else "text",
            "prompt_tokens": [http["usage"]["prompt_tokens"], ll_chat["usage"]["prompt_tokens"]],
            "mmserve": http["choices"][0]["message"]["content"] or "",
            "llamacpp": ll_chat["choices"][0]["message"]["content"] or "",
            "agree": a == b,
        }
        item["engine_equals_http"] = mine.text == item["mmserve"]
        items.append(item)
        if item["agree"]:
            continue
        k = _first_diff(a, b)
        top = (mine.logprobs or [])[k].top if k < len(mine.logprobs or []) else []
        gap = top[0][1] - top[1][1] if len(top) > 1 else None
        item.update(token_index=k, top2_gap=gap)
        ours = engine.model.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True
        )
        reasons = []
        if data and item["prompt_tokens"][0] != item["prompt_tokens"][1]:
            reasons.append(
                "tokenizer (llama.cpp tokenizes the text after the image as its own chunk, "
                "with a leading '▁')"
            )
        if data and (im := Image.open(io.BytesIO(data))).width != im.height:
            reasons.append(
                "preprocessing (llama.cpp pads to a square; transformers crops the centre)"
            )
        if not data and rendered != ours:
            reasons.append("template")
        elif not data:
            tok = {"content": ours, "add_special": True, "parse_special": True}
            ids, want = list(post_json(f"{ll_url}/tokenize", tok)["tokens"]), list(req.input_ids)
            if ids != want:
                same = completion(want).get("tokens") == a
                reasons.append(
                    f"tokenizer: prompt ids differ from position {_first_diff(ids, want)} "
                    "(llama.cpp puts '▁' after a special token); given mmserve's ids "
                    f"llama.cpp's answer {'equals' if same else 'still differs from'} mmserve's"
                )
        if not reasons and (data or (gap is not None and gap < NEAR_TIE)):
            reasons.append(
                f"float order (token {k}: top-2 gap {gap}; for images ggml's patch "
                "convolution also takes f16 input)"
            )
        item["reason"] = "; ".join(reasons) or f"unexplained (token {k}, top-2 gap {gap})"
    text = [i for i in items if i["kind"] == "text"]
    out = {"items": items, "max_tokens": max_tokens, "text_total": len(text)}
    out.update(text_agree=sum(i["agree"] for i in text), image_total=len(items) - len(text))
    out["image_agree"] = sum(i["agree"] for i in items if i["kind"] == "image")
    out["unexplained"] = sum("unexplained" in i.get("reason", "") for i in items)
    out["engine_equals_http"] = all(i["engine_equals_http"] for i in items)
    out["passed"] = out["text_agree"] >= MIN_TEXT_AGREE and not out["unexplained"]
    return out
