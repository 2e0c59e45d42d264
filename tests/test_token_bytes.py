"""Raw bytes of tokens (the logprobs ``bytes`` field) against each family's own decoder."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders
from transformers import AutoTokenizer

from mmserve.frontend.token_bytes import TokenBytes, token_bytes, token_string
from tests.helpers import TINY_FAMILIES

#: Text heavy on characters that byte-fallback and byte-level tokens split.
ALPHABET = st.one_of(
    st.sampled_from(list("北京在线中文字 \n\t.,!é😀🎉👍🏽Ωñ")),
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
)
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tok(request, families):
    """Each family's tiny tokenizer: llava (byte-level BPE), next (SentencePiece with byte
    fallback), onevision (Qwen2-style byte-level BPE)."""
    return AutoTokenizer.from_pretrained(families[request.param].model_dir)


def sentencepiece_variants(next_model_dir):
    """The SentencePiece tokenizer with the other decoders real Llama-family checkpoints
    carry: no Strip (Gemma-like: the first word keeps its space), and a Metaspace decoder
    (older Llama conversions)."""
    base = AutoTokenizer.from_pretrained(next_model_dir)
    no_strip = copy.deepcopy(base)
    no_strip.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    metaspace = copy.deepcopy(base)
    metaspace.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581", prepend_scheme="first")]
    )
    return [no_strip, metaspace]


def lossy_text(tok, table: TokenBytes, ids: list[int]) -> str:
    """The text the tokenizer's decoder makes of the raw bytes (the reference model):
    byte-level BPE replaces invalid UTF-8 as Python's ``errors="replace"`` does; the
    SentencePiece ByteFallback decoder turns a run of byte tokens that is not valid UTF-8
    into one U+FFFD per byte (a run goes on across skipped special tokens)."""
    parts = table.text_bytes(ids)
    pieces = [(i, b) for i, b in zip(ids, parts, strict=True) if i not in table.skipped]
    byte_ids = {i for t, i in tok.get_vocab().items() if t.startswith("<0x") and len(t) == 6}
    if not byte_ids:
        return b"".join(b for _, b in pieces).decode(errors="replace")
    out, run = [], b""
    for i, b in pieces:
        if i in byte_ids:
            run += b
            continue
        out.append(_run_text(run))
        run = b""
        out.append(b.decode())
    out.append(_run_text(run))
    return "".join(out)


def _run_text(run: bytes) -> str:
    try:
        return run.decode()
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


@SETTINGS
@given(text=st.text(ALPHABET, max_size=40), specials=st.booleans())
def test_bytes_of_encoded_text_join_to_its_decoding(tok, text: str, specials: bool) -> None:
    table = token_bytes(tok)
    ids = tok.encode(text, add_special_tokens=specials)
    parts = table.text_bytes(ids)
    assert b"".join(parts) == tok.decode(ids, skip_special_tokens=True).encode()
    for b in parts:
        assert b"\xef\xbf\xbd" not in b or "\ufffd" in text  # never U+FFFD for a byte


@SETTINGS
@given(data=st.data())
def test_bytes_of_any_ids_give_the_decoders_text(tok, data) -> None:
    # any id sequence, invalid UTF-8 included: the decoder's text is the raw bytes with
    # its own replacement rule, so no byte was lost or invented
    table = token_bytes(tok)
    multibyte = sorted({i for s in ("北京在线", "😀🎉", "café ñ") for i in tok.encode(s)})
    pool = st.one_of(
        st.integers(0, len(tok) - 1),
        st.sampled_from(sorted(tok.all_special_ids)),
        st.sampled_from(multibyte),
    )
    ids = data.draw(st.lists(pool, max_size=30), label="ids")
    assert lossy_text(tok, table, ids) == tok.decode(ids, skip_special_tokens=True)


def test_other_sentencepiece_decoders(families) -> None:
    for tok in sentencepiece_variants(families["llava-next"].model_dir):
        table = TokenBytes(tok)
        for text in ["北京 hello 😀 world", " two  spaces", "é", "a\nb"]:
            ids = tok.encode(text, add_special_tokens=True)
            want = tok.decode(ids, skip_special_tokens=True).encode()
            assert b"".join(table.text_bytes(ids)) == want, (tok.backend_tokenizer.decoder, text)


def test_known_tokens(families) -> None:
    sp = AutoTokenizer.from_pretrained(families["llava-next"].model_dir)
    table = token_bytes(sp)
    assert token_bytes(sp) is table  # built once per tokenizer
    ids = sp.encode("北", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(ids) == ["\u2581", "<0xE5>", "<0x8C>", "<0x97>"]
    assert [table.raw(i) for i in ids] == [b" ", b"\xe5", b"\x8c", b"\x97"]
    assert table.text_bytes(ids) == [b"", b"\xe5", b"\x8c", b"\x97"]  # decoding drops the space
    hello = sp.convert_tokens_to_ids("\u2581he")
    assert table.raw(hello) == b" he" and table.at(hello, first=True) == b"he"
    assert table.raw(sp.eos_token_id) == b"" and sp.eos_token_id in table.skipped
    assert table.special_text[sp.eos_token_id] == "</s>"
    bl = AutoTokenizer.from_pretrained(families["llava-onevision"].model_dir)
    table = token_bytes(bl)
    ids = bl.encode("😀 ok", add_special_tokens=False)
    assert b"".join(table.text_bytes(ids)) == "😀 ok".encode()
    assert table.raw(bl.convert_tokens_to_ids("\u0120")) == b" "  # GPT-2's "Ġ" is a space
    assert table.at(bl.convert_tokens_to_ids("\u0120"), first=True) == b" "  # kept
    assert table.raw(bl.convert_tokens_to_ids("<|im_end|>")) == b""


def test_token_string() -> None:
    assert token_string(b" he") == " he"
    assert token_string("北".encode()) == "北"
    assert token_string(b"\xe5\x8c") == "bytes:\\xe5\\x8c"
    assert token_string(b" \xf0") == "bytes:\\x20\\xf0"
    assert token_string(b"") == ""


class WithoutRustDecoder:
    """``tok`` seen as a tokenizer without a ``tokenizers`` backend (a Python one): only
    token strings, ``decode`` and the added tokens."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.added_tokens_decoder = tok.added_tokens_decoder

    def __len__(self) -> int:
        return len(self._tok)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_token_strings_alone_give_the_same_table(tok) -> None:
    # without a Rust decoder to read, the kind (byte-level or SentencePiece) is judged
    # from the token strings; the table must come out the same
    fast, slow = token_bytes(tok), TokenBytes(WithoutRustDecoder(tok))
    assert [slow.raw(i) for i in range(len(tok))] == [fast.raw(i) for i in range(len(tok))]
