"""Relative links in the guides (docs/, the benchmarks' READMEs, the chart's README, README.md) point at files
and headings that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "charts/loraplane/README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("bench/**/README.md"),
    ]
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a link-like string in code is not a link)."""
    lines, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in _prose(page).splitlines():
        heading = re.match(r"^#{1,6}\s+(.+?)\s*#*$", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_checker_finds_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# The pods' admin API (the contract)\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#the-pods-admin-api-the-contract) [gone](c.md) [bad](b.md#the-pods-admin-api)\n"
        "```\n[in code](nowhere.md)\n```\n[web](https://example.com)\n"
    )
    assert broken_links(page) == [
        "c.md: no such file",
        "b.md#the-pods-admin-api: no heading #the-pods-admin-api in b.md",
    ]
