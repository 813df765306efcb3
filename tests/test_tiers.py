"""The rule that every test carries a tier marker (tests/support/tiers.py): an unmarked test stops the run."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A throwaway test run that loads the project's rule and registers its markers."""
    pytester.syspathinsert(TESTS)
    pytester.makeconftest('pytest_plugins = ["support.tiers"]\n')
    pytester.makeini("[pytest]\nmarkers =\n    unit: x\n    multiprocess: x\n    container: x\n    browser: x\n    slow: x\n")
    return pytester


def test_an_unmarked_test_fails_the_run_naming_it(project: pytest.Pytester) -> None:
    project.makepyfile(test_sample="import pytest\n\n@pytest.mark.unit\ndef test_marked():\n    pass\n\n"
                                   "def test_forgotten():\n    pass\n")
    result = project.runpytest("-m", "unit")  # also when the unmarked test would be deselected
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*1 test(s) carry no tier marker*test_sample.py::test_forgotten*"])


def test_marked_tests_run_and_slow_alone_is_no_tier(project: pytest.Pytester) -> None:
    project.makepyfile(test_sample="import pytest\n\npytestmark = pytest.mark.multiprocess\n\n"
                                   "def test_a():\n    pass\n\n@pytest.mark.unit\ndef test_b():\n    pass\n")
    assert project.runpytest().ret == pytest.ExitCode.OK
    project.makepyfile(test_sample="import pytest\n\n@pytest.mark.slow\ndef test_only_slow():\n    pass\n")
    assert project.runpytest().ret == pytest.ExitCode.USAGE_ERROR
