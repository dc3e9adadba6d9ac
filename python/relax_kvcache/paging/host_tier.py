"""`HostTier`: the host-memory tier of prefix caching. Registered pages evicted from the device
keep their entry here, in one of ``capacity`` host slots, and come back on a hit.

Only bookkeeping: the copies themselves are recorded as `HostMove` records, in the order they
must run, for the cache to carry out before its next kernel.
"""

from __future__ import annotations

import collections
import heapq
from typing import NamedTuple, Optional

from .prefix import PageEntry, PrefixStats


class HostMove(NamedTuple):
    """Copy one page between device page ``page`` and host slot ``slot``: to the host
    (``to_host``, a spill of an evicted page) or back (a load on a hit)."""

    to_host: bool
    page: int
    slot: int


class HostTier:
    """Host slots holding evicted registered pages: by key, least recently stored first.

    ``store`` takes evicted pages (dropping the oldest host entries when the slots run out),
    ``take`` hands one back for a load; each records its `HostMove`. Owned by the `PrefixIndex`.
    """

    def __init__(self, capacity: int, stats: PrefixStats) -> None:
        self.capacity = capacity
        self._stats = stats
        self.reset()

    def __len__(self) -> int:
        return len(self._entries)

    def reset(self) -> None:
        self._free = list(range(self.capacity))  # a heap: the lowest slots first, so runs stay contiguous
        self._entries: collections.OrderedDict[int, PageEntry] = collections.OrderedDict()  # slot -> entry, oldest first
        self._by_key: dict[int, int] = {}
        self.moves: list[HostMove] = []

    def find(self, key: int) -> Optional[tuple[int, PageEntry]]:
        """The slot holding ``key`` and its entry (None: not on the host)."""
        slot = self._by_key.get(key)
        return None if slot is None else (slot, self._entries[slot])

    def items(self) -> list[tuple[int, PageEntry]]:
        """(slot, entry) of every page on the host, sorted by slot."""
        return sorted(self._entries.items())

    def store(self, evicted: list[tuple[int, PageEntry]]) -> None:
        """Spill the evicted ``(page, entry)`` pairs (oldest first) to host slots, dropping the
        oldest host entries for room; keys already on the host are not stored twice."""
        if not self.capacity:
            return
        fresh, seen = [], set()
        for page, entry in evicted:
            if entry.key not in self._by_key and entry.key not in seen:
                fresh.append((page, entry))
                seen.add(entry.key)
        room = len(self._free) + len(self._entries)  # slots being loaded are neither
        fresh = fresh[max(len(fresh) - room, 0):]  # more than fit: keep the newest
        while len(self._free) < len(fresh):
            slot, entry = self._entries.popitem(last=False)
            del self._by_key[entry.key]
            heapq.heappush(self._free, slot)
            self._stats.host_dropped += 1
        slots = {page: heapq.heappop(self._free) for page, _ in sorted(fresh, key=lambda pair: pair[0])}
        self.moves += [HostMove(True, page, slots[page]) for page in sorted(slots)]
        for page, entry in fresh:
            self._entries[slots[page]] = entry
            self._by_key[entry.key] = slots[page]
        self._stats.spilled += len(fresh)

    def take(self, slot: int) -> PageEntry:
        """Remove slot ``slot``'s entry (about to load); `load` then frees the slot."""
        entry = self._entries.pop(slot)
        del self._by_key[entry.key]
        return entry

    def load(self, slot: int, page: int) -> None:
        """Record the copy of a taken ``slot`` into device ``page``, and free the slot."""
        self.moves.append(HostMove(False, page, slot))
        heapq.heappush(self._free, slot)
        self._stats.loaded += 1

    def take_moves(self) -> list[HostMove]:
        """The copies recorded since the last call, in order."""
        moves, self.moves = self.moves, []
        return moves
