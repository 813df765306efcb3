"""The generated documentation pages match what the code computes today."""

import io
import re
from pathlib import Path

import pytest

from topology.report import write_report

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
@pytest.mark.slow
def test_topologies_page_is_current():
    generated = io.StringIO()
    write_report(generated)
    committed = (ROOT / "docs" / "topologies.md").read_text()
    assert committed == generated.getvalue(), "docs/topologies.md is stale: run python -m topology.report > docs/topologies.md"


TESTS = ROOT / "tests"
_CITED = re.compile(r"\btest_[A-Za-z0-9_]+")
_CITED_PATH = re.compile(r"\btests/[A-Za-z0-9_/]+\.py\b")
_DEFINED = re.compile(r"^\s*(?:async\s+)?def (test_[A-Za-z0-9_]+)\(", re.MULTILINE)


def missing_citations(text: str, tests: Path = TESTS) -> set[str]:
    """The test names a page cites that tests/ lacks: `test_...` words that are neither a test module
    (tests/NAME.py) nor a test function defined in one, and `tests/....py` paths that do not exist."""
    modules = {path.stem for path in tests.glob("test_*.py")}
    functions = {name for path in tests.glob("test_*.py") for name in _DEFINED.findall(path.read_text())}
    cited = set(_CITED.findall(text))
    missing = {name for name in cited if name not in modules and name not in functions}
    return missing | {path for path in _CITED_PATH.findall(text) if not (tests.parent / path).is_file()}


@pytest.mark.unit
def test_every_test_the_threat_model_cites_exists():
    """docs/threat-model.md names the test that holds each claim to account: each must exist, so the page
    stays matched to the tests (a renamed or removed test fails here)."""
    page = (ROOT / "docs" / "threat-model.md").read_text()
    assert len(set(_CITED.findall(page))) >= 20, "the threat model cites its tests by name"
    assert missing_citations(page) == set(), "docs/threat-model.md cites tests that do not exist"
    # the check itself catches a stale name, a stale module and a stale path
    assert missing_citations("`test_no_such_claim_is_tested` (tests/test_gone.py), test_gone_either") == {
        "test_no_such_claim_is_tested", "tests/test_gone.py", "test_gone", "test_gone_either"}
