"""The documentation holds together: the front page stays short, every relative link in README.md,
docs/*.md and presets/README.md points at a file of the repository (and at a heading that
exists when it names one), and nothing cites a document outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 12288
TEXT_SUFFIXES = {".py", ".md", ".smk", ".yaml", ".sh"}
DOCS = sorted([ROOT / "README.md", ROOT / "presets" / "README.md", *(ROOT / "docs").glob("*.md")])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(h) for h in HEADING.findall(text)}


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return LINK.findall(text)


def test_readme_is_a_front_page():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading '{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_are_all_reachable_from_the_readme():
    files = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    readme_targets = {(ROOT / f).resolve() for f in files if f.endswith(".md")}
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in readme_targets]
    assert not unlisted, f"docs missing from README's map: {unlisted}"


def test_no_document_outside_the_repository_is_cited():
    outside = "DESIGN" + " section"  # spelled in two parts so this file does not match itself
    hits = []
    for folder in ("jagg_pipeline", "tests", "benchmarks", "workflow", "docs", "presets"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in TEXT_SUFFIXES or path.name == Path(__file__).name:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if outside in text or "../shared" in text:
                hits.append(str(path.relative_to(ROOT)))
    for name in ("README.md", "Makefile", "Snakefile", "config.yaml"):
        text = (ROOT / name).read_text(encoding="utf-8")
        if outside in text or "../shared" in text:
            hits.append(name)
    assert not hits, f"cite a document outside the repository: {hits}"
