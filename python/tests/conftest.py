import os
import sys

# From a source checkout the tests import python/pdxfer; with
# PDXFER_EXPECT_INSTALLED=1 (scripts/test.sh, after installing the wheel into a
# fresh venv) they import the installed package and test_installed.py checks that.
if os.environ.get("PDXFER_EXPECT_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    # the installed-package checks have nothing to check in a source checkout
    collect_ignore = ["test_installed.py"]
