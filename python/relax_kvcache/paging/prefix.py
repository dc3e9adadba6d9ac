"""Automatic prefix caching: full pages keyed by a hash chain of their token ids.

A full page of a sequence that reported its token ids is registered under
``hash((previous page's key, its token ids, salt))``. A new sequence whose leading token ids
match registered pages takes them (shared, never written again). Pages whose last holder lets
go stay cached in the `PagePool` until the free list runs dry, then leave least recently used
first (deepest prefix first among pages released together).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Optional

import numpy as np

from ..errors import ArgumentError

#: What may salt a sequence's keys (tenant isolation, vLLM's ``cache_salt``).
SALT_TYPES = (type(None), str, bytes, int)


@dataclasses.dataclass(frozen=True, slots=True)
class PageEntry:
    """What a registered page holds: its chain ``key``, the key of the page before it (None for
    the first page), its token ids, the sequence salt and ``depth`` (its index in the chain)."""

    key: int
    parent_key: Optional[int]
    tokens: tuple[int, ...]
    salt: Hashable
    depth: int


@dataclasses.dataclass(slots=True)
class TokenLog:
    """The token ids of a sequence's tokens, for registering its pages as they fill; owned by
    `PagingState` (the sequence's ``tokens`` field)."""

    salt: Hashable
    ids: list[int] = dataclasses.field(default_factory=list)  # one per token, position order
    keys: list[int] = dataclasses.field(default_factory=list)  # one per full page, chain order

    def truncated(self, length: int, page_size: int) -> "TokenLog":
        """The log of the first ``length`` tokens (a fork or a pop)."""
        return TokenLog(self.salt, self.ids[:length], self.keys[: length // page_size])


@dataclasses.dataclass
class PrefixStats:
    """Counters of :meth:`PagedAttentionKVCache.prefix_cache_stats`."""

    lookups: int = 0  # add_sequence calls with token ids
    lookup_tokens: int = 0  # tokens those calls could have found (all but the last of each)
    hit_tokens: int = 0  # tokens they found cached
    registered: int = 0  # pages registered so far
    evicted: int = 0  # cached pages evicted for new tokens
    spilled: int = 0  # evicted pages copied to the host tier
    loaded: int = 0  # host pages copied back on a hit
    host_dropped: int = 0  # host pages dropped for room


class PrefixIndex:
    """Registered pages by key and by page id (the one owner of that mapping)."""

    def __init__(self, page_size: int, stats: Optional[PrefixStats] = None) -> None:
        self.page_size = page_size
        self._by_key: dict[int, int] = {}
        self._entries: dict[int, PageEntry] = {}
        self.stats = PrefixStats() if stats is None else stats

    def __len__(self) -> int:
        return len(self._entries)

    def is_registered(self, page: int) -> bool:
        return page in self._entries

    def entry(self, page: int) -> Optional[PageEntry]:
        return self._entries.get(page)

    def items(self) -> list[tuple[int, PageEntry]]:
        """(page, entry) of every registered page, sorted by page id."""
        return sorted(self._entries.items())

    @staticmethod
    def key(parent_key: Optional[int], tokens: tuple[int, ...], salt: Hashable) -> int:
        return hash((parent_key, tokens, salt))

    def find(self, key: int) -> Optional[tuple[int, PageEntry]]:
        """The registered page holding ``key`` and its entry (None: not on the device)."""
        page = self._by_key.get(key)
        return None if page is None else (page, self._entries[page])

    def register(self, page: int, parent_key: Optional[int], tokens: tuple[int, ...], salt: Hashable,
                 depth: int) -> int:
        """Register ``page`` unless its key is taken (by a page of the same tokens); its key."""
        key = self.key(parent_key, tokens, salt)
        if key not in self._by_key and page not in self._entries:
            self._by_key[key] = page
            self._entries[page] = PageEntry(key, parent_key, tokens, salt, depth)
            self.stats.registered += 1
        return key

    def restore(self, page: int, entry: PageEntry) -> None:
        """Register ``page`` (loaded from the host) under ``entry`` again."""
        if entry.key not in self._by_key:
            self._by_key[entry.key] = page
            self._entries[page] = entry

    def unregister(self, page: int) -> None:
        entry = self._entries.pop(page, None)
        if entry is not None:
            del self._by_key[entry.key]

    def evict(self, pages: list[int]) -> list[tuple[int, PageEntry]]:
        """Unregister the evicted ``pages``; their (page, entry) pairs."""
        evicted = [(page, self._entries[page]) for page in pages]
        for page in pages:
            self.unregister(page)
        self.stats.evicted += len(pages)
        return evicted

    def depth(self, page: int) -> int:
        return self._entries[page].depth

    def reset(self) -> None:
        self._by_key.clear()
        self._entries.clear()


def check_salt(salt: object) -> Hashable:
    """``salt`` checked: None, a str, bytes or an int."""
    if not isinstance(salt, SALT_TYPES) or isinstance(salt, bool):
        raise ArgumentError(f"salt must be None, a str, bytes or an int, got {type(salt).__name__}")
    return salt


def check_token_ids(what: str, token_ids: object, length: Optional[int] = None) -> list[int]:
    """``token_ids`` (a sequence or 1-D integer array of non-negative ids) as a list of ints,
    ``length`` of them when given."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ArgumentError(f"{what} must be a 1-D integer array, got dtype {token_ids.dtype} and shape "
                                f"{token_ids.shape}")
        ids = token_ids.tolist()
    else:
        try:
            ids = list(token_ids)  # type: ignore[arg-type]
        except TypeError:
            raise ArgumentError(f"{what} must be a sequence of token ids, got {type(token_ids).__name__}") from None
        for i, value in enumerate(ids):
            if type(value) is not int:
                if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                    raise ArgumentError(f"{what}[{i}] must be an int token id, got {type(value).__name__}")
                ids[i] = int(value)
    if length is not None and len(ids) != length:
        raise ArgumentError(f"{what} has {len(ids)} ids; expected {length}, one per appended token")
    if ids and min(ids) < 0:
        i = ids.index(min(ids))
        raise ArgumentError(f"{what}[{i}] is {ids[i]}; token ids must be >= 0")
    return ids
