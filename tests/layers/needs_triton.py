"""The one skip reason of every test that needs triton. Under CI=true tests/conftest.py turns
a skip with this reason into a failure: CI installs triton (the `[test]` extra pins it), so
a missing triton there is a broken install, not a reason to leave the kernel tests out."""

TRITON_MISSING = "triton is not installed"
