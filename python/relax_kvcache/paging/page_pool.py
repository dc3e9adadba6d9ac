"""The pool of free KV-cache pages, in TVM's free-list order."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CacheFullError, KVCacheError
from ._checks import as_int


class PagePool:
    """The free page ids, a stack as TVM's ``free_page_ids_`` (page 0 on top at first; released
    pages pushed on top in the order given)."""

    __slots__ = ("_num_pages", "_free", "_is_free")

    def __init__(self, num_pages: int) -> None:
        num_pages = as_int("number of pages", num_pages)
        if num_pages < 0:
            raise KVCacheError(f"number of pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self.reset()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Free pages (TVM's ``GetNumAvailablePages``)."""
        return len(self._free)

    def free_page_ids(self) -> tuple[int, ...]:
        """The free list, bottom first: the last entry is the next page allocated."""
        return tuple(self._free)

    def reset(self) -> None:
        """Free every page and restore the initial order (page 0 on top)."""
        self._free = list(range(self._num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self._num_pages

    def allocate(self, n: int) -> list[int]:
        """Pop ``n >= 0`` pages off the free stack, in allocation order."""
        n = as_int("number of pages to allocate", n)
        if n < 0:
            raise KVCacheError(f"number of pages to allocate must be >= 0, got {n}")
        if n > len(self._free):
            raise CacheFullError(f"the KV cache is full: {n} page(s) needed but only "
                                 f"{len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        for page in pages:
            self._is_free[page] = 0
        return pages

    def release(self, page_ids: Iterable[int]) -> None:
        """Push allocated pages back, in the given order (the last one ends on top)."""
        pages = list(page_ids)
        seen: set[int] = set()
        for page in pages:
            if type(page) is not int or not 0 <= page < self._num_pages:
                raise KVCacheError(f"page id {page!r} is not in range [0, {self._num_pages})")
            if self._is_free[page] or page in seen:
                raise KVCacheError(f"page {page} is released twice (it is already free)")
            seen.add(page)
        for page in pages:
            self._is_free[page] = 1
        self._free.extend(pages)
