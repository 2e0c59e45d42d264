"""Every relative link of the documentation resolves: README.md, the pages in docs/ and
benchmarks/README.md point at files that exist and, after a ``#``, at a heading of that
file (GitHub's anchor rule). README.md stays a landing page: at most 15 KB, linking to
each reference page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the pages whose links are checked (CONTRIBUTING.md and CHANGELOG.md when present)
PAGES = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")]
    + [p for p in (ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md") if p.exists()]
)
#: the reference pages README.md must link to
REFERENCE = ("api.md", "video.md", "models.md", "deployment.md", "web-page.md", "architecture.md")
README_MAX_BYTES = 15_000

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (links there are code)."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading's text: lower case, punctuation other than
    ``-`` and ``_`` dropped, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (outside code), with GitHub's ``-1``, ``-2``
    suffixes for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.+)$", line)
        if m:
            a = _anchor(m.group(1))
            n = seen.get(a, 0)
            found.add(a if n == 0 else f"{a}-{n}")
            seen[a] = n + 1
    return found


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file or heading does not exist, as ``target: why``."""
    problems = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Tensor parallelism (`--tp N`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#tensor-parallelism---tp-n) [ok](#a-title)\n"
        "# A title\n"
        "[web](https://example.com/x) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#tensor-parallelism) ![img](pic.png)\n"
    )
    assert broken_links(page) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        "other.md#tensor-parallelism: no heading #tensor-parallelism in other.md",
        f"pic.png: no file {tmp_path / 'pic.png'}",
    ]


def test_readme_is_a_landing_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES
    for page in REFERENCE:
        assert f"](docs/{page})" in readme, page
        assert (ROOT / "docs" / page).exists(), page
