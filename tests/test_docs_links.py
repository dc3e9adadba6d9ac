"""The Markdown documentation points only at files that exist, inside the repository.

Checks README.md, CHANGELOG.md, docs/*.md and benchmarks/README.md: every relative link
``[text](path)`` resolves (from the file's folder) to a file or folder of the repository, every
repository path quoted in backticks (``docs/...``, ``tests/...``, ``benchmarks/...``, ...) exists,
and nothing names a location outside the repository.
"""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "README.md",
                *(REPO / "docs").glob("*.md")])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
QUOTED_PATH = re.compile(r"`((?:docs|tests|benchmarks|python|examples|tools|\.ci)/[A-Za-z0-9_./-]+)`")
OUTSIDE = re.compile(r"/work/|\.\./shared|\bshared/gpu\b")


def _code_free(text: str) -> str:
    """``text`` without fenced code blocks (commands there may name files they create)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_code_free(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists() or REPO not in (path, *path.parents):
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_quoted_paths_exist(page):
    text = _code_free(page.read_text())
    missing = [p for p in QUOTED_PATH.findall(text) if not (REPO / p.rstrip("/")).exists()]
    assert not missing, f"{page.name}: names missing paths {missing}"
    assert not OUTSIDE.findall(page.read_text()), f"{page.name} names a location outside the repository"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"
