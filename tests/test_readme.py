"""The README stays a README: its two set-up commands at the top (CI runs its test command), at most 300
lines, and every relative link in it and in docs/ leads to a file (and a heading) that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 300

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(lang, body.rstrip("\n")) for lang, body in FENCE.findall(text)]


def test_readme_opens_with_the_two_setup_commands():
    blocks = code_blocks(README.read_text())
    (lang1, run), (lang2, test) = blocks[:2]
    assert lang1 == lang2 == "bash"
    assert run.startswith("python3 -m venv .venv && ") and "pip install -q -e ." in run and " specdecode " in run
    assert test.startswith("python3 -m venv .venv && ") and 'pip install -q -e ".[test]"' in test and "pytest" in test
    assert "\n" not in test  # one command line, as .ci/run holds it


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = code_blocks(README.read_text())[1][1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()


def test_readme_fits_its_line_budget():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor (a repeated heading gets -1, -2, ... as on GitHub), code blocks left out."""
    found, counts = set(), {}
    for line in FENCE.sub("", markdown).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = counts.get(base, 0)
            found.add(f"{base}-{n}" if n else base)
            counts[base] = n + 1
    return found


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file (code left out) whose file, or whose #anchor's heading, is missing."""
    text = path.read_text()
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{path.name}: {target} (no such file)")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text())):
            problems.append(f"{path.name}: {target} (no such heading)")
    return problems


def documents() -> list[Path]:
    """The README, the docs pages and the changelog."""
    return [README, *sorted((ROOT / "docs").glob("*.md")), *ROOT.glob("CHANGELOG.md")]


def test_every_relative_link_resolves():
    assert len(documents()) >= 4  # the README and the docs pages
    assert [p for d in documents() for p in broken_links(d)] == []


def test_control_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, with punctuation\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-punctuation) [gone](missing.md) [bad](other.md#not-a-heading)\n"
                    "[self](#title) [web](https://example.com/x) `[code](nowhere.md)`\n\n# Title\n")
    assert broken_links(page) == ["page.md: missing.md (no such file)",
                                  "page.md: other.md#not-a-heading (no such heading)"]


def test_slugs_follow_github():
    assert slug("Check your own settings: `specdecode audit`") == "check-your-own-settings-specdecode-audit"
    assert slug("Requests that repeat earlier ones: the suffix drafter's history") == \
        "requests-that-repeat-earlier-ones-the-suffix-drafters-history"
    assert anchors("# Notes\n## Notes\n") == {"notes", "notes-1"}
