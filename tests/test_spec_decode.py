"""N-gram speculative decoding (``--speculative ngram``, :mod:`mmserve.engine.spec_decode`):
prompt-lookup drafts, the greedy output token for token the same as without it (logprobs
included) across families, page sizes, chunked prefill and the cache on or off; sampled
tokens that follow the target distribution (chi-square); max_tokens, stop strings, n > 1,
structured output; exact page accounting and a tree that holds no rejected token; the
per-request and per-batch switches; metrics. A "quoting" checkpoint (a tiny random one
edited so that its greedy answer copies a passage of its prompt,
:func:`mmserve.testing.copying.quoting_model`) gives drafts that are accepted."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.engine.ngram import NgramIndex, usable_prefix
from mmserve.engine.spec_decode import accept_greedy, accept_sampled
from mmserve.frontend.frontend import Engine
from mmserve.structured.spec import GuidedSpec
from mmserve.types import SamplingParams
from tests.helpers import (
    QUOTE,
    TINY_FAMILIES,
    ChatDefaults,
    chat_json,
    engine_figures,
    quoting_loaded,
    stream_chunks,
    user,
)

SPEC = {"speculative": "ngram", "num_speculative_tokens": 4}
#: the question quotes the passage, so its answer (the passage) can be looked up
QUESTION = f"Document: {QUOTE} Question: what does the document say? Quote it."


@pytest.fixture(scope="module")
def quoting(families):
    """family -> the tiny checkpoint edited to quote :data:`QUOTE`, made on first use."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            fam = families[family]
            made[family] = quoting_loaded(fam.loaded, fam.model_dir)
        return made[family]

    return get


def engine(families, family: str, model, **cfg) -> Engine:
    return Engine(EngineConfig(model_path=str(families[family].model_dir), **cfg), model=model)


def run(eng: Engine, prompts: list[tuple[str, list]], params: SamplingParams):
    reqs = [
        eng.processor.make_request(messages=user(*parts), images=imgs, params=params)
        for parts, imgs in prompts
    ]
    out = eng.generate(reqs)
    eng.scheduler.check_accounting()
    return out


def assert_same(a, b, what: str) -> None:
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.output_ids == y.output_ids, f"{what} #{k}"
        assert x.finish_reason == y.finish_reason, f"{what} #{k}"
        if x.logprobs is not None:
            assert y.logprobs is not None
            for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
                assert lx.token_id == ly.token_id
                assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4), what
                assert [t for t, _ in lx.top] == [t for t, _ in ly.top], what


def chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value (``len(counts) - 1`` degrees of
    freedom): the upper regularized incomplete gamma ``Q(df / 2, x / 2)``."""
    x = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(x / 2)))


# ---- prompt lookup ------------------------------------------------------------------
def test_ngram_index_drafts_the_longest_suffix_most_recent_continuation() -> None:
    idx = NgramIndex(1, 3)
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    # [1, 2, 3] occurred at the start: its continuation [4, 9, 2]
    assert idx.propose(list(seq), 3) == [4, 9, 2]
    seq += [4, 8, 2, 3]  # longest earlier suffix [2, 3] -> most recent earlier: ..., 2, 3, 4
    assert idx.propose(list(seq), 2) == [4, 8]
    assert idx.propose(list(seq), 0) == []
    assert NgramIndex(2, 2).propose([5, 6, 7, 8], 4) == []  # no repeated bigram
    assert NgramIndex(1, 1).propose([5, 6, 5], 4) == [6, 5]  # may run into the suffix
    assert usable_prefix([3, 4, -7, 5], lambda t: t >= 0) == [3, 4]
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 2)


# ---- acceptance rules ---------------------------------------------------------------
def test_greedy_acceptance_keeps_the_matching_prefix() -> None:
    rows = torch.full((4, 6), -5.0)
    for j, t in enumerate([2, 3, 1, 4]):
        rows[j, t] = 5.0
    assert accept_greedy(rows, [2, 3, 0]) == [2, 3, 1]  # third draft wrong: argmax there
    assert accept_greedy(rows, [2, 3, 1]) == [2, 3, 1, 4]  # all kept plus one more
    assert accept_greedy(rows, [0, 3, 1]) == [2]


def test_sampled_tokens_follow_the_target_distribution_chi_square() -> None:
    """Over many seeds, the first token follows p0, and the second (given the first
    draft kept) follows p1, whatever the draft: rejection sampling with a point-mass
    draft (Leviathan et al. 2023) leaves the target distribution unchanged."""
    torch.manual_seed(0)
    rows = torch.randn(3, 5) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    from mmserve.engine.sampling import sampling_probs

    p = torch.stack([sampling_probs(r, params) for r in rows])
    p = p / p.sum(-1, keepdim=True)
    draft = [int(torch.argsort(p[0])[2]), int(torch.argmax(p[1]))]  # a middling first draft
    N = 6000
    first = torch.zeros(5)
    second = torch.zeros(5)
    for seed in range(N):
        g = torch.Generator().manual_seed(seed)
        out = accept_sampled(rows, draft, lambda r: sampling_probs(r, params), g)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        keep = probs > 0
        assert counts[~keep].sum() == 0  # never a token the target cannot give
        expected = probs[keep] * counts.sum()
        assert chi_square_pvalue(counts[keep], expected) > 1e-3


def test_seeded_sampling_reproduces_with_speculation(families, quoting) -> None:
    model = quoting("llava")
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    prompts = [((QUESTION,), [])]
    a = run(engine(families, "llava", model, **SPEC), prompts, params)
    b = run(engine(families, "llava", model, **SPEC), prompts, params)
    assert a[0].output_ids == b[0].output_ids and len(a[0].output_ids) == 24


# ---- greedy equality ------------------------------------------------------------------
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_and_logprobs_equal_without_speculation(
    families, quoting, photos, family
) -> None:
    fam = families[family]
    img = fam.make_engine().processor.prepare_image(photos["cat.png"])
    prompts = [((QUESTION,), []), ((None, QUESTION), [img]), (("Say something.",), [])]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3)
    configs = [
        {"page_size": 1},
        {"page_size": 16},
        {"page_size": 16, "disable_radix_cache": True},
        {"page_size": 1, "max_prefill_tokens": 16},  # chunked prefill beside verifies
    ]
    for model, label in ((quoting(family), "quoting"), (fam.loaded, "random")):
        base = run(engine(families, family, model), prompts, params)
        for cfg in configs:
            eng = engine(families, family, model, **cfg, **SPEC)
            got = run(eng, prompts, params)
            assert_same(got, base, f"{family} {label} {cfg}")
            if label == "quoting":  # drafts kept and drafts rejected
                s = eng.stats
                assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens
            # a second round hits the cache (when on) and stays equal
            assert_same(run(eng, prompts, params), base, f"{family} {label} {cfg} again")


def test_accepted_drafts_take_fewer_forward_steps(families, quoting) -> None:
    model = quoting("llava")
    params = SamplingParams(max_tokens=32, temperature=0.0)
    off = engine(families, "llava", model)
    on = engine(families, "llava", model, **SPEC)
    a = run(off, [((QUESTION,), [])], params)
    b = run(on, [((QUESTION,), [])], params)
    assert a[0].output_ids == b[0].output_ids
    ids = families["llava"].loaded.tokenizer.encode(QUOTE, add_special_tokens=False)
    assert b[0].output_ids[:8] == ids[:8]  # it quotes the passage (up to a repeated word)
    s = on.stats
    assert s.spec_accepted_tokens >= 16 and s.spec_drafted_tokens >= s.spec_accepted_tokens
    assert s.decode_steps <= off.stats.decode_steps - s.spec_accepted_tokens
    figures = on.cache_stats()
    assert figures["spec_accepted_length"] == pytest.approx(
        1 + s.spec_accepted_tokens / s.spec_verifies
    )
    assert figures["spec_drafted_tokens"] == s.spec_drafted_tokens


def test_cuda_graph_twin_verifies_eagerly(families, quoting) -> None:
    """With the padded decode runner (the CPU twin of CUDA graphs) on, verify steps run
    eagerly beside it and the output is the same."""
    model = quoting("llava")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [((QUESTION,), []), (("Say something.",), [])]
    base = run(engine(families, "llava", model, cuda_graph_twin=True), prompts, params)
    eng = engine(families, "llava", model, cuda_graph_twin=True, **SPEC)
    assert eng.runner.graphs is not None
    assert_same(run(eng, prompts, params), base, "twin")
    assert eng.stats.spec_steps > 0


# ---- limits, stop strings, structured output ------------------------------------------------
def test_max_tokens_and_stop_strings_hold(families, quoting) -> None:
    model = quoting("llava")
    off, on = engine(families, "llava", model), engine(families, "llava", model, **SPEC)
    for m in (1, 2, 3, 5, 6, 11):
        p = SamplingParams(max_tokens=m, temperature=0.0, logprobs=0)
        a, b = run(off, [((QUESTION,), [])], p), run(on, [((QUESTION,), [])], p)
        assert len(b[0].output_ids) == m and b[0].finish_reason == "length"
        assert_same(b, a, f"max_tokens {m}")
    for stop in ("brown f", "jumps", "mat. warm"):
        p = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
        a, b = run(off, [((QUESTION,), [])], p), run(on, [((QUESTION,), [])], p)
        assert b[0].text == a[0].text and stop not in b[0].text and b[0].finish_reason == "stop"
        assert b[0].output_ids == a[0].output_ids
    assert on.stats.spec_accepted_tokens > 0


def test_structured_requests_decode_without_drafts(families, quoting) -> None:
    model = quoting("llava")
    p = SamplingParams(max_tokens=12, temperature=0.0, guided=GuidedSpec("regex", "[a-z ]{3,9}"))
    on = engine(families, "llava", model, **SPEC)
    a = run(engine(families, "llava", model), [((QUESTION,), [])], p)
    b = run(on, [((QUESTION,), [])], p)
    assert b[0].output_ids == a[0].output_ids and b[0].text == a[0].text
    assert on.stats.spec_verifies == 0  # turned off for grammar requests


# ---- pages and the tree -------------------------------------------------------------------
def tree_sequences(tree) -> list[list[int]]:
    """Every root-to-node token sequence of a radix tree."""
    out, stack = [], [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            seq = prefix + list(child.key)
            out.append(seq)
            stack.append((child, seq))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_exact_and_tree_holds_no_rejected_token(families, quoting, page_size) -> None:
    """Many requests, greedy (mostly accepted) and sampled (often rejected), in a small
    pool: after them no page is leaked and every sequence in the tree is a prefix of a
    request's prompt and output (the pool is small enough to retract)."""
    model = quoting("llava")
    eng = engine(
        families, "llava", model, page_size=page_size, max_total_tokens=640,
        speculative_max_batch=16, **SPEC,
    )  # fmt: skip
    reqs = []
    for k in range(10):
        t = 0.0 if k % 2 == 0 else 1.5
        params = SamplingParams(max_tokens=8 + 3 * k, temperature=t, seed=k)
        q = QUESTION if k % 3 else f"{QUOTE} {QUOTE} again {k}"
        reqs.append(eng.processor.make_request(messages=user(q), images=[], params=params))
    res = eng.generate(reqs)
    s = eng.stats
    assert s.spec_accepted_tokens > 0 and s.spec_drafted_tokens > s.spec_accepted_tokens
    acc = eng.scheduler.check_accounting()
    assert acc["running"] == 0 and acc["free"] + acc["tree"] == acc["total"]
    seqs = [list(r.input_ids) + list(o.output_ids) for r, o in zip(reqs, res, strict=True)]
    for path in tree_sequences(eng.tree):
        assert any(s[: len(path)] == path for s in seqs), path
    assert eng.stats_snapshot()["accounting"]["ok"]


# ---- the switches ------------------------------------------------------------------------
def test_turns_off_for_low_acceptance_and_large_batches(families, quoting) -> None:
    model = quoting("llava")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [((QUESTION,), [])]
    # more than k = 4 kept per verify cannot be: off after the window of 2 verifies
    eng = engine(
        families, "llava", model, speculative_min_accepted=5.0, speculative_window=2, **SPEC
    )
    run(eng, prompts, params)
    assert eng.stats.spec_requests_off == 1 and eng.stats.spec_verifies == 2
    big = engine(families, "llava", model, speculative_max_batch=2, **SPEC)
    run(big, prompts * 3, params)
    assert big.stats.spec_batch_off_steps > 0
    assert big.stats.spec_verifies == 0  # three decode together: never speculated


def test_config_is_validated_with_clear_errors() -> None:
    for kw, words in (
        ({"speculative": "eagle"}, "--speculative 'eagle'"),
        ({"num_speculative_tokens": 0}, "--num-speculative-tokens"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min 3, ngram_max 2"),
        ({"speculative_max_batch": 0}, "--speculative-max-batch"),
        ({"speculative_min_accepted": -1.0}, "--speculative-min-accepted"),
    ):
        with pytest.raises(ValueError, match=words.replace("'", ".")):
            EngineConfig(**kw).validate()
    EngineConfig(**SPEC).validate()


# ---- through the API ---------------------------------------------------------------------
def test_api_answers_equal_and_metrics_report_speculation(families, quoting) -> None:
    """n > 1, logprobs, stop strings, streaming and JSON output through
    ``/v1/chat/completions`` give the same answers with speculation on; ``/metrics``
    reports drafted and accepted tokens and the accepted length."""
    from tests.live_server import app_client

    model = quoting("llava")
    bodies = [
        {"max_tokens": 20, "logprobs": True, "top_logprobs": 2},
        {"max_tokens": 20, "n": 2, "temperature": 0},
        {"max_tokens": 30, "stop": ["mat."]},
        {"max_tokens": 12, "response_format": {"type": "json_object"}},
    ]
    answers = {}
    for spec in ("off", "ngram"):
        eng = engine(families, "llava", model, speculative=spec)
        with app_client(eng) as client:
            got = []
            for body in bodies:
                out = chat_json(client, QUESTION, **body)
                got.append([(c["message"]["content"], c["finish_reason"]) for c in out["choices"]])
                if "logprobs" in body:
                    got.append([c["logprobs"] for c in out["choices"]])
            streamed = stream_chunks(client, ChatDefaults(QUESTION, 16).body())
            got.append("".join(c["choices"][0]["delta"].get("content") or "" for c in streamed))
            answers[spec] = got
            text = client.get("/metrics").text
            accepted = engine_figures(client)["spec_accepted_tokens"]
        if spec == "ngram":
            assert accepted > 0
            name = "mmserve_spec_decode_accepted_tokens_total "
            line = next(x for x in text.splitlines() if x.startswith(name))
            assert float(line.split()[-1]) == accepted
            assert "mmserve_spec_decode_accepted_length " in text
    assert answers["ngram"][:1] == answers["off"][:1]
    off_lp, on_lp = answers["off"][1][0]["content"], answers["ngram"][1][0]["content"]
    for a, b in zip(off_lp, on_lp, strict=True):
        assert a["token"] == b["token"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert answers["ngram"][2:] == answers["off"][2:]
    assert len(answers["ngram"][2]) == 2  # n = 2
    assert answers["ngram"][3][0][1] == "stop" and "mat." not in answers["ngram"][3][0][0]


def test_kv_host_tier_holds_only_kept_tokens(families, quoting) -> None:
    """With a host KV tier behind a pool too small for the workload, pages evicted to the
    tier and loaded back give the answers of speculation off (a rejected token's K/V in
    a tier page would change them)."""
    model = quoting("llava")
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    prompts = [((f"Variant {k}. {QUESTION}",), []) for k in range(4)]
    cfg = {"page_size": 4, "max_total_tokens": 256, "kv_host_bytes": 64 << 20}
    base = run(engine(families, "llava", model, **cfg), prompts, params)
    eng = engine(families, "llava", model, **cfg, **SPEC)
    for _ in range(2):  # the second pass loads evicted pages back from the host tier
        for p in prompts:
            got = run(eng, [p], params)
            assert_same(got, [base[prompts.index(p)]], f"tier {p}")
    figures = eng.cache_stats()
    assert figures["tier_host_hit_tokens"] > 0 and eng.stats.spec_accepted_tokens > 0
