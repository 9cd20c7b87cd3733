"""Every ```python block of README.md and docs/*.md runs (the tour must not rot).

Blocks fenced as ```py are illustrations that need a launcher (torchrun) or
the user's own objects; they are not executed. Every relative link of those
pages points to a file or folder of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


BLOCKS = [
    (page.relative_to(ROOT).as_posix(), index, block)
    for page in PAGES
    for index, block in enumerate(_python_blocks(page))
]
# [text](target) and ![alt](target); the target ends at ")" or a space (a title).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def test_readme_has_runnable_examples():
    assert len(_python_blocks(README)) >= 6


def test_docs_pages_exist():
    assert len(PAGES) > 1, "docs/*.md pages are missing"


@pytest.mark.parametrize(
    ("name", "index", "block"), BLOCKS, ids=[f"{name}[{index}]" for name, index, _ in BLOCKS]
)
def test_readme_block_runs(name, index, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # plots and reports land in a scratch folder
    exec(compile(block, f"{name}[python block {index}]", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_point_to_files(page):
    targets = [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]
    assert targets or page != README, "no relative link found: the link pattern is broken"
    missing = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
