"""docs/policies.md is the specification the code cites: every section cited as ``§N`` or ``§N.M`` in
kvpass/ (docstrings, comments, ``Policy.section``), the tests and the README is a heading there, and
every registered policy names a section."""

from __future__ import annotations

import re
from pathlib import Path

from kvpass.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "policies.md"
# "§5.4", "§5.5-5.6" (both ends), "§ 6.3"
CITATION = re.compile(r"§\s?(\d+(?:\.\d+)?)(?:\s?[-–]\s?(\d+(?:\.\d+)?))?")
HEADING = re.compile(r"^#{2,4} §(\d+(?:\.\d+)?) ", re.MULTILINE)


def spec_sections() -> list[str]:
    return HEADING.findall(SPEC.read_text(encoding="utf-8"))


def citations(text: str) -> set[str]:
    return {n for pair in CITATION.findall(text) for n in pair if n}


def cited_sections() -> dict[str, set[str]]:
    """section -> files citing it, over kvpass/, tests/ and README.md (this file's examples excluded)."""
    paths = [*ROOT.joinpath("kvpass").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"), ROOT / "README.md"]
    found: dict[str, set[str]] = {}
    for path in paths:
        if path.resolve() == Path(__file__).resolve():
            continue
        for section in citations(path.read_text(encoding="utf-8")):
            found.setdefault(section, set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_citation_reader():
    assert citations("policies.md §5.5-5.6, §8.1 (identity) and §0.6 b; § 6.3") == {"5.5", "5.6", "8.1", "0.6", "6.3"}
    assert HEADING.findall("## §5 D2O\n### §5.4 Layer budgets\ntext §9.9\n") == ["5", "5.4"]


def test_spec_headings_are_unique():
    sections = spec_sections()
    assert len(sections) > 50
    assert len(sections) == len(set(sections)), sorted(s for s in sections if sections.count(s) > 1)


def test_every_cited_section_is_a_heading_of_the_spec():
    headings = set(spec_sections())
    cited = cited_sections()
    assert "5.4" in cited and "kvpass/policies/d2o/policy.py" in cited["5"]       # the scan sees the code's citations
    missing = {s: sorted(files) for s, files in cited.items() if s not in headings}
    assert not missing, f"sections cited but not in docs/policies.md: {missing}"


def test_every_policy_names_a_section_of_the_spec():
    headings = set(spec_sections())
    for name, cls in POLICIES.items():
        own = citations(cls.section)
        assert own and own <= headings, f"{name}: section {cls.section!r} is not a heading of docs/policies.md"
        assert f"`{name}`" in SPEC.read_text(encoding="utf-8") or name == "full", f"{name} is not described in the spec"


def test_no_reference_to_the_design_folder_outside_the_repository():
    offenders = [str(p.relative_to(ROOT)) for p in [*ROOT.joinpath("kvpass").rglob("*.py"), ROOT / "README.md"]
                 if "shared/design/policies.md" in p.read_text(encoding="utf-8")]
    assert not offenders, f"cite docs/policies.md instead: {offenders}"
