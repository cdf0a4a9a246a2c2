"""Every relative link of README.md and docs/*.md resolves: the file it names exists and its ``#anchor`` is a heading
of that file (GitHub's anchors: the heading's text lower-cased, punctuation but ``-`` and ``_`` dropped, spaces as
``-``, a repeated heading numbered ``-1``, ``-2`` ...). Links inside code (fenced blocks, backticks) are not links."""
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                               if name.endswith(".md"))
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)


def without_blocks(text):
    """``text`` with each fenced code block blanked (its lines kept, so line numbers stay)."""
    return FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def prose(text):
    """``text`` without its fenced code blocks and inline code spans (what Markdown does not read as links)."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def anchor(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor of the Markdown file at ``path``: its headings' (outside code blocks) and explicit ids."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    found, seen = set(), {}
    for line in without_blocks(text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return found


def links(page):
    """(line, target) of every relative link of ``page`` (a path under the repository)."""
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        text = prose(handle.read())
    return [(text[:match.start()].count("\n") + 1, match.group(1)) for match in LINK.finditer(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", match.group(1))]  # http:, https:, mailto: are not ours


def broken(page):
    """The links of ``page`` that do not resolve, each as 'page:line: target (why)'."""
    problems = []
    for line, target in links(page):
        path, _, fragment = target.partition("#")
        file = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path)) if path else os.path.join(REPO, page)
        if not os.path.exists(file):
            problems.append(f"{page}:{line}: {target} (no such file)")
        elif fragment and file.endswith(".md") and fragment not in anchors(file):
            problems.append(f"{page}:{line}: {target} (no heading with that anchor)")
    return problems


def test_the_pages_have_links_to_check():
    assert len(PAGES) > 10
    assert sum(len(links(page)) for page in PAGES) > 50  # the scan sees the links
    assert sum(1 for page in PAGES for _, target in links(page) if "#" in target) > 10  # and their anchors


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken(page), broken(page)


def test_a_missing_file_or_anchor_is_found(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Linear's GEMM: `rows`\n\n## Twice\n\n## Twice\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#linears-gemm-rows) [second](docs/a.md#twice-1) [top](#readme) [web](https://x.org/y#z)\n"
        "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n"
        "[gone](docs/b.md) [no anchor](docs/a.md#rows) [third](docs/a.md#twice-2)\n\n# README\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    assert broken("README.md") == ["README.md:6: docs/b.md (no such file)",
                                   "README.md:6: docs/a.md#rows (no heading with that anchor)",
                                   "README.md:6: docs/a.md#twice-2 (no heading with that anchor)"]
