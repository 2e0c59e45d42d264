"""``real-shapes``: mmserve against transformers on a real-shape checkpoint, side by side
(what each part measures: ``benchmarks/README.md``)."""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
from typing import Any

import torch
from PIL import Image

from benchmarks import report, workloads
from benchmarks.in_process import MMServeRunner, TransformersRunner
from benchmarks.workloads import Prompt, Workload, ask
from mmserve.config import EngineConfig
from mmserve.model.loader import load_model

med = statistics.median


def photo() -> bytes:
    """``astronaut.png`` resized to 380x300 (PNG)."""
    im = Image.open(workloads.SAMPLES_DIR / "astronaut.png").convert("RGB")
    return workloads.png(im.resize((380, 300)))


def _gaps(stamps: list[tuple[float, float]], first: int = 1) -> tuple[list, list]:
    """Wall and CPU seconds between consecutive stamps from index ``first`` on."""
    pairs = list(zip(stamps[first:], stamps[first + 1 :], strict=False))
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


class Sides:
    """transformers and mmserve on one checkpoint in one dtype, asked about :func:`photo`."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        self.mm = MMServeRunner.load(model_dir, dtype=dtype, max_total_tokens=32768)
        self.hf = TransformersRunner(model_dir, [], getattr(torch, dtype))
        self.image = Image.open(io.BytesIO(photo())).convert("RGB")
        self.render = self.mm.engine().processor.prompts.render_chat
        self.prefilled: Any = None

    def questions(self, qs: list[str], n: int) -> Workload:
        """``qs`` about the photo, ``n`` tokens each, one round."""
        return Workload(
            "q", "", {"photo": photo()}, [[Prompt(ask(q, False), ["photo"]) for q in qs]], n
        )

    def hf_ask(self, question: str, n: int) -> tuple[float, list, list]:
        """transformers: ``(seconds to the first token, decode gaps wall, CPU)``."""
        _, t = self.hf.generate(self.render(ask(question, False)), [self.image], n)
        return (t[1][0] - t[0][0], *_gaps(t))

    def mm_first_second(self, q1: str, q2: str) -> tuple[float, float, int]:
        """Seconds to the first token of ``q1`` on a fresh engine, then of ``q2`` (the photo
        cached), and ``q1``'s prompt tokens."""
        eng, out = self.mm.engine(), []
        for q in (q1, q2):
            req = self.mm.requests(eng, self.questions([q], 1))[0]
            t0 = time.perf_counter()
            eng.generate([req])
            out.append(time.perf_counter() - t0)
        return out[0], out[1], len(req.input_ids)

    def mm_decode(self, qs: list[str], n: int) -> tuple[list, list, int]:
        """Decode steps (wall, CPU) of ``qs`` at once, once all have their first token, and
        tokens they made."""
        r = self.mm.run(self.questions(qs, n), "decode", check_leaks=False)
        return (*map(list, zip(*r.decode_times, strict=True)), r.output_tokens - len(qs))

    def hf_decode(self, batch: int, n: int) -> tuple[list, list]:
        """Decode steps (wall, CPU) of ``generate`` at ``batch`` copies of the first question.

        The prompt less its last token is prefilled once at batch 1 and its cache repeated:
        the rows are identical, so left padding adds nothing and the cache equals a batched
        prefill's; ``batch`` full prefills would cost minutes and change no step.
        """
        if self.prefilled is None:
            inputs = self.hf.inputs(self.render(ask(workloads.QUESTIONS[0], False)), [self.image])
            head = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            with torch.inference_mode():
                ids, mask = inputs["input_ids"], inputs["attention_mask"]
                out = self.hf.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], **head)
            self.prefilled = (ids, mask, out.past_key_values)
        ids, mask, cache = self.prefilled
        cache = copy.deepcopy(cache)
        cache.batch_repeat_interleave(batch)
        inputs = {"input_ids": ids.repeat(batch, 1), "attention_mask": mask.repeat(batch, 1)}
        _, t = self.hf.generate("", [], n + 1, inputs=inputs, past_key_values=cache)
        return _gaps(t)  # the first step ran the last prompt token


def compare(model_dir: str, dtype: str, args: argparse.Namespace) -> dict:
    """First and second question, batch-1 decode and ``--batch`` answers, medians."""
    s, q, reps = Sides(model_dir, dtype), workloads.QUESTIONS, []
    for rep in range(args.repeats):
        first, gaps, cpu = s.hf_ask(q[0], args.tokens)
        r = dict(hf_first=first, hf_decode=med(gaps), hf_decode_cpu=med(cpu))
        r["hf_second"] = s.hf_ask(q[1], 2)[0]
        r["mm_first"], r["mm_second"], prompt_tokens = s.mm_first_second(q[0], q[1])
        wall, cpu, n = s.mm_decode([q[2 + rep % 3]], args.tokens)
        r.update(mm_decode=med(wall), mm_decode_cpu=med(cpu))
        r.update(mm_single_tps=n / sum(wall), mm_single_tps_cpu=n / sum(cpu))
        wall, cpu, n = s.mm_decode([f"{x} (take {rep})" for x in q[: args.batch]], args.tokens)
        reps.append({**r, "mm_batch_tps": n / sum(wall), "mm_batch_tps_cpu": n / sum(cpu)})
    out = {k: med(r[k] for r in reps) for k in reps[0]}
    return {**out, "prompt_tokens": prompt_tokens, "batch": args.batch}


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """Read bandwidth in bytes/s per wall and per CPU second: the best of ``repeats`` ``sum``
    and ``[n, 1024]`` matrix-vector passes (a batch-1 decode's kernel) over a float32
    tensor of ``nbytes``, far past the caches; each reads every byte once."""
    t, x = torch.ones(nbytes // 4 // 1024 * 1024), torch.ones(1024)
    best, best_cpu = float("inf"), float("inf")
    for i in range(2 * repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        t.sum() if i % 2 else t.view(-1, 1024) @ x
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, max(time.process_time() - c0, 1e-9))
    return t.numel() * 4 / best, t.numel() * 4 / best_cpu


def decode_weight_bytes(decoder: torch.nn.Module) -> int:
    """Bytes one decode step reads: every decoder parameter once (a tied LM head counted
    once), less an untied embedding table (a step reads only its rows)."""
    total = sum(p.numel() * p.element_size() for p in decoder.parameters())
    emb = decoder.embed_tokens.weight
    if decoder.lm_head.weight is not emb:
        total -= emb.numel() * emb.element_size()
    return total


def decode_sweep(model_dir: str, dtype: str, args: argparse.Namespace, check: bool) -> dict:
    """Decode ms per step at each batch for both systems (medians over ``--repeats``, wall
    and CPU) and the bound, :func:`decode_weight_bytes` / :func:`read_bandwidth`. With
    ``check``, ``default``: batch-1 decode of an engine made as ``mmserve serve`` makes it
    without ``--dtype``, alternating with this dtype's (at least 2 pairs)."""
    s, n = Sides(model_dir, dtype), args.decode_tokens
    batches = [int(b) for b in args.decode_batches.split(",")]
    res = {b: {"mm": [], "mm_cpu": [], "hf": [], "hf_cpu": []} for b in batches}
    for rep in range(args.repeats):
        for b in batches:
            for k, v in zip(("hf", "hf_cpu"), s.hf_decode(b, n), strict=True):
                res[b][k].append(med(v))
            qs = [f"{workloads.QUESTIONS[i % 16]} (take {rep}.{i})" for i in range(b)]
            for k, v in zip(("mm", "mm_cpu"), s.mm_decode(qs, n + 1)[:2], strict=True):
                res[b][k].append(med(v))
    weights = decode_weight_bytes(s.mm.model.decoder)
    del s.hf
    bw, bw_cpu = read_bandwidth(int(args.bandwidth_gb * (1 << 30)))
    out: dict = {"dtype": dtype, "tokens": n, "bandwidth_gbs": bw / 1e9, "weight_bytes": weights}
    out.update(bound_ms=weights / bw * 1e3, bandwidth_cpu_gbs=bw_cpu / 1e9)
    out["bound_cpu_ms"] = weights / bw_cpu * 1e3
    out["batches"] = {b: {k: med(v) * 1e3 for k, v in r.items()} for b, r in res.items()}
    if check:
        auto = EngineConfig(model_path=model_dir).torch_dtype()
        default = MMServeRunner(
            load_model(model_dir, dtype=auto), model_dir, max_total_tokens=32768
        )
        pairs = []  # alternating, so both see the same load from other jobs
        for i in range(max(2, args.repeats)):
            wl = s.questions([f"{workloads.QUESTIONS[2]} (d {i})"], n + 1)
            d = default.run(wl, "default", check_leaks=False)
            e = s.mm_decode([f"{workloads.QUESTIONS[2]} (e {i})"], n + 1)
            pairs.append((list(zip(*d.decode_times, strict=True)), e))
        out["default"] = {"dtype": str(auto).removeprefix("torch.")}
        for key, j, side in (("ms", 0, 0), ("cpu_ms", 1, 0), ("explicit_ms", 0, 1)):
            out["default"][key] = med(med(p[side][j]) for p in pairs) * 1e3
        out["default"]["explicit_cpu_ms"] = med(med(p[1][1]) for p in pairs) * 1e3
    return out


def _hidden(decoder: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states ``[T, hidden]`` of a teacher-forced token run (one
    prefill, torch backend, a fresh pool): the layer loop of ``LlamaDecoder.forward``
    without its last-row selection, so the head can run on every position in chunks."""
    from mmserve.cache.kv_pool import KVPool
    from mmserve.kernels.metadata import build_metadata
    from mmserve.kernels.torch_backend import TorchAttentionBackend

    s, n = decoder.shape, len(ids)
    dtype = decoder.embed_tokens.weight.dtype
    pool = KVPool(n, 1, s.num_layers, s.num_kv_heads, s.head_dim, dtype, "cpu")
    backend = TorchAttentionBackend()
    backend.plan(build_metadata([list(range(n))], [0], [n], 1, "cpu"))
    positions, cache = torch.arange(n), decoder.rope_cache(torch.device("cpu"))
    with torch.inference_mode():
        x, residual = decoder.embed_tokens(ids), None
        for layer in decoder.layers:
            x, residual = layer(x, residual, positions, cache, backend, pool)
        return decoder.norm(x, residual)[0]


def agreement(base: torch.nn.Module, other: torch.nn.Module, ids: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(base || other) (nats) of next-token distributions over
    every position of ``ids`` (teacher-forced: both read the same tokens)."""
    hb, ho = _hidden(base, ids), _hidden(other, ids)
    same, kl = 0, 0.0
    with torch.inference_mode():
        for i in range(0, len(ids), 250):
            lb = base.lm_head(hb[i : i + 250]).float().log_softmax(-1)
            lo = other.lm_head(ho[i : i + 250]).float().log_softmax(-1)
            same += int((lb.argmax(-1) == lo.argmax(-1)).sum())
            kl += float((lb.exp() * (lb - lo)).sum())
    return {"positions": len(ids), "top1": same / len(ids), "kl": kl / len(ids)}


def teacher_tokens(model_dir: str, n: int) -> torch.Tensor:
    """``n`` token ids of the test corpus (repeated as needed) in the checkpoint's
    tokenizer: the teacher-forced text of :func:`agreement`."""
    from mmserve.model.loader import load_processor
    from mmserve.testing.checkpoints import CORPUS_PATH

    tok = load_processor(model_dir).tokenizer
    ids = tok(CORPUS_PATH.read_text())["input_ids"]
    return torch.tensor((ids * (n // max(1, len(ids)) + 1))[:n])


def image_logits(runner: MMServeRunner, question: str, image: bytes) -> torch.Tensor:
    """fp32 logits ``[vocab]`` of the first answer token of ``question`` about ``image``
    (a fresh engine: no cached image or prefix)."""
    from mmserve.types import SamplingParams

    eng = runner.engine()
    wl = Workload("s", "", {"img": image}, [[Prompt(ask(question, False), ["img"])]], 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    (res,) = eng.generate(runner.requests(eng, wl, params, cached=False))
    return res.logits[0].float()


def _kl(a: torch.Tensor, b: torch.Tensor) -> float:
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    return float((la.exp() * (la - lb)).sum())


def image_sensitivity(runners: dict[str, MMServeRunner], question: str) -> dict:
    """Per method: how much the first answer token's logits move between two different
    photos (:func:`photo` and ``cat.png`` at the same size): relative L2 distance, KL and
    whether the top-1 token changes; and KL of each photo's logits against the
    unquantized model's. A model that ignores its image (the known fp8 LLaVA failure)
    gives ~0 movement where the unquantized one does not."""
    im = Image.open(workloads.SAMPLES_DIR / "cat.png").convert("RGB")
    other = workloads.png(im.resize((380, 300)))
    logits = {m: (image_logits(r, question, photo()), image_logits(r, question, other))
              for m, r in runners.items()}  # fmt: skip
    keep = torch.ones_like(logits["none"][0], dtype=torch.bool)
    for a, b in logits.values():  # ids never sampled are -inf in every run
        keep &= a.isfinite() & b.isfinite()
    logits = {m: (a[keep], b[keep]) for m, (a, b) in logits.items()}
    base = logits["none"]
    out = {}
    for m, (a, b) in logits.items():
        out[m] = {
            "rel_l2": float((a - b).norm() / a.norm()),
            "kl_between_photos": _kl(a, b),
            "top1_differs": bool(a.argmax() != b.argmax()),
            "kl_vs_none": (_kl(base[0], a) + _kl(base[1], b)) / 2,
        }
    return out


def quant_sweep(model_dir: str, dtype: str, args: argparse.Namespace) -> dict:
    """``--parts quant``: batch-1 and batch-``--batch`` decode and the first question
    (tower + prefill; CPU time: the first and the cached second) of mmserve unquantized
    and each of ``--quant-methods`` (int8, int4) against transformers (medians over
    ``--repeats``, the systems alternating), decoder weight bytes and the read bandwidth
    measured in the same run (the bound: bytes / bandwidth), each method's top-1
    agreement and mean KL against the unquantized model over ``--quality-positions``
    teacher-forced positions (int8 also with its LM head unquantized), and the image
    sensitivity check (:func:`image_sensitivity`)."""
    s, n, q = Sides(model_dir, dtype), args.decode_tokens, workloads.QUESTIONS
    runners = {"none": s.mm}
    for m in args.quant_methods.split(","):
        runners[m] = MMServeRunner.load(
            model_dir, dtype=dtype, max_total_tokens=32768, quantization=m
        )
    res: dict = {k: [] for k in ("hf", "hf_cpu")}
    for rep in range(args.repeats):
        for k, v in zip(("hf", "hf_cpu"), s.hf_decode(1, n), strict=True):
            res[k].append(med(v))
        for name, runner in runners.items():
            s.mm = runner
            c0 = time.process_time()
            first, _, _ = s.mm_first_second(f"{q[0]} ({name} {rep})", q[1])
            res.setdefault(f"{name}_first", []).append(first)
            res.setdefault(f"{name}_first_cpu", []).append(time.process_time() - c0)
            for b in (1, args.batch):
                qs = [f"{q[i % 16]} ({name} {rep}.{i})" for i in range(b)]
                wall, cpu, _ = s.mm_decode(qs, n + 1)
                res.setdefault(f"{name}_b{b}", []).append(med(wall))
                res.setdefault(f"{name}_b{b}_cpu", []).append(med(cpu))
    s.mm = runners["none"]
    out: dict = {"dtype": dtype, "batch": args.batch, "methods": list(runners)}
    out["ms"] = {k: med(v) * 1e3 for k, v in res.items()}
    out["weight_bytes"] = {k: decode_weight_bytes(r.model.decoder) for k, r in runners.items()}
    del s.hf
    bw, bw_cpu = read_bandwidth(int(args.bandwidth_gb * (1 << 30)))
    out.update(bandwidth_gbs=bw / 1e9, bandwidth_cpu_gbs=bw_cpu / 1e9)
    out["bound_ms"] = {k: b / bw * 1e3 for k, b in out["weight_bytes"].items()}
    out["bound_cpu_ms"] = {k: b / bw_cpu * 1e3 for k, b in out["weight_bytes"].items()}
    out["image_sensitivity"] = image_sensitivity(runners, q[0]) if args.image_check else {}
    out["quality"] = {}
    if not args.quality_positions:
        return out
    ids = teacher_tokens(model_dir, args.quality_positions)
    base = runners["none"].model.decoder
    for m, r in runners.items():
        if m != "none":
            out["quality"][m] = agreement(base, r.model.decoder, ids)
    if "int8" in runners:
        i8 = runners["int8"]
        head = i8.model.decoder.lm_head  # the same int8 decoder with the unquantized head
        i8.model.decoder.lm_head = base.lm_head
        out["quality"]["int8, head unquantized"] = agreement(base, i8.model.decoder, ids)
        i8.model.decoder.lm_head = head
    return out


def quant_table(sw: dict) -> str:
    """``--parts quant``: each method against unquantized mmserve, transformers and the
    bound."""
    ms, rows, b = sw["ms"], {}, sw["batch"]
    hf = ms["hf_cpu"]
    for name in sw.get("methods", ["none", "int8"]):
        one = ms[f"{name}_b1_cpu"]
        rows[f"mmserve {name}"] = {
            "b1": f"{ms[f'{name}_b1']:.1f} ({one:.1f})",
            "vs_hf": f"{one / hf:.2f}",
            "bound": f"{sw['bound_ms'][name]:.1f} ({sw['bound_cpu_ms'][name]:.1f})",
            "vs_bound": f"{one / sw['bound_cpu_ms'][name]:.2f}",
            "bb": f"{ms[f'{name}_b{b}']:.1f} ({ms[f'{name}_b{b}_cpu']:.1f})",
            "tps": f"{b * one / ms[f'{name}_b{b}_cpu']:.2f}x",
            "first": f"{ms[f'{name}_first'] / 1e3:.1f} ({ms[f'{name}_first_cpu'] / 1e3:.1f}) s",
            "gb": f"{sw['weight_bytes'][name] / 1e9:.3f}",
        }
    rows["transformers"] = {"b1": f"{ms['hf']:.1f} ({hf:.1f})", "vs_hf": "1.00"}
    cols = f"{sw['dtype']}|batch-1 ms/token (CPU)=b1|CPU vs transformers=vs_hf"
    cols += "|bound ms (CPU)=bound|CPU vs bound=vs_bound"
    cols += f"|batch {b} ms/step (CPU)=bb|batch {b} tokens/s vs batch 1 (CPU)=tps"
    cols += "|first + second question (CPU)=first|decode weight GB=gb"
    lines = [report.table(rows, cols)]
    lines.append(
        f"read bandwidth {sw['bandwidth_gbs']:.1f} GB/s ({sw['bandwidth_cpu_gbs']:.1f} per "
        f"CPU second), measured in the same run; load average {report.loadavg()}"
    )
    wb = sw["weight_bytes"]
    for m in sw.get("methods", ["none", "int8"])[1:]:
        lines.append(f"decoder weight bytes {m} / {sw['dtype']}: {wb[m] / wb['none']:.3f}")
    for k, v in sw["quality"].items():
        lines.append(
            f"{k} vs unquantized over {v['positions']} teacher-forced positions: top-1 "
            f"agreement {v['top1']:.4f}, mean KL {v['kl']:.5f} nats"
        )
    for k, v in sw.get("image_sensitivity", {}).items():
        lines.append(
            f"image sensitivity, {k}: two photos move the first token's logits by "
            f"{v['rel_l2']:.3f} (relative L2), KL {v['kl_between_photos']:.4f} nats, top-1 "
            f"{'differs' if v['top1_differs'] else 'same'}; KL vs unquantized "
            f"{v['kl_vs_none']:.4f} nats"
        )
    return "\n".join(lines)


def compare_table(results: dict[str, dict]) -> str:
    """``--parts compare``: transformers and mmserve per dtype."""
    rows = {}
    for dtype, r in results.items():
        for label, k, unit, x in (
            ("first question (tower + prefill)", "first", "s", 1),
            ("second question, same photo", "second", "s", 1),
            ("decode, batch 1", "decode", "ms/token", 1e3),
            ("decode, batch 1, CPU time", "decode_cpu", "ms/token", 1e3),
        ):
            hf, mm = r[f"hf_{k}"] * x, r[f"mm_{k}"] * x
            rows[f"{label}, {dtype}"] = {"hf": f"{hf:.3g} {unit}", "mm": f"{mm:.3g} {unit}"}
            rows[f"{label}, {dtype}"]["ratio"] = mm / hf
        for suffix, what in (("", "tokens/s"), ("_cpu", "tokens per CPU second")):
            b, one = r["mm_batch_tps" + suffix], r["mm_single_tps" + suffix]
            label = f"{r['batch']} concurrent answers vs batch 1 ({what}), {dtype}"
            rows[label] = {"hf": "-", "mm": f"{b:.1f} vs {one:.1f}", "ratio": f"{b / one:.2f}x"}
    return report.table(rows, "|transformers=hf|mmserve=mm|mmserve / transformers=ratio:.2f")


def decode_table(sweeps: list[dict]) -> str:
    """``--parts decode``: ms per step (CPU in brackets) against the bound, per dtype and
    batch."""
    rows, lines = {}, []
    for sw in sweeps:
        bound, bound_cpu = sw["bound_ms"], sw["bound_cpu_ms"]
        for b, r in sw["batches"].items():
            rows[f"{sw['dtype']}, batch {b}"] = {
                "hf": f"{r['hf']:.1f} ({r['hf_cpu']:.1f})",
                "mm": f"{r['mm']:.1f} ({r['mm_cpu']:.1f})",
                "ratio": f"{r['mm'] / r['hf']:.2f} ({r['mm_cpu'] / r['hf_cpu']:.2f})",
                "per_token": r["mm"] / int(b),
                "bound": f"{bound:.1f} ({bound_cpu:.1f})",
                "of_bound": f"{r['mm'] / bound:.2f} ({r['mm_cpu'] / bound_cpu:.2f})",
            }
        lines.append(
            f"{sw['dtype']}: read bandwidth {sw['bandwidth_gbs']:.1f} GB/s "
            f"({sw['bandwidth_cpu_gbs']:.1f} per CPU second), decode weights "
            f"{sw['weight_bytes'] / 1e9:.3f} GB"
        )
        if d := sw.get("default"):
            lines.append(
                f"default server dtype ({d['dtype']}): batch-1 decode {d['ms']:.1f} ms (CPU "
                f"{d['cpu_ms']:.1f}) vs --dtype {sw['dtype']} {d['explicit_ms']:.1f} (CPU "
                f"{d['explicit_cpu_ms']:.1f}), alternating: {d['ms'] / d['explicit_ms']:.2f}x"
            )
    cols = "dtype, batch|transformers ms/step (CPU)=hf|mmserve ms/step (CPU)=mm"
    cols += "|mmserve / transformers=ratio|mmserve ms/token=per_token:.1f"
    cols += "|bound ms/step (CPU)=bound|mmserve / bound=of_bound"
    return report.table(rows, cols) + "\n".join(lines)


def real_shapes(args: argparse.Namespace, model_dir: str) -> int:
    """``real-shapes``: mmserve against transformers at real shapes."""
    results, sweeps, tables = {}, [], []
    dtypes = args.dtypes.split(",")
    if "compare" in args.parts:
        for dtype in dtypes:
            results[dtype] = compare(model_dir, dtype, args)
            print(f"{dtype}: {results[dtype]}", flush=True)
        tables.append(compare_table(results))
    if "decode" in args.parts:
        for i, dtype in enumerate(dtypes):
            sweeps.append(decode_sweep(model_dir, dtype, args, i == 0))
            print(f"decode {dtype}: {sweeps[-1]}", flush=True)
        tables.append(decode_table(sweeps))
    quants = []
    if "quant" in args.parts:
        for dtype in dtypes:
            quants.append(quant_sweep(model_dir, dtype, args))
            print(f"quant {dtype}: {quants[-1]}", flush=True)
            tables.append(quant_table(quants[-1]))
    table = "\n\n".join(tables)
    out = {"model": model_dir, "threads": torch.get_num_threads(), "results": results}
    out.update(decode=sweeps, quant=quants, table=table)
    return report.emit(args.out, "real_shapes", out, table)
