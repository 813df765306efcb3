"""The generated documentation pages match what the code computes today."""

import io
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
