"""With PDXFER_EXPECT_INSTALLED=1 (scripts/test.sh runs the tests so, against
the wheel installed into a fresh venv) the package under test must be the
installed one, loading the library inside it, with no PDXFER_LIB."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pdxfer

# Collected only with PDXFER_EXPECT_INSTALLED=1 (conftest.py's collect_ignore):
# from a source checkout there is no installed package to check.


def test_the_installed_package_and_its_library_are_under_test():
    assert "PDXFER_LIB" not in os.environ
    prefix = Path(sys.prefix).resolve()
    assert sys.prefix != sys.base_prefix, "not inside a virtual environment"
    pkg = Path(pdxfer.__file__).resolve().parent
    assert prefix in pkg.parents, f"pdxfer imported from {pkg}, not from the venv {prefix}"
    lib = Path(pdxfer.library_path()).resolve()
    assert lib.parent == pkg and lib.name.startswith("libpdxfer")
    assert pdxfer.abi_version()[0] == pdxfer.ABI_VERSION_MAJOR


def test_the_pdxfer_command_is_installed():
    exe = Path(sysconfig.get_path("scripts")) / "pdxfer"
    assert exe.is_file() and os.access(exe, os.X_OK)
    out = subprocess.run([str(exe), "info", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"abi_version"' in out.stdout


def test_the_sglang_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get("pdxfer") == "pdxfer.sglang.plugin:register", eps
    import pdxfer.sglang.plugin as plugin

    assert callable(plugin.register)


def test_the_vllm_plugin_entry_point_is_declared_and_the_package_shipped():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("pdxfer") == "pdxfer.vllm.plugin:register", eps
    import pdxfer.vllm.config as config
    import pdxfer.vllm.plugin as plugin

    assert callable(plugin.register)
    assert Path(config.__file__).resolve().parent.parent == Path(pdxfer.__file__).resolve().parent
