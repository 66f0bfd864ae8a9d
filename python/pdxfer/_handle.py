"""A native handle that is safe to close while other threads use it.

Every pdxfer object (``Agent``, ``Peer``, ``Engine``, ``BootstrapServer``,
``BootstrapClient``, ``Registration``) keeps its C handle in a
:class:`NativeHandle`. A call borrows the handle for its duration
(:meth:`NativeHandle.use`, or the :func:`guarded` method decorator); closing
marks the handle closed at once (calls that start afterwards raise
a typed ``PdxError``, "... is closed"), waits until the
calls in flight have returned, and only then destroys the C object. So a
``close()`` racing another thread's call never frees memory under it: the
other call finishes (or fails with a typed error), and ``close()`` returns
after it. A close waits at most as long as the slowest call in flight (a
``wait`` returns at its own timeout).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from ._lib import ArgumentError, error_class

_NULL_ARGUMENT = -100


class NativeHandle:
    """Counts the calls using a C handle; destroys it once none is left."""

    def __init__(self, raw: Any, destroy: Callable[[Any], Any], what: str, closed_code: int = _NULL_ARGUMENT):
        self._raw = raw
        self._closed_code = closed_code
        self._destroy = destroy
        self._what = what
        self._cv = threading.Condition(threading.Lock())
        self._users = 0
        self._by_thread: dict = {}
        self._closing = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has started."""
        return self._closing or self._raw is None

    @contextmanager
    def use(self) -> Iterator[Any]:
        """Borrows the raw handle for one call; raises if it is closed."""
        me = threading.get_ident()
        with self._cv:
            if self._closing or self._raw is None:
                raise self._closed()
            self._users += 1
            self._by_thread[me] = self._by_thread.get(me, 0) + 1
            raw = self._raw
        try:
            yield raw
        finally:
            with self._cv:
                self._users -= 1
                left = self._by_thread[me] - 1
                if left:
                    self._by_thread[me] = left
                else:
                    del self._by_thread[me]
                if self._users == 0:
                    self._cv.notify_all()

    @property
    def raw(self) -> Any:
        """The raw handle; only valid inside :meth:`use` (or a guarded method)."""
        if self._raw is None:
            raise self._closed()
        return self._raw

    def _closed(self) -> Exception:
        return error_class(self._closed_code)(self._closed_code, f"{self._what} is closed")

    def close(self, destroy: Optional[Callable[[Any], Any]] = None) -> Optional[Any]:
        """Refuses new calls, waits for those in flight, destroys the handle
        (with ``destroy`` when given, else the constructor's function).

        Idempotent: a second (or concurrent) close returns ``None`` once the
        handle is gone. Returns what the destroy function returned."""
        me = threading.get_ident()
        with self._cv:
            if self._by_thread.get(me):
                raise ArgumentError(
                    _NULL_ARGUMENT,
                    f"{self._what}.close() called from inside one of its own calls on the same thread",
                )
            if self._closing:
                while self._raw is not None:
                    self._cv.wait()
                return None
            if self._raw is None:
                return None
            self._closing = True
            while self._users:
                self._cv.wait()
            raw = self._raw
        try:
            return (destroy or self._destroy)(raw)
        finally:
            with self._cv:
                self._raw = None
                self._cv.notify_all()


def guarded(method: Callable) -> Callable:
    """Runs a method with ``self._hd`` borrowed (see :meth:`NativeHandle.use`)."""

    @functools.wraps(method)
    def inner(self, *args, **kwargs):
        with self._hd.use():
            return method(self, *args, **kwargs)

    return inner
