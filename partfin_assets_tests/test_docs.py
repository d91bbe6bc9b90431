"""The documentation stays honest: every relative link resolves inside the repository, and nothing points outside it.

Links are read from the Markdown of README.md, docs/ and examples/ (code blocks and code spans
are not links). A link to a file must name a file or folder of the repository; a link to a
heading (`page.md#heading`, `#heading`) must name a heading of that page, slugged the way
GitHub slugs it. The repository owns its design: no page, module, test or bench may send a
reader to a design note, an issue tracker or a folder beside the repository. The one exception
is the Debezium corpus test's lookup of `../shared/debezium-corpus` (a data set, not a text).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from partfin_assets.iceberg import tables
from partfin_assets.model import summary_keys

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*.md")])
SOURCES = sorted(p for folder in ("partfin_assets", "partfin_assets_tests", "bench", "scripts", "examples")
                 for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh"))

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# what sends a reader outside the repository: a design note, a tracker's issue, a sibling folder
OUTSIDE = re.compile(r"\bDESIGN\b|DESIGN\.md|\b[Ii]ssues? ?[#-]?\d+|\.\./shared\b|kafka-notes\.md")
CORPUS_LOOKUP = "../shared/debezium-corpus"  # test data the corpus tests read where it lies


def prose(text: str) -> str:
    """The Markdown without code blocks and code spans (what is left can hold links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...: not a path
            continue
        path_text, _, fragment = target.partition("#")
        resolved = (page.parent / path_text).resolve() if path_text else page
        if not resolved.is_relative_to(root):
            broken.append(f"{target}: outside the repository")
        elif not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(root)}")
    return broken


def test_the_pages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/architecture.md", "docs/contracts.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves_inside_the_repository(page):
    assert not broken_links(page), f"{page.relative_to(REPO)}:\n" + "\n".join(broken_links(page))


def test_every_page_of_docs_is_listed_in_the_index():
    listed = {(REPO / "docs" / target.partition("#")[0]).resolve() for target in links(REPO / "docs" / "index.md")}
    unlisted = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "index.md" and p.resolve() not in listed]
    assert not unlisted, f"docs/index.md does not list: {unlisted}"


def test_every_key_partfin_writes_is_in_the_contracts_page():
    """Each snapshot-summary key, table property (a prefix: as `prefix<name>`), tag and job kind of
    model/summary_keys.py is named in docs/contracts.md, so the page cannot fall behind the code."""
    named = set(re.findall(r"`([^`]+)`", (REPO / "docs" / "contracts.md").read_text()))
    keys = [v for k, v in vars(summary_keys).items() if k.isupper() and isinstance(v, str)] + [k.value for k in summary_keys.JobKind]
    missing = [key for key in keys if not any(text == key or text.startswith(key) for text in named)]
    assert not missing, f"docs/contracts.md does not name: {missing}"


def test_every_column_of_partfins_tables_is_in_the_contracts_page():
    """The columns of cdc.<table>, its __rejected and __ledger tables, base.<table>'s own columns and its quarantine."""
    named = set(re.findall(r"`([^`]+)`", (REPO / "docs" / "contracts.md").read_text()))
    schemas = (tables.CDC_SCHEMA, tables.REJECTED_SCHEMA, tables.LEDGER_SCHEMA, tables.QUARANTINE_SCHEMA)
    columns = [field.name for schema in schemas for field in schema.fields] + list(tables.META_COLUMNS)
    missing = sorted(set(columns) - named)
    assert not missing, f"docs/contracts.md does not name the columns: {missing}"


def test_nothing_points_outside_the_repository():
    found = []
    for path in PAGES + SOURCES:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            text = line.replace(CORPUS_LOOKUP, "") if path.suffix == ".py" and "partfin_assets_tests" in path.parts else line
            if OUTSIDE.search(text):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "references to something outside the repository:\n" + "\n".join(found)


def test_the_checker_sees_what_it_must_refuse(tmp_path):
    """The checks can fail: a broken link, a missing heading, a path outside and a design note are each found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Index\n\n## Growing: `a --b`\n")
    sample = tmp_path / "docs" / "sample.md"
    sample.write_text("# Title\n\n[a](missing.md) [b](index.md#no-such-heading) [c](../../outside.md) "
                      "[d](#title) [e](index.md#growing-a---b) `[f](not-a-link.md)`\n")
    assert broken_links(sample, tmp_path) == [
        "missing.md: no such file",
        "index.md#no-such-heading: no heading #no-such-heading in docs/index.md",
        "../../outside.md: outside the repository",
    ]
    assert OUTSIDE.search("see DESIGN §6") and OUTSIDE.search("(issue 10 §3)") and OUTSIDE.search("../shared/notes")
    assert not OUTSIDE.search("an issue with 3 tables")


SUITE_TIME = re.compile(r"`scripts/test\.sh` \(about (\d+) minutes|about (\d+) minutes\s+on this 2-core machine")


def test_the_suite_time_is_the_same_wherever_it_is_stated():
    """The README said 26 minutes, docs/operations.md 19: one of them was stale."""
    stated = {page.name: {int(a or b) for a, b in SUITE_TIME.findall(page.read_text())} for page in (REPO / "README.md", REPO / "docs" / "operations.md")}
    assert all(stated.values()) and len(set().union(*stated.values())) == 1, stated


def test_no_page_names_an_asset_by_the_key_form_partfin_no_longer_uses():
    """`cdc/T`, `base/T`: keys of a release before (`cdc_T` now); only a page explaining that change names them."""
    old = re.compile(r"`(?:cdc|base|finalized|activity)/(?:T|<t(?:able)?>)`|--select (?:cdc|base)/")
    new = re.compile(r"`(?:cdc|base|finalized)_(?:T|<t(?:able)?>)`")
    wrong = []
    for page in PAGES:
        heading = ""
        for line in page.read_text().splitlines():
            heading = line if line.startswith("#") else heading
            if old.search(line) and not new.search(line) and "Upgrading" not in heading:  # the upgrade notes name both
                wrong.append(f"{page.relative_to(REPO)}: {line.strip()[:120]}")
    assert not wrong, "\n".join(wrong)
