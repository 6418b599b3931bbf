"""README.md and docs/: links that resolve, anchors the code cites, a short front page, no dates outside history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A citation of a docs page by topic in code: `docs/<page>.md#<anchor>`.
CITATION = re.compile(r"docs/([\w/-]+\.md)#([\w-]+)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:2024|2025|2026|2027)\b|\b(?:January|February|March|April|June|July|"
                  r"August|September|October|November|December)\b")


def _prose(text: str) -> str:
    """The text outside fenced code blocks, where a link is a link."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _broken(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{page.relative_to(REPO)}: {target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{page.relative_to(REPO)}: {target}: no heading #{anchor} in {dest.relative_to(REPO)}"
    return None


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            problem = _broken(page, target)
            if problem:
                broken.append(problem)
    assert not broken, "\n".join(broken)


# A file of the repository named in a page's text, e.g. `gnnray/train/loop.py` or bench/results/x.json.
NAMED_PATH = re.compile(r"(?<![\w./-])((?:gnnray|bench|docs|tests|jobs)/[\w./-]*\w\.(?:py|md|json|sh|yaml))\b")


@pytest.mark.parametrize("page", [p for p in PAGES if "history" not in p.parts], ids=lambda p: p.name)
def test_files_a_page_names_exist(page):
    missing = sorted({name for name in NAMED_PATH.findall(page.read_text())
                      if not (REPO / name).exists() and not (page.parent / name).exists()})
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_the_data_path_is_told_once_in_the_readme():
    """The README's "What runs where" tells a batch's path; the pages that once retold it link to it."""
    for path in (DOCS / "running.md", DOCS / "performance.md", REPO / "gnnray" / "__init__.py"):
        assert "README.md#what-runs-where" in path.read_text(), f"{path.name} does not link the README's data path"
    assert "what-runs-where" in anchors(REPO / "README.md")


def test_code_cites_docs_by_anchors_that_exist():
    cited, broken = 0, []
    for folder in ("gnnray", "jobs", "bench", "tests", ".ci"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix not in (".py", ".sh", ".yaml", "") or not path.is_file():
                continue
            for page, anchor in CITATION.findall(path.read_text(errors="replace")):
                cited += 1
                if not (DOCS / page).exists() or anchor not in anchors(DOCS / page):
                    broken.append(f"{path.relative_to(REPO)}: docs/{page}#{anchor}")
    assert cited, "no code cites docs/<page>.md#<anchor>: the pattern no longer matches"
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the manual part to docs/"
    first = "\n".join(lines[:120])
    for must in ("pip install -q -e . && .venv/bin/python jobs/train_arxiv.py", "## The supported stack",
                 "## What runs where", "sampler actors", "train worker", "loss"):
        assert must in first, f"{must!r} is not in README.md's first 120 lines"
    text = "\n".join(lines)
    # The README is read on any machine: no path that exists only beside this repository's CI.
    assert "../shared" not in text, "README.md names ../shared, which exists only beside this repository's CI"
    watch = text.partition("## Watching a run")[2].partition("\n## ")[0]
    for must in ("*Jobs*", "*Train*", "Metrics", "ray job logs"):
        assert must in watch, f"README.md's 'Watching a run' does not say {must}"


@pytest.mark.parametrize("page", [p for p in PAGES if "history" not in p.parts], ids=lambda p: p.name)
def test_no_dates_outside_history(page):
    dated = [f"{page.name}:{i}: {line.strip()[:100]}" for i, line in enumerate(page.read_text().splitlines(), 1)
             if DATE.search(line)]
    assert not dated, "dated entries belong in docs/history/:\n" + "\n".join(dated)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_blocks_are_closed(page):
    fences = [line for line in page.read_text().splitlines() if re.match(r"\s*```", line)]
    assert len(fences) % 2 == 0, f"{page.name}: a code block is not closed, the text after it renders as code"


def test_docs_hold_no_raw_json():
    assert not list(DOCS.rglob("*.json")), "raw benchmark JSON lives in bench/results/"
