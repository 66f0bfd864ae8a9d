"""Synthetic MLA pools for examples and tests (needs numpy).

A pool per layer is a ``uint64`` array of ``num_pages * page_size`` token rows
of ``row_bytes / 8`` words. Every word of the row of sequence position ``t``
of layer ``l`` in request ``room`` holds a value derived from ``(room, l, t,
word)``, distinct for every tuple, so a decode rank can check every byte it
received (and where it landed) without seeing the prefill's memory.

Placement follows SGLang's DCP storage rule (interleave 1): position ``t`` is
owned by DCP rank ``t % dcp_size``; within a virtual page of
``page_size * dcp_size`` positions the owner stores it at slot
``(t % V) // dcp_size`` of its local page; ``pages[k]`` is the page holding
the k-th virtual page after ``origin`` (a multiple of ``V``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["SyntheticPools", "owned_rows", "pattern", "scattered_pages"]


def owned_rows(page_size: int, dcp_size: int, rank: int, pages: Sequence[int], origin: int,
               end: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(positions, rows)``: the positions of ``[origin, end)`` that ``rank`` owns
    and the pool rows (``page * page_size + slot``) holding them."""
    v = page_size * dcp_size
    if origin % v:
        raise ValueError(f"origin {origin} is not a multiple of the virtual page {v}")
    t = np.arange(origin, end, dtype=np.int64)
    t = t[t % dcp_size == rank]
    li = (t - origin) // v * page_size + (t % v) // dcp_size
    pg = np.asarray(pages, dtype=np.int64)
    return t, pg[li // page_size] * page_size + li % page_size


def pattern(room: int, layer: int, positions: np.ndarray, words: int) -> np.ndarray:
    """The expected words of the rows of ``positions``: shape ``(len(positions), words)``."""
    base = (np.uint64(room) << np.uint64(44)) | (np.uint64(layer) << np.uint64(32))
    rows = (positions.astype(np.uint64) << np.uint64(8)) | base
    return rows[:, None] | np.arange(words, dtype=np.uint64)[None, :]


def scattered_pages(count: int, pool_pages: int, room: int, stride: int = 7) -> List[int]:
    """``count`` distinct, non-consecutive page ids of a pool (``stride`` must be
    coprime with ``pool_pages``)."""
    if count > pool_pages:
        raise ValueError(f"{count} pages do not fit a pool of {pool_pages}")
    return [(i * stride + room) % pool_pages for i in range(count)]


class SyntheticPools:
    """``layers`` pools of ``num_pages`` pages of ``page_size`` rows, plus an aux buffer."""

    def __init__(self, layers: int, row_bytes: int, page_size: int, num_pages: int,
                 aux_rows: int = 8, aux_item: int = 32):
        if row_bytes % 8 or aux_item % 8:
            raise ValueError("row and aux sizes must be multiples of 8 bytes")
        self.page_size, self.row_bytes, self.num_pages = page_size, row_bytes, num_pages
        self.words = row_bytes // 8
        self.kv = [np.zeros((num_pages * page_size, self.words), dtype=np.uint64) for _ in range(layers)]
        self.aux = np.zeros((aux_rows, aux_item // 8), dtype=np.uint64)
        self.aux_item = aux_item

    def entries(self) -> List[Tuple[int, int]]:
        """Topology entries ``(layer_id, row_bytes)``."""
        return [(i, self.row_bytes) for i in range(len(self.kv))]

    def fill(self, room: int, dcp_size: int, rank: int, pages: Sequence[int], origin: int, end: int) -> None:
        """Writes the pattern of the positions ``rank`` owns in ``[origin, end)``."""
        t, rows = owned_rows(self.page_size, dcp_size, rank, pages, origin, end)
        for l, buf in enumerate(self.kv):
            buf[rows] = pattern(room, l, t, self.words)

    def fill_aux(self, room: int, idx: int) -> None:
        """Writes the room's aux pattern into row ``idx``."""
        self.aux[idx] = pattern(room, 0xFFF, np.array([idx]), self.aux.shape[1])[0]

    def verify(self, room: int, dcp_size: int, rank: int, pages: Sequence[int], origin: int, end: int,
               aux_idx: Optional[int] = None, src_aux_idx: Optional[int] = None) -> int:
        """Checks every owned row (and the aux row); returns the bytes checked.
        Raises ``AssertionError`` naming the first differing row."""
        t, rows = owned_rows(self.page_size, dcp_size, rank, pages, origin, end)
        n = 0
        for l, buf in enumerate(self.kv):
            want = pattern(room, l, t, self.words)
            bad = np.nonzero((buf[rows] != want).any(axis=1))[0]
            if len(bad):
                i = bad[0]
                raise AssertionError(
                    f"room {room} layer {l} position {t[i]} row {rows[i]}: got {buf[rows[i]][:2]}, "
                    f"want {want[i][:2]} ({len(bad)} rows differ)")
            n += len(t) * self.row_bytes
        if aux_idx is not None:
            want = pattern(room, 0xFFF, np.array([aux_idx if src_aux_idx is None else src_aux_idx]),
                           self.aux.shape[1])[0]
            if not (self.aux[aux_idx] == want).all():
                raise AssertionError(f"room {room}: aux row {aux_idx} differs")
            n += self.aux_item
        return n

    def untouched_outside(self, rows_written: Sequence[int]) -> bool:
        """True when every row except ``rows_written`` is still zero in every layer."""
        mask = np.ones(self.kv[0].shape[0], dtype=bool)
        mask[np.asarray(list(rows_written), dtype=np.int64)] = False
        return all(not buf[mask].any() for buf in self.kv)

    def is_zero(self) -> bool:
        """True when no KV or aux byte was written."""
        return all(not b.any() for b in self.kv) and not self.aux.any()
