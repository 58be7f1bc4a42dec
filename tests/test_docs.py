"""The README stays a short front page, the rest lives in docs/, and every relative link in them leads to a file."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)  # fenced code blocks, indented ones (in lists) too
CODE = re.compile(r"`[^`\n]*`")  # inline code
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target) and ![alt](target)


def relative_links(page: Path) -> list[str]:
    """The targets of the page's markdown and image links, outside code, less web links and pure #anchors."""
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def test_the_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines: move detail into a page under docs/"


def test_docs_has_at_least_4_pages():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert len(pages) >= 4, f"docs/ has {pages}"


def test_the_link_finder_sees_links_and_skips_code():
    assert relative_links(README)  # the README links into docs/
    assert relative_links(DOCS / "worked-example.md")  # its pictures


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_file(page):
    broken = []
    for target in relative_links(page):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


LAYOUT_ROOTS = ("foundation", "topology", "partition", "mobiuspipe", "scripts")
"""The folders whose every module docs/layout.md's tree names (cli/ as a whole: one module per subcommand)."""


def test_the_layout_tree_names_every_module():
    """A module added without its line in docs/layout.md's tree fails here: the tree is where a newcomer looks."""
    page = (DOCS / "layout.md").read_text()
    tree = page.split("## Layout", 1)[1].split("```", 2)[1]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tree))
    missing = []
    for root in LAYOUT_ROOTS:
        for f in sorted((ROOT / root).rglob("*.py")):
            rel = f.relative_to(ROOT)
            if f.name == "__init__.py" or "cli" in rel.parts[:-1] or f.stem.startswith("bench_"):
                continue
            if f.stem not in words:
                missing.append(str(rel))
    assert not missing, f"docs/layout.md's tree does not name: {', '.join(missing)}"
