"""libpdxfer's log records in Python's :mod:`logging`.

The library logs refused pairings, transport fallbacks and the like. This
module hands them to the logger ``pdxfer.<target>``: the Rust module path with
``::`` as ``.`` (``pdxfer::bootstrap::peer`` logs to ``pdxfer.bootstrap.peer``;
another crate's target ``ureq::pool`` to ``pdxfer.ureq.pool``). Importing
:mod:`pdxfer` starts forwarding at INFO (DEBUG or TRACE when the ``pdxfer``
logger is already set more verbose); :func:`forward_to_logging` changes the
level, :func:`stop` ends it. Records are emitted on the thread that logged,
which may be one the library started.
"""

from __future__ import annotations

import atexit
import ctypes
import logging

from ._lib import PdxError, check, lib

__all__ = ["TRACE", "forward_to_logging", "stop"]

#: Python level of the library's trace records (below DEBUG).
TRACE = 5

LOG_OFF, LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG, LOG_TRACE = range(6)

_TO_PYTHON = {
    LOG_ERROR: logging.ERROR,
    LOG_WARN: logging.WARNING,
    LOG_INFO: logging.INFO,
    LOG_DEBUG: logging.DEBUG,
    LOG_TRACE: TRACE,
}

LogFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p)

# ABI 1.3 added the callback; an older 1.x library (PDXFER_LIB) loads without it.
_AVAILABLE = hasattr(lib, "pdxfer_set_log_callback")
if _AVAILABLE:
    lib.pdxfer_set_log_callback.restype = ctypes.c_int32
    lib.pdxfer_set_log_callback.argtypes = [ctypes.c_uint32, LogFn, ctypes.c_void_p]


def _set(level: int, fn) -> None:
    if not _AVAILABLE:
        raise NotImplementedError("the loaded libpdxfer predates pdxfer_set_log_callback (ABI 1.3)")
    check(lib.pdxfer_set_log_callback(level, fn, None))


def logger_name(target: str) -> str:
    """The Python logger for a record's Rust target."""
    name = target.replace("::", ".")
    return name if name == "pdxfer" or name.startswith("pdxfer.") else "pdxfer." + name


def _forward(_user, level, target, message):
    # Never raise into the library: a failing handler must not break the caller.
    try:
        pylevel = _TO_PYTHON.get(level, logging.ERROR)
        logger = logging.getLogger(logger_name((target or b"").decode(errors="replace")))
        if logger.isEnabledFor(pylevel):
            logger.log(pylevel, "%s", (message or b"").decode(errors="replace"))
    except Exception:  # noqa: BLE001
        pass


# The library keeps a raw pointer to this function: the module holds the
# reference that keeps it alive for as long as the process runs.
_CALLBACK = LogFn(_forward)


def _library_level(pylevel: int) -> int:
    if pylevel <= TRACE:
        return LOG_TRACE
    if pylevel <= logging.DEBUG:
        return LOG_DEBUG
    if pylevel <= logging.INFO:
        return LOG_INFO
    if pylevel <= logging.WARNING:
        return LOG_WARN
    return LOG_ERROR


def forward_to_logging(level: int = logging.INFO) -> None:
    """Forwards the library's records at ``level`` and more severe (a
    :mod:`logging` level; :data:`TRACE` for everything)."""
    _set(_library_level(level), _CALLBACK)


def stop() -> None:
    """Stops forwarding; when it returns no thread is inside the callback."""
    _set(LOG_OFF, LogFn())


def _stop_at_exit() -> None:
    # Library threads may outlive the interpreter; they must not call into it.
    try:
        stop()
    except Exception:  # noqa: BLE001
        pass


def _start() -> None:
    if not _AVAILABLE:
        return
    try:
        forward_to_logging(min(logging.getLogger("pdxfer").getEffectiveLevel(), logging.INFO))
    except PdxError as e:
        logging.getLogger("pdxfer").warning("library log records are not forwarded: %s", e)
        return
    atexit.register(_stop_at_exit)
