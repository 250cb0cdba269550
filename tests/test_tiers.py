"""The suite's two tiers (tests/conftest.py): a plain `python -m pytest` runs the quick one and deselects the tests
marked slow; --slow, a -m expression or a test's node id runs what it asks for."""

import sys

import conftest  # the repository's, already loaded by pytest: its hooks, not a second copy of its set-up
import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_end_to_end():
    pass
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    """A directory of one quick and one slow test under the repository conftest's tiering hooks (an inner run
    imports its own conftest as `conftest`, so the repository's is handed over under another name)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the inner runs need no installed plugin
    monkeypatch.setitem(sys.modules, "repository_conftest", conftest)
    pytester.makeconftest(
        "from repository_conftest import pytest_addoption, pytest_collection_modifyitems, pytest_report_header\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    slow: end-to-end\n    corpus: reads the corpus\n")
    pytester.makepyfile(test_tiers_sample=TESTS)
    return pytester


def test_a_plain_run_is_the_quick_tier_and_says_how_to_run_the_rest(suite):
    result = suite.runpytest_inprocess("-v")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*--slow runs them too*", "*test_quick PASSED*"])


@pytest.mark.parametrize(
    "args, passed",
    [
        (["--slow"], ["test_quick", "test_end_to_end"]),
        (["-m", "slow"], ["test_end_to_end"]),
        (["test_tiers_sample.py::test_end_to_end"], ["test_end_to_end"]),
    ],
)
def test_slow_m_or_a_node_id_runs_what_it_asks_for(suite, args, passed):
    result = suite.runpytest_inprocess("-v", *args)
    result.assert_outcomes(passed=len(passed))
    result.stdout.fnmatch_lines([f"*{name} PASSED*" for name in passed])
    assert "--slow runs them too" not in result.stdout.str()
