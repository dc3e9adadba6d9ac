"""The pool of KV-cache pages: free pages in TVM's free-list order, and, with prefix caching,
reference counts and the cached pages no sequence holds."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Optional

from ..errors import CacheFullError, KVCacheError
from ._checks import as_int
from .host_tier import HostTier
from .prefix import PrefixIndex


class PagePool:
    """The free page ids, a stack as TVM's ``free_page_ids_`` (page 0 on top at first; released
    pages pushed on top in the order given).

    With a `PrefixIndex`, pages are reference-counted (blocks share registered pages) and a
    registered page released by its last holder is kept as *cached*: available, but handed
    out (evicted, its registration dropped) only once the free stack is empty, least recently
    released first and, among pages released together, deepest prefix first. With a
    `HostTier`, evicted pages go there."""

    __slots__ = ("_num_pages", "_free", "_refs", "_cached", "_index", "_host")

    def __init__(self, num_pages: int, index: Optional[PrefixIndex] = None, host: Optional[HostTier] = None) -> None:
        num_pages = as_int("number of pages", num_pages)
        if num_pages < 0:
            raise KVCacheError(f"number of pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._index, self._host = index, host
        self.reset()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages available to new tokens: free and cached (TVM's ``GetNumAvailablePages``)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Cached pages no sequence holds (evictable)."""
        return len(self._cached)

    def free_page_ids(self) -> tuple[int, ...]:
        """The free list, bottom first: the last entry is the next page allocated."""
        return tuple(self._free)

    def cached_page_ids(self) -> tuple[int, ...]:
        """The cached pages no sequence holds, next evicted first."""
        return tuple(self._cached)

    def refs(self, page: int) -> int:
        """How many blocks hold ``page`` (0: free or cached)."""
        return self._refs[page]

    def reset(self) -> None:
        """Free every page and restore the initial order (page 0 on top)."""
        self._free = list(range(self._num_pages - 1, -1, -1))
        self._refs = [0] * self._num_pages
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        if self._index is not None:
            self._index.reset()
        if self._host is not None:
            self._host.reset()

    def allocate(self, n: int) -> list[int]:
        """Pop ``n >= 0`` pages off the free stack (then evict cached pages), in allocation order."""
        n = as_int("number of pages to allocate", n)
        if n < 0:
            raise KVCacheError(f"number of pages to allocate must be >= 0, got {n}")
        if n > self.num_free:
            raise CacheFullError(f"the KV cache is full: {n} page(s) needed but only "
                                 f"{self.num_free} free")
        return self.take(n) if n else []

    def take(self, n: int) -> list[int]:
        """`allocate` of ``0 < n <= num_free`` pages, checked by the caller (a decode lane)."""
        if n > len(self._free):
            self._evict(n - len(self._free))
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        refs = self._refs
        for page in pages:
            refs[page] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Add a holder to each of ``pages`` (registered ones: held or cached)."""
        for page in pages:
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop a holder of each page; a page left without one goes back on the free stack, in
        the given order (the last one ends on top), or, when registered, into the cached pages."""
        pages = list(page_ids)
        seen: dict[int, int] = {}
        for page in pages:
            if type(page) is not int or not 0 <= page < self._num_pages:
                raise KVCacheError(f"page id {page!r} is not in range [0, {self._num_pages})")
            seen[page] = seen.get(page, 0) + 1
            if seen[page] > self._refs[page]:
                raise KVCacheError(f"page {page} is released twice (it is already free)")
        refs, index = self._refs, self._index
        if index is None:
            for page in pages:
                refs[page] = 0
            self._free.extend(pages)
            return
        cached = []
        for page in pages:
            refs[page] -= 1
            if refs[page]:
                continue
            if index.is_registered(page):
                cached.append(page)
            else:
                self._free.append(page)
        cached.sort(key=index.depth, reverse=True)
        self._cached.update(dict.fromkeys(cached))

    def drop_cached(self, page: int) -> None:
        """Unregister a page (its content is about to change): a cached one becomes free."""
        if self._index is not None:
            self._index.unregister(page)
        if page in self._cached:
            del self._cached[page]
            self._free.append(page)

    def _evict(self, n: int) -> None:
        """Move the ``n`` least recently released cached pages to the free stack (their
        entries to the host tier, if any)."""
        pages = [self._cached.popitem(last=False)[0] for _ in range(n)]
        evicted = self._index.evict(pages)  # type: ignore[union-attr]
        if self._host is not None:
            self._host.store(evicted)
        self._free.extend(pages)
