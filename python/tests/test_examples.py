"""The examples build and run: examples/cpp (C++17 against pdxfer.h) and
examples/python, each a prefill and decode DCP ranks in separate processes
that verify every byte."""

import os
import shutil
import subprocess
import sys

import pytest

import pdxfer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_cpp_example_moves_a_request_to_two_decode_ranks(tmp_path):
    if not shutil.which(os.environ.get("CXX", "c++")) or not shutil.which("make"):
        pytest.skip("no C++ compiler or make")
    # the Makefile links -lpdxfer: name the loaded library libpdxfer.so (the
    # installed package's file is libpdxfer.abi3.so)
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "libpdxfer.so").symlink_to(pdxfer.library_path())
    exe = tmp_path / "pd_dcp"
    subprocess.run(["make", "-s", "-C", os.path.join(REPO, "examples", "cpp"), f"LIBDIR={libdir}",
                    "pd_dcp"], check=True, timeout=240)
    shutil.move(os.path.join(REPO, "examples", "cpp", "pd_dcp"), exe)
    out = subprocess.run([str(exe), "2", "300", "32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("verified") == 2 and "OK" in out.stdout


def test_python_example_4_to_4():
    # the example imports the same pdxfer (installed, or PDXFER_LIB inherited)
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "python", "pd_dcp.py"), "--dcp", "4",
                          "--prefill-dcp", "4", "--tokens", "400", "--prefix", "64", "--chunk-pages", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("bytes verified") == 4 and "OK" in out.stdout
