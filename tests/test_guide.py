"""docs/guide.md answers each of the field's 70 questions, each in its own section with a command.

tests/fixtures/questions.md is the list of questions (a copy of the project's reference list, kept in
the repository so that a fresh clone can run this test). Both guides open with an index:
- guide.md's has one English entry per question, `N. [gloss](#anchor)`;
- guide.zh.md's gives each question in its original Chinese wording, exactly as the list writes it.
Each entry links a heading of its own guide, the two guides link the same numbered section for the
same question, no two questions share a section, and every linked section shows a command: a fenced
code block, or an inline `zerodp ...` / `python ...`.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "tests" / "fixtures" / "questions.md"
ENGLISH, CHINESE = ROOT / "docs" / "guide.md", ROOT / "docs" / "guide.zh.md"
COUNT = 70

_ENTRY = re.compile(r"^\s*(\d+)\. \[(.+)\]\(#([^)\s]+)\)\s*$")
_COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*(?:zerodp|python) [^`]+`")


def questions() -> dict[int, str]:
    """Number -> the Chinese original, from the fixture's `N. 原文 — gloss` lines."""
    found = {}
    for line in QUESTIONS.read_text().splitlines():
        match = re.match(r"^(\d+)\. (.+?) — ", line)
        if match:
            found[int(match[1])] = match[2]
    if sorted(found) != list(range(1, COUNT + 1)):
        raise AssertionError(f"{QUESTIONS} should number its questions 1-{COUNT}, found {sorted(found)}")
    return found


def index(doc: Path, title: str) -> dict[int, tuple[str, str]]:
    """Number -> (text, anchor) of the entries under the heading `## title`, up to the next `## `."""
    lines = doc.read_text().splitlines()
    if f"## {title}" not in lines:
        raise AssertionError(f"{doc.name} has no '## {title}' heading")
    entries: dict[int, tuple[str, str]] = {}
    for line in lines[lines.index(f"## {title}") + 1 :]:
        if line.startswith("## "):
            break
        match = _ENTRY.match(line)
        if match:
            number = int(match[1])
            if number in entries:
                raise AssertionError(f"{doc.name}'s index lists question {number} twice")
            entries[number] = (match[2], match[3])
    return entries


def sections(doc: Path) -> dict[str, tuple[str, str]]:
    """GitHub anchor -> (the heading's number, e.g. '4a', the text up to the next heading), fences kept."""
    found: dict[str, tuple[str, str]] = {}
    anchor, number, body, fenced = None, "", [], False
    for line in doc.read_text().splitlines() + ["# end"]:
        heading = not fenced and re.match(r"#{1,6} ", line)
        fenced ^= line.startswith("```")
        if heading:
            if anchor is not None:
                found[anchor] = (number, "\n".join(body))
            title = line.lstrip("#").strip()
            anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
            number = title.split(". ")[0] if re.match(r"\d+[a-z]?\. ", title) else ""
            body = []
        else:
            body.append(line)
    return found


def _check_index(doc: Path, entries: dict[int, tuple[str, str]]) -> dict[int, str]:
    """Every question has an entry whose anchor is a heading of `doc` with a command; no two share one.
    Returns number -> the linked section's number."""
    missing = sorted(set(range(1, COUNT + 1)) - set(entries))
    assert missing == [], f"{doc.name}'s index has no entry for questions {missing}"
    extra = sorted(set(entries) - set(range(1, COUNT + 1)))
    assert extra == [], f"{doc.name}'s index lists questions {extra}, which {QUESTIONS.name} does not have"
    found = sections(doc)
    broken = {n: anchor for n, (_, anchor) in entries.items() if anchor not in found}
    assert broken == {}, f"{doc.name}'s index links anchors that no heading has: {broken}"
    anchors = [anchor for _, anchor in entries.values()]
    shared = sorted({a for a in anchors if anchors.count(a) > 1})
    assert shared == [], f"{doc.name}: several questions link the same section {shared}; give each its own"
    silent = [n for n, (_, anchor) in entries.items()
              if "\n```" not in "\n" + found[anchor][1] and not _COMMAND.search(found[anchor][1])]
    assert silent == [], f"{doc.name}: the sections answering questions {silent} show no command"
    return {n: found[anchor][0] for n, (_, anchor) in entries.items()}


def test_the_english_index_links_every_question_to_a_section_with_a_command() -> None:
    _check_index(ENGLISH, index(ENGLISH, "Question index"))


def test_the_chinese_index_quotes_every_question_exactly_and_links_the_same_section() -> None:
    entries = index(CHINESE, "问题索引")
    linked = _check_index(CHINESE, entries)
    reworded = {n: (text, questions()[n]) for n, (text, _) in entries.items() if text != questions()[n]}
    assert reworded == {}, f"guide.zh.md's index words these questions otherwise than {QUESTIONS.name}: {reworded}"
    english = _check_index(ENGLISH, index(ENGLISH, "Question index"))
    differ = {n: (english[n], linked[n]) for n in linked if linked[n] != english[n]}
    assert differ == {}, f"the two guides answer these questions in different sections (en, zh): {differ}"
