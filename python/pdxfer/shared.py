"""Shared KV pools: host memory a same-host prefill engine copies KV rows
straight into (one copy, no staging), and cma peers write with memcpy.

Allocate the decode's KV cache with :func:`alloc_shared_pool` and hand its
memory to your own cache and to the engine, as for any host pool; the
engine recognises it (no option needed)::

    pool = pdxfer.alloc_shared_pool(num_pages * page_bytes)
    kv = pool.array(np.float16, (num_pages * page_size, head_dim))   # numpy view
    # torch: kv = torch.frombuffer(pool.buffer, dtype=torch.bfloat16).view(-1, head_dim)
    eng = pdxfer.Engine("decode", ..., pools=[kv], ...)
    ...
    eng.close(); pool.free()

The memory is zeroed and its pages populated at allocation. Views
(``pool.buffer``, :meth:`SharedPool.array`, ``torch.frombuffer``) keep the
allocation alive; :meth:`SharedPool.free` frees it at once (the views must not
be used afterwards; memory an engine still has registered stays mapped until
the engine closes).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

from ._lib import ArgumentError, check, lib

__all__ = ["SharedPool", "alloc_shared_pool"]

lib.pdxfer_alloc_shared_pool.restype = ctypes.c_int32
lib.pdxfer_alloc_shared_pool.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
lib.pdxfer_free_shared_pool.restype = ctypes.c_int32
lib.pdxfer_free_shared_pool.argtypes = [ctypes.c_void_p]


class SharedPool:
    """One shared pool allocation: ``addr`` (page-aligned), ``nbytes``, and
    ``buffer``, a writable byte ``memoryview`` of it (for ``numpy.frombuffer``,
    ``torch.frombuffer`` and the like)."""

    def __init__(self, nbytes: int):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ArgumentError(-101, f"nbytes must be a positive int, got {nbytes!r}")
        p = ctypes.c_void_p()
        check(lib.pdxfer_alloc_shared_pool(nbytes, ctypes.byref(p)))
        self.addr: int = int(p.value or 0)
        self.nbytes: int = nbytes
        raw = (ctypes.c_uint8 * nbytes).from_address(self.addr)
        # views of the buffer keep this allocation alive (garbage collection frees it last)
        raw._pdxfer_pool = self
        self._buffer: Optional[memoryview] = memoryview(raw).cast("B")

    @property
    def buffer(self):
        """The allocation as a writable byte ``memoryview``."""
        if self._buffer is None:
            raise ArgumentError(-101, "the shared pool was freed")
        return self._buffer

    def array(self, dtype: Any = None, shape: Optional[Tuple[int, ...]] = None):
        """A numpy view of the allocation (``uint8`` by default), reshaped to
        ``shape`` when given (its size must fill the allocation exactly)."""
        import numpy as np

        a = np.frombuffer(self.buffer, dtype=np.uint8 if dtype is None else dtype)
        return a if shape is None else a.reshape(shape)

    def free(self) -> None:
        """Frees the allocation now (a second call does nothing). Views must
        not be used afterwards."""
        if self._buffer is None:
            return
        self._buffer = None
        check(lib.pdxfer_free_shared_pool(ctypes.c_void_p(self.addr)))

    def __enter__(self) -> "SharedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __del__(self):
        # reached only once no view of the buffer is left
        if getattr(self, "_buffer", None) is not None:
            self._buffer = None
            lib.pdxfer_free_shared_pool(ctypes.c_void_p(self.addr))

    def __repr__(self) -> str:
        state = "freed" if self._buffer is None else f"0x{self.addr:x}"
        return f"SharedPool({self.nbytes} B at {state})"


def alloc_shared_pool(nbytes: int) -> SharedPool:
    """Allocates ``nbytes`` of zeroed, shareable host memory for KV pools
    (``pdxfer_alloc_shared_pool``); see the module docs."""
    return SharedPool(nbytes)
