"""tests/conftest.py under CI=true: every way a test skips for a missing triton (module level,
importorskip, a skip mark, inside the test) fails instead, and other skips (no CUDA) stay skips;
without CI all of them skip. Checked in an inner pytest session that runs tests/conftest.py
itself, with triton hidden (`sys.modules["triton"] = None`: find_spec gives None, import fails)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.layers.needs_triton import TRITON_MISSING

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
HEADER = ("import importlib.util\nimport pytest\n"
          "from tests.layers.needs_triton import TRITON_MISSING\n")
MODULES = {  # inner test module -> its source after HEADER
    "test_module_level": ('if importlib.util.find_spec("triton") is None:\n'
                          '    pytest.skip(TRITON_MISSING, allow_module_level=True)\n'
                          "def test_kernel(): pass\n"),
    "test_importorskip": ('pytest.importorskip("triton", reason=TRITON_MISSING)\n'
                          "def test_kernel(): pass\n"),
    "test_marked": ('@pytest.mark.skipif(importlib.util.find_spec("triton") is None,\n'
                    "                    reason=TRITON_MISSING)\n"
                    "def test_kernel(): pass\n"),
    "test_inside": ("def test_kernel(): pytest.skip(TRITON_MISSING)\n"
                    'def test_on_cuda(): pytest.skip("needs a CUDA device")\n'),
    "test_cuda_module": ('pytest.skip("needs a CUDA device", allow_module_level=True)\n'
                         "def test_kernel(): pass\n"),
}
# Under CI=true: node -> outcome (collection reports for module-level skips, else the test's).
IN_CI = {"test_module_level.py": "failed", "test_importorskip.py": "failed",
         "test_marked.py::test_kernel": "failed", "test_inside.py::test_kernel": "failed",
         "test_inside.py::test_on_cuda": "skipped", "test_cuda_module.py": "skipped"}


@pytest.mark.parametrize("ci", ["true", None])
def test_triton_skips_fail_only_in_ci(pytester, monkeypatch, ci):
    monkeypatch.setitem(sys.modules, "triton", None)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(**{name: HEADER + body for name, body in MODULES.items()})
    # (hypothesis's plugin imports all of hypothesis at each session's end: 2 s)
    run = pytester.inline_run("-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                              "--continue-on-collection-errors")
    outcomes = {r.nodeid: r.outcome for r in run.getreports("pytest_collectreport")
                if r.nodeid.endswith(".py") and not r.passed}
    outcomes.update({r.nodeid: r.outcome for r in run.getreports("pytest_runtest_logreport")
                     if r.when == "setup" and not r.passed or r.when == "call"})
    expected = IN_CI if ci else dict.fromkeys(IN_CI, "skipped")
    assert outcomes == expected
    assert all(TRITON_MISSING in str(r.longrepr) for r in run.getfailures())
