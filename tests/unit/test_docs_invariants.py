"""The docs a newcomer reads hold to the code (issue 47, item 5): design.md's "Invariants by name"
names, for each rule and invariant, tests that exist and that its own paragraph names too; and
every page opens, under its title, with who it is for and what it answers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
INDEX = "## Invariants by name"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENTRY = re.compile(r"- \[\*\*(?P<name>.+?)\*\*\]\(#(?P<anchor>[\w-]+)\)(?P<note>[^:]*): (?P<checks>.+)")
TEST = re.compile(r"tests/[\w/]+\.py::test_\w+")
ITEM = re.compile(r"(- |\d+\. )?\*\*")  # where a named rule or invariant begins: a bold name, in a list or not
HEADING = re.compile(r"(#{1,6}) (.*)")


@dataclass(frozen=True)
class Entry:
    name: str
    anchor: str
    tests: tuple[str, ...]
    untested: bool  # the entry says "no test" (for all of it, or for a part)


def anchor(heading: str) -> str:
    """GitHub's heading anchor, as tests/unit/test_docs.py reads it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def index_entries(text: str) -> list[Entry]:
    """The entries of design.md's index: one a line, ``- [**NAME**](#ANCHOR) NOTE: TESTS or no test``."""
    section = text.split(INDEX + "\n", 1)[1].split("\n## ", 1)[0]
    entries = []
    for line in section.splitlines():
        if not line.startswith("- "):
            continue
        m = ENTRY.fullmatch(line)
        assert m, f"an index line not in the form '- [**NAME**](#ANCHOR): TESTS': {line!r}"
        checks = m["checks"]
        entries.append(Entry(m["name"], m["anchor"], tuple(TEST.findall(checks)), "no test" in checks.lower()))
    return entries


def body_blocks(text: str) -> dict[tuple[str, str], str]:
    """Each named rule or invariant of the body (after the index), by (section anchor, its text's
    start): a list item or paragraph opening with a bold name, up to the next one or a blank line;
    a heading with the paragraph under it."""
    body = text.split(INDEX + "\n", 1)[1].split("\n## ", 1)[1]
    blocks: dict[tuple[str, str], str] = {}
    section = ""
    current: list[str] = []

    def close() -> None:
        if current:
            words = " ".join(" ".join(current).split())
            blocks[(section, re.sub(r"^(- |\d+\. )", "", words))] = words
            current.clear()

    for line in ("## " + body).splitlines():
        if m := HEADING.fullmatch(line):
            close()
            section = anchor(m.group(2))
            current.append(f"**{m.group(2)}**")  # a heading names what its paragraph says
        elif ITEM.match(line):
            close()
            current.append(line)
        elif not line.strip():
            if len(current) > 1:  # a heading's block goes on to its first paragraph's end
                close()
        elif current:
            current.append(line)
    close()
    return blocks


def block_of(blocks: dict[tuple[str, str], str], entry: Entry) -> str | None:
    for (section, start), words in blocks.items():
        # the name whole: "**Failpoints**" is not "**Failpoints and bench models**"
        if section == entry.anchor and re.match(rf"\*\*{re.escape(entry.name)}[.:*]", start):
            return words
    return None


DESIGN_TEXT = DESIGN.read_text(encoding="utf-8")
ENTRIES = index_entries(DESIGN_TEXT)


def test_the_index_lists_the_rules_and_invariants() -> None:
    names = {e.name for e in ENTRIES}
    assert {"Writes of an ended life", "A cancelled job stays cancelled until its user resumes it"} <= names
    assert len(ENTRIES) >= 30, len(ENTRIES)
    assert all(e.tests or e.untested for e in ENTRIES), [e.name for e in ENTRIES if not (e.tests or e.untested)]


@pytest.mark.parametrize("ref", sorted(set(TEST.findall(DESIGN_TEXT))))
def test_every_test_design_md_names_exists(ref: str) -> None:
    path, _, name = ref.partition("::")
    assert (REPO / path).is_file(), f"{ref}: no file {path}"
    assert re.search(rf"^\s*(async )?def {name}\(", (REPO / path).read_text(encoding="utf-8"), re.M), (
        f"{ref}: no test {name} in {path}"
    )


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e.anchor}:{e.name}")
def test_each_invariant_s_own_paragraph_names_the_tests_its_index_entry_names(entry: Entry) -> None:
    block = block_of(body_blocks(DESIGN_TEXT), entry)
    assert block is not None, f"no paragraph opens with **{entry.name}** under #{entry.anchor}"
    missing = [t for t in entry.tests if t not in block]
    assert not missing, f"**{entry.name}**: its paragraph does not name {missing}"
    if entry.untested:
        assert "no test" in block.lower(), f"**{entry.name}**: its paragraph does not say where there is no test"


def test_the_checks_fail_on_a_made_up_test_and_a_paragraph_that_names_none() -> None:
    text = (
        "# t\n\n"
        + INDEX
        + "\n\n- [**Made up**](#rules): `tests/unit/test_nope.py::test_nothing`\n\n## Rules\n\n"
        + "1. **Made up.** Says\n   nothing of its test.\n"
    )
    (entry,) = index_entries(text)
    assert entry.tests == ("tests/unit/test_nope.py::test_nothing",) and not (REPO / "tests/unit/test_nope.py").exists()
    block = block_of(body_blocks(text), entry)
    assert block == "1. **Made up.** Says nothing of its test." and entry.tests[0] not in block


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_each_page_opens_with_who_it_is_for_and_what_it_answers(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# ") and lines[1] == "", f"{page.name}: a title, then a blank line"
    assert re.fullmatch(r"\*\*For:\*\* \S.* \\", lines[2]), f"{page.name} line 3: '**For:** WHO \\'"
    assert re.fullmatch(r"\*\*Answers:\*\* \S.*", lines[3]), f"{page.name} line 4: '**Answers:** WHAT'"
    assert lines[4] == "", f"{page.name}: a blank line after the two"
