"""The test checkpoints' weights: seeded random values, drawn and written.

Weights are seeded random values, scaled (not the usual 0.02 std) so that different images
produce clearly different greedy answers. Same seed and same library versions give
byte-identical files. Real-shape sizes are written tensor by tensor
(:func:`write_weights_streamed`), never the whole model in memory.

Also :func:`quantize_checkpoint` (the decoder's projections rewritten in the
compressed-tensors layout) and :func:`count_parameters`.

Every safetensors file is written by :func:`write_safetensors`: tensor by tensor into a
temporary file renamed into place, with the mode an ordinary file gets under the
process's umask (0644 under umask 022; safetensors' own writer leaves 0600), and
progress logged to the ``mmserve.testing.weights`` logger (``make-model`` prints it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: torch dtypes -> safetensors' header names (the format's documented ones).
_ST_NAMES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}  # fmt: skip
#: Progress is logged each time this fraction of a file's bytes more is written ...
PROGRESS_FRACTION = 0.1
#: ... or this many bytes, whichever comes first.
PROGRESS_BYTES = 256 << 20


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, and put it back at once
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open()`` gives a new file here: 0o666 less the umask (0o644 under 022)."""
    return 0o666 & ~_umask()


def fix_modes(out: Path) -> None:
    """Give ``out``'s safetensors files :func:`file_mode` (transformers'
    ``save_pretrained`` writes them through safetensors, which leaves 0600) and log
    each file's size."""
    for path in sorted(Path(out).glob("*.safetensors")):
        os.chmod(path, file_mode())
        log.info("wrote %s (%s bytes)", path.name, f"{path.stat().st_size:,}")


#: One tensor to write: its key, shape, dtype, and a function that makes its value.
TensorSpec = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]


def write_safetensors(
    path: Path, tensors: Iterable[TensorSpec], metadata: dict[str, str] | None = None
) -> int:
    """Write a safetensors file one tensor at a time: each value is made (its function
    called) only when its turn comes and dropped once written, so memory holds one
    tensor, not the file. The layout is safetensors' documented one (8-byte little-endian
    header length, a JSON header of ``{key: {dtype, shape, data_offsets}}`` padded with
    spaces to a multiple of 8, then the data in header order). The file is written to a
    temporary name beside ``path`` and renamed over it, then given :func:`file_mode`;
    progress (bytes, percent, rate) is logged every :data:`PROGRESS_FRACTION` of the
    file or :data:`PROGRESS_BYTES`.

    Returns:
        The file's data bytes.

    Raises:
        ValueError: a made value whose shape or dtype differs from its spec, or a dtype
            safetensors has no name for.
    """
    specs = list(tensors)
    header: dict[str, dict] = {"__metadata__": dict(metadata)} if metadata else {}
    at = 0
    for key, shape, dtype, _ in specs:
        if dtype not in _ST_NAMES:
            raise ValueError(f"{key}: dtype {dtype} has no safetensors name")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": _ST_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [at, at + size],
        }
        at += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    total, done, last, start = at, 0, 0, time.monotonic()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            for key, shape, dtype, make in specs:
                value = make()
                if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                    raise ValueError(f"{key}: made {value.dtype} {tuple(value.shape)}")
                data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                f.write(data.data)
                done += data.nbytes
                del value, data
                if done == total or done - last >= min(PROGRESS_BYTES, total * PROGRESS_FRACTION):
                    last = done
                    secs = max(time.monotonic() - start, 1e-9)
                    log.info(
                        "writing %s: %s of %s bytes (%d%%), %.1f MB/s",
                        path.name, f"{done:,}", f"{total:,}", 100 * done // max(total, 1),
                        done / secs / 1e6,
                    )  # fmt: skip
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s bytes)", path.name, f"{path.stat().st_size:,}")
    return total


def _init_std(name: str, shape: torch.Size, tied: bool = False) -> float | None:
    """Std of the normal init for parameter ``name``; ``None`` means norm (ones/zeros).

    ``tied``: the LM head is the embedding matrix, which then gets a smaller std
    (:data:`TIED_EMBED_STD`), and the decoder's output projections a larger gain."""
    if len(shape) == 1 and "norm" in name:
        return None
    if "language_model" in name and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return 0.5  # Qwen2's q/k/v biases: non-zero, so a decoder that drops them differs
    if name.endswith("bias"):
        return 0.0
    if "position_embedding" in name:
        return 0.02  # small, so patch content (not position) dominates image features
    if "class_embedding" in name:
        return 1.0
    if "embed_tokens" in name:
        return TIED_EMBED_STD if tied else 1.0
    fan_in = math.prod(shape[1:])
    gain = 1.0
    if "multi_modal_projector" in name:
        gain = 2.0  # amplify image features entering the language model
    elif "q_proj" in name or "k_proj" in name:
        gain = 2.0  # peaky attention, so image content changes what tokens attend to
    elif "lm_head" in name:
        gain = 3.0  # logits std ~3, so sampling at temperature 1 is not near-uniform
    elif tied and "language_model" in name and name.endswith(("o_proj.weight", "down_proj.weight")):
        gain = 3.0  # the layers, not the (tied) input embedding, dominate the residual
    return gain / math.sqrt(fan_in)


#: Embedding std of a tied-embedding checkpoint. With std 1 a token's own embedding
#: dominates the residual stream and, through the tied head, the logits, so the model
#: repeats its last token whatever the image; at 0.1 the layers' outputs dominate.
TIED_EMBED_STD = 0.1
#: Final norm weight of a tied-embedding checkpoint: logits std ~3 (as ``lm_head``'s gain
#: of 3 gives an untied one) despite the small embeddings.
TIED_FINAL_NORM = 3.0


def _init_value(name: str, shape: torch.Size, tied: bool, gen: torch.Generator) -> torch.Tensor:
    """The fp32 initial value of parameter ``name``; random ones draw from ``gen``, so
    parameters must be visited in one fixed order (sorted names)."""
    std = _init_std(name, shape, tied)
    if std is None:
        final = tied and name.endswith("language_model.norm.weight")
        fill = (TIED_FINAL_NORM if final else 1.0) if name.endswith("weight") else 0.0
        return torch.full(shape, fill, dtype=torch.float32)
    if std == 0.0:
        return torch.zeros(shape, dtype=torch.float32)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int, tied: bool = False) -> None:
    """Deterministically overwrite every parameter (sorted by name) from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        params[name].copy_(_init_value(name, params[name].shape, tied, gen))


#: Largest weight shard :func:`write_weights_streamed` writes (bytes), as transformers'
#: ``max_shard_size`` default in spirit: a 7B checkpoint becomes a handful of files.
SHARD_BYTES = 2 << 30


def _saved_key(name: str) -> str:
    """The checkpoint key transformers' ``save_pretrained`` writes for parameter ``name``
    of a LLaVA-family model (the llava-hf layout: ``language_model.model.*``,
    ``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    return name.removeprefix("model.")


@torch.no_grad()
def write_weights_streamed(
    out: Path,
    model_cls: type,
    config: object,
    seed: int,
    tied: bool,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
) -> int:
    """Write seeded weights for ``model_cls(config)`` without building the model.

    The model is instantiated on the meta device (shapes only); each parameter is then
    drawn in fp32 exactly as :func:`_reinit` draws it (same order, same generator, so a
    tiny checkpoint gets the same values either way), cast to ``dtype`` and written in
    safetensors shards of at most ``shard_bytes`` (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``) by
    :func:`write_safetensors` (mode 0644 under umask 022, progress logged). Peak memory
    is one fp32 tensor, so a 7B checkpoint can be written on a machine that could not
    hold it in fp32.

    Args:
        out: checkpoint directory (exists).
        model_cls: a transformers LLaVA-family ``...ForConditionalGeneration`` class.
        config: its config.
        seed: weight seed.
        tied: the LM head is the embedding matrix (not written, as transformers saves it).
        dtype: stored dtype (bf16 for the real shapes, as published).
        shard_bytes: shard size bound (bytes); a larger single tensor gets its own shard.

    Returns:
        The number of parameters written.
    """
    with torch.device("meta"):
        meta = model_cls(config)
    shapes = {n: p.shape for n, p in meta.named_parameters()}
    del meta
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = [[]]
    sizes = [0]
    nbytes = torch.empty((), dtype=dtype).element_size()
    for name in sorted(shapes):  # plan the shards first: names only, no memory
        size = math.prod(shapes[name]) * nbytes
        if shards[-1] and sizes[-1] + size > shard_bytes:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += size
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)
    ]  # fmt: skip
    weight_map: dict[str, str] = {}

    def drawn(name: str) -> Callable[[], torch.Tensor]:
        # drawn when written, in sorted order: the generator's sequence is _reinit's
        return lambda: _init_value(name, shapes[name], tied, gen).to(dtype)

    for names, fname in zip(shards, files, strict=True):
        specs = [(_saved_key(m), tuple(shapes[m]), dtype, drawn(m)) for m in names]
        weight_map.update({_saved_key(m): fname for m in names})
        write_safetensors(out / fname, specs, metadata={"format": "pt"})
    if n > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sum(math.prod(s) for s in shapes.values())


#: ``quantize_checkpoint``'s methods (``make-model --quantization``).
QUANTIZED_FORMATS = ("int8", "fp8", "int4", "awq", "gptq")
#: Decoder projections a compressed-tensors checkpoint stores quantized (llm-compressor's
#: default recipe: every Linear of the language model; the LM head, vision tower and
#: projector ignored).
_QUANTIZED_PROJ = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


def quantize_checkpoint(
    model_dir: str | Path, method: str, group: int = 128, symmetric: bool | None = None
) -> Path:
    """Rewrite ``model_dir``'s decoder projections in the compressed-tensors layout
    llm-compressor writes and vLLM loads: each ``<module>.weight`` as int8 or float8_e4m3fn
    (symmetric, per output channel: :func:`mmserve.model.quant.quantize_per_channel`) with
    its ``<module>.weight_scale`` ``[out, 1]`` in the checkpoint's dtype, and config.json's
    ``quantization_config`` saying so (``ignore``: the LM head, vision tower, projector).

    4-bit methods (:func:`quantize_checkpoint_int4`): "int4" (compressed-tensors
    pack-quantized W4A16), "awq" (AWQ gemm), "gptq" (GPTQ, v1 zeros), in groups of
    ``group`` input features, ``symmetric`` or not (None: the format's usual: symmetric
    for int4, asymmetric for AWQ and GPTQ; AWQ is always asymmetric).

    Args:
        model_dir: an unquantized checkpoint (:func:`make_checkpoint`), rewritten in place.
        method: "int8", "fp8", "int4", "awq" or "gptq".

    Raises:
        ValueError: for another method or an already quantized checkpoint.
    """
    from safetensors.torch import load_file

    from mmserve.model.quant import quantize_per_channel, scale_key
    from mmserve.model.weights import weight_files

    if method not in QUANTIZED_FORMATS:
        raise ValueError(
            f"unknown quantization {method!r}; expected {', '.join(QUANTIZED_FORMATS)}"
        )
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized")
    if method in ("int4", "awq", "gptq"):
        sym = method == "int4" if symmetric is None else symmetric
        return quantize_checkpoint_int4(model_dir, cfg, method, group, sym)
    for path in weight_files(model_dir):
        tensors = load_file(path)
        out = {}
        for key, t in tensors.items():
            if "language_model" in key and key.endswith(_QUANTIZED_PROJ):
                q, scale = quantize_per_channel(t, method)
                out[key] = q
                out[scale_key(key)] = scale[:, None].to(t.dtype)
            else:
                out[key] = t
        specs = [(k, tuple(t.shape), t.dtype, _const(t)) for k, t in sorted(out.items())]
        write_safetensors(path, specs, metadata={"format": "pt"})
    int8 = method == "int8"
    weights = {"num_bits": 8, "type": "int" if int8 else "float", "symmetric": True}
    weights.update(strategy="channel", dynamic=False)
    act = None if int8 else {"num_bits": 8, "type": "float", "symmetric": True}
    if act is not None:
        act.update(strategy="token", dynamic=True)  # fp8 W8A8 with per-token scales
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if int8 else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}
        },
        "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
    }
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return model_dir


def quantize_checkpoint_int4(
    model_dir: Path, cfg: dict, method: str, group: int, symmetric: bool
) -> Path:
    """:func:`quantize_checkpoint`'s 4-bit formats: each decoder projection quantized in
    groups (:func:`mmserve.model.int4.quantize_int4`) and stored in ``method``'s layout
    (:mod:`mmserve.model.int4_formats`: compressed-tensors ``weight_packed`` ...; AWQ and
    GPTQ ``qweight`` / ``qzeros`` / ``scales``), scales in the checkpoint's dtype, and the
    ``quantization_config`` those tools write."""
    from safetensors.torch import load_file

    from mmserve.model import int4_formats as fmts
    from mmserve.model.int4 import quantize_int4
    from mmserve.model.weights import weight_files

    symmetric = symmetric and method != "awq"
    for path in weight_files(model_dir):
        out = {}
        for key, t in load_file(path).items():
            if not ("language_model" in key and key.endswith(_QUANTIZED_PROJ)):
                out[key] = t
                continue
            q, scale, zero = quantize_int4(t, group, symmetric)
            if method == "int4":
                parts = fmts.pack_ct(q, scale, zero, symmetric)
            elif method == "awq":
                parts = fmts.pack_awq(q, scale, zero)
            else:
                parts = fmts.pack_gptq(q, scale, zero, group)
            prefix = key.removesuffix("weight")
            for suffix, v in parts.items():
                out[prefix + suffix] = v.to(t.dtype) if v.is_floating_point() else v
        specs = [(k, tuple(v.shape), v.dtype, _const(v)) for k, v in sorted(out.items())]
        write_safetensors(path, specs, metadata={"format": "pt"})
    if method == "int4":
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group"}
        weights.update(group_size=group, dynamic=False, actorder=None)
        qc: dict = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
            },
            "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*"],
        }
    elif method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
        qc.update(version="gemm", modules_to_not_convert=["vision_tower", "multi_modal_projector"])
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False}
        qc.update(sym=symmetric, checkpoint_format="gptq", true_sequential=True)
    cfg["quantization_config"] = qc
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return model_dir


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def count_parameters(model_dir: str | Path) -> int:
    """Total number of parameters stored in ``model_dir``'s safetensors file(s)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total
