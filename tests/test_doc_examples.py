"""Documented commands are run: the fenced ```bash and ```python blocks of README.md,
docs/api.md and docs/video.md marked with ``<!-- doctest -->`` on the line before, against a
live ``mmserve serve`` on the tiny model (127.0.0.1, bounded time). A renamed route,
flag, field or model name then fails here, not for a reader. CONTRIBUTING.md says how to
mark a block and what it may assume."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    DOC_PAGES,
    DOCTEST_MARKER,
    ROOT,
    doc_examples,
    output_shape_problems,
    run_doc_examples,
)
from tests.live_server import live_server

#: the name the docs' examples use: the bundled model's directory name
DOC_MODEL = "llava-tiny-seed0"


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    with live_server(model_dir, "--served-model-name", DOC_MODEL, timeout=180) as url:
        yield url


def test_marked_blocks_are_extracted_and_missing_pages_skipped(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n"
        f"{DOCTEST_MARKER}\n```bash\ncurl -s x\n```\n"
        "```python\nprint('not marked')\n```\n"
        f"{DOCTEST_MARKER}\n```python doctest\nimport os\n\nos.getcwd()\n```\n"
    )
    found = doc_examples([page, tmp_path / "missing.md"])
    assert [(e.where, e.lang, e.code) for e in found] == [
        ("page.md:3", "bash", "curl -s x\n"),
        ("page.md:10", "python", "import os\n\nos.getcwd()\n"),
    ]
    page.write_text(f"{DOCTEST_MARKER}\n\n```bash\ntrue\n```\n")  # not right before
    with pytest.raises(ValueError, match="page.md:1"):
        doc_examples([page])
    page.write_text(f"{DOCTEST_MARKER}\n```bash\ntrue\n")
    with pytest.raises(ValueError, match="never closed"):
        doc_examples([page])


def test_output_shape_is_keys_and_spelled_out_strings() -> None:
    code = 'curl -s x   # {"id":"img-…","object":"image","sizes":{"low":576}}\n'
    printed = '{"id":"img-1","object":"image","sizes":{"low":1,"high":2},"extra":1}'
    assert output_shape_problems(code, printed) == []
    assert output_shape_problems(code, printed.replace('"low"', '"small"'))  # a key gone
    assert output_shape_problems(code, printed.replace('"image"', '"video"'))  # a value
    assert output_shape_problems(code, "not json")
    ndjson = '{"type":"frames"}\n{"type":"answer","text":"x"}\n'
    both = '# {"type":"frames",…}\n# {"type":"answer","text":…}\n'
    assert output_shape_problems(both, ndjson) == []


def test_documented_examples_run_against_a_live_server(server: str) -> None:
    examples = doc_examples(DOC_PAGES)
    readme = [e for e in examples if e.path.name == "README.md"]
    # the first request: upload a photo, ask about it (curl, openai client), the cache
    assert len(readme) >= 4 and {e.lang for e in readme} == {"bash", "python"}
    assert "cached_tokens" in "\n".join(e.code for e in readme)
    assert len(examples) >= 18 and {e.path.name for e in examples} == {p.name for p in DOC_PAGES}
    codes = "\n".join(e.code for e in examples)
    assert "samples/ask.py" in codes and "/ask" in codes and "responses.create" in codes
    assert run_doc_examples(examples, server) == []


def test_a_broken_copy_of_the_api_reference_fails(server: str, tmp_path: Path) -> None:
    page = ROOT / "docs" / "api.md"
    text = page.read_text()
    breaks = [
        # a renamed route (bash): curl exits 22 on the 404
        ("/v1/images/img-caf8…/ask -H", "/v1/images/img-caf8…/asks -H"),
        # a wrong model name (python): the Responses example as it once was
        (
            'create(\n    model="llava-tiny-seed0",\n    instructions',
            'create(\n    model="llava",\n    instructions',
        ),
        # output the doc shows that the server does not print
        ('"num_image_tokens_by_detail":{"auto"', '"num_image_tokens_by_view":{"auto"'),
    ]  # fmt: skip
    for old, new in breaks:  # the first place each appears: a marked block
        assert old in text, old
        text = text.replace(old, new, 1)
    broken = tmp_path / "api.md"
    broken.write_text(text)
    good = {(e.line, e.code) for e in doc_examples([page])}
    changed = [e for e in doc_examples([broken]) if (e.line, e.code) not in good]
    assert len(changed) == 3
    # the changed blocks, and the Python blocks before them that define client and image
    run = [e for e in doc_examples([broken]) if e in changed or e.lang == "python"]
    failures = run_doc_examples(run, server)
    by_where = {f.split(": ", 1)[0]: f for f in failures}
    assert sorted(by_where) == sorted(e.where for e in changed), failures
    shape, route, model = (by_where[e.where] for e in sorted(changed, key=lambda e: e.line))
    assert "exit 22" in route and "not_found_error" in route  # curl --fail-with-body
    assert "NotFoundError" in model and "llava" in model
    assert "num_image_tokens_by_view" in shape
