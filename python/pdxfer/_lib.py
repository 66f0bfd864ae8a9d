"""Loads libpdxfer.so with ctypes and turns status codes into exceptions.

The library is found through ``PDXFER_LIB`` (a path to ``libpdxfer.so``), else
inside the installed package (``pip install .`` puts it there), else in the
cargo target directory of a source checkout (``CARGO_TARGET_DIR`` or
``<repo>/target``), newest of ``release`` and ``debug``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = [
    "lib",
    "check",
    "library_path",
    "PdxError",
    "ArgumentError",
    "LayoutError",
    "PlanError",
    "CompatError",
    "MemoryError_",
    "TransportError",
    "BootstrapError",
    "CudaError",
    "RdmaError",
    "NcclError",
    "EngineError",
    "ABI_VERSION_MAJOR",
]

ABI_VERSION_MAJOR = 1


def library_path() -> Path:
    """The path of the libpdxfer.so this package loads."""
    env = os.environ.get("PDXFER_LIB")
    if env:
        p = Path(env)
        if not p.is_file():
            raise OSError(f"PDXFER_LIB={env} does not name a file")
        return p
    bundled = sorted(Path(__file__).resolve().parent.glob("libpdxfer*.so"))
    if bundled:
        return bundled[0]
    repo = Path(__file__).resolve().parents[2]
    target = Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
    found = [target / prof / "libpdxfer.so" for prof in ("release", "debug")]
    found = [p for p in found if p.is_file()]
    if not found:
        raise OSError(
            f"libpdxfer.so not found in the package nor under {target}/{{release,debug}}; "
            "`pip install .` the package, run `cargo build`, or set PDXFER_LIB to its path"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


lib = ctypes.CDLL(str(library_path()))

lib.pdxfer_abi_version.restype = ctypes.c_uint32
lib.pdxfer_abi_version.argtypes = []
lib.pdxfer_last_error.restype = ctypes.c_char_p
lib.pdxfer_last_error.argtypes = []
lib.pdxfer_status_str.restype = ctypes.c_char_p
lib.pdxfer_status_str.argtypes = [ctypes.c_int32]
lib.pdxfer_status_kind.restype = ctypes.c_char_p
lib.pdxfer_status_kind.argtypes = [ctypes.c_int32]

if lib.pdxfer_abi_version() >> 16 != ABI_VERSION_MAJOR:
    raise ImportError(
        f"libpdxfer ABI {lib.pdxfer_abi_version() >> 16}.x does not match this package's "
        f"{ABI_VERSION_MAJOR}.x ({library_path()})"
    )


class PdxError(Exception):
    """A pdxfer failure. ``.code`` is the stable status number, ``.kind`` its
    snake_case name (``"prefix_misaligned"``), ``.detail`` the library's text."""

    def __init__(self, code: int, detail: str):
        self.code = code
        self.kind = lib.pdxfer_status_kind(code).decode()
        self.detail = detail
        super().__init__(f"{self.kind} ({code}): {detail}")


class ArgumentError(PdxError, ValueError):
    """Bad arguments: NULL, out of range, wrong struct size, buffer too small (-1xx)."""


class LayoutError(PdxError, ValueError):
    """Layout and compatibility errors (-2xx)."""


class PlanError(LayoutError):
    """A token plan cannot be built: ``prefix_misaligned``, ``tokens_exceed_source``
    or ``insufficient_destination``."""


class CompatError(LayoutError):
    """Two peers cannot be paired (``dcp_rank_mismatch``, ``kv_dtype_mismatch``, ...)."""


class MemoryError_(PdxError):
    """Memory registration and bounds errors (-3xx)."""


class TransportError(PdxError):
    """Transport errors (-4xx)."""


class BootstrapError(PdxError):
    """Bootstrap and metadata errors (-5xx)."""


class CudaError(PdxError):
    """CUDA and relayout errors (-6xx)."""


class RdmaError(PdxError):
    """RDMA errors (-7xx)."""


class NcclError(PdxError):
    """NCCL errors (-8xx)."""


class EngineError(PdxError):
    """Engine, room and session errors (-9xx)."""


_PLAN_KINDS = {-200, -201, -202}
_RANGES = [
    (-199, -100, ArgumentError),
    (-299, -200, CompatError),
    (-399, -300, MemoryError_),
    (-499, -400, TransportError),
    (-599, -500, BootstrapError),
    (-699, -600, CudaError),
    (-799, -700, RdmaError),
    (-899, -800, NcclError),
    (-999, -900, EngineError),
]


def error_class(code: int) -> type:
    """The exception class for a status code."""
    if code in _PLAN_KINDS:
        return PlanError
    if code in (-210, -212):  # invalid_topology, invalid_layout
        return LayoutError
    for lo, hi, cls in _RANGES:
        if lo <= code <= hi:
            return cls
    return PdxError


def check(status: int) -> int:
    """Raises the matching ``PdxError`` subclass when ``status`` is an error."""
    if status < 0:
        detail = lib.pdxfer_last_error().decode(errors="replace")
        raise error_class(status)(status, detail)
    return status
