"""`PrefixCache`: what prefix caching does to the block tree: sequences that start on cached
pages, pages registered as they fill, and the copy-on-write of a shared page a pop reaches."""

from __future__ import annotations

from typing import Hashable, NamedTuple, Optional

from ..errors import SequenceError
from .host_tier import HostTier
from .prefix import PrefixIndex, PrefixStats, TokenLog
from .sequences import Sequence
from .tree import BlockTree, PageCopy, PopPlan


class Hit(NamedTuple):
    """Where a cached page of a lookup is: device ``page`` (``slot`` -1) or host ``slot``
    (``page`` -1)."""

    page: int
    slot: int


class PrefixCache:
    """Prefix caching over a `BlockTree` whose page pool shares `index`; `PagingState` calls it
    around its own operations (checks first, as everywhere)."""

    def __init__(self, tree: BlockTree, index: PrefixIndex, host: Optional[HostTier] = None) -> None:
        self._tree, self._index, self._host = tree, index, host
        self._ps = tree.page_size

    @property
    def stats(self) -> PrefixStats:
        return self._index.stats

    @property
    def index(self) -> PrefixIndex:
        return self._index

    def attach(self, seq: Sequence, token_ids: Optional[list[int]], salt: Hashable) -> int:
        """Give the new, empty ``seq`` the cached pages of the leading full pages of
        ``token_ids`` (all but the last token at most) and start its token log; the tokens it
        now holds."""
        if token_ids is None:
            seq.tokens = TokenLog(salt)
            return 0
        ps, stats = self._ps, self._index.stats
        hits = self._affordable(self._lookup(token_ids, salt, max(len(token_ids) - 1, 0) // ps))
        pages = self._take(hits)
        stats.lookups += 1
        stats.lookup_tokens += max(len(token_ids) - 1, 0)
        hit = len(pages) * ps
        stats.hit_tokens += hit
        block = self._tree.blocks[seq.last_block]
        block.page_ids.extend(pages)
        block.seq_length = seq.seq_length = hit
        keys = [self._index.entry(page).key for page in pages]  # type: ignore[union-attr]
        seq.tokens = TokenLog(salt, token_ids[:hit], keys)
        return hit

    def _lookup(self, token_ids: list[int], salt: Hashable, most_pages: int) -> list[Hit]:
        """Where the leading full pages of ``token_ids`` (at most ``most_pages``) are cached, in
        order: the longest chain of hits from the first page, on the device or the host."""
        ps, hits, parent = self._ps, [], None
        for i in range(most_pages):
            tokens = tuple(token_ids[i * ps:(i + 1) * ps])
            key = PrefixIndex.key(parent, tokens, salt)
            found, on_device = self._index.find(key), True
            if found is None and self._host is not None:
                found, on_device = self._host.find(key), False
            if found is None or (found[1].parent_key, found[1].tokens, found[1].salt) != (parent, tokens, salt):
                break  # a miss (or a hash collision, which counts as one)
            hits.append(Hit(found[0], -1) if on_device else Hit(-1, found[0]))
            parent = key
        return hits

    def _affordable(self, hits: list[Hit]) -> list[Hit]:
        """The leading ``hits`` whose host pages fit in the pages available once the device
        hits are held (a loaded page takes an available one)."""
        pool, free = self._tree.pages, self._tree.pages.num_free
        for n, hit in enumerate(hits):
            if hit.page >= 0:
                free -= pool.refs(hit.page) == 0  # a cached page stops counting as available
            elif free == 0:
                return hits[:n]
            else:
                free -= 1
        return hits

    def _take(self, hits: list[Hit]) -> list[int]:
        """Hold the device pages of ``hits`` and load their host pages into fresh pages (the
        copies recorded in the host tier); the pages, in order."""
        pool, host = self._tree.pages, self._host
        pages = [hit.page for hit in hits]
        pool.retain([page for page in pages if page >= 0])
        loads = [(i, hit.slot, host.take(hit.slot)) for i, hit in enumerate(hits) if hit.page < 0]  # type: ignore[union-attr]
        for (i, slot, entry), page in zip(loads, pool.allocate(len(loads))):  # may spill other pages first
            host.load(slot, page)  # type: ignore[union-attr]
            self._index.restore(page, entry)
            pages[i] = page
        return pages

    def record(self, seq: Sequence, length: int, ids: Optional[list[int]]) -> None:
        """``seq`` appended ``length`` tokens (ids ``ids``, None: unknown) in the step that ends:
        extend its log and register the pages they filled; a sequence whose ids are unknown stops
        registering."""
        log = seq.tokens
        if log is None:
            return
        if ids is None or len(log.ids) + length != seq.seq_length:
            seq.tokens = None
            return
        log.ids.extend(ids)
        ps, keys = self._ps, log.keys
        full = len(log.ids) // ps
        if full == len(keys):
            return
        block = self._tree.blocks[seq.last_block]
        first_page = (seq.seq_length - block.seq_length) // ps  # blocks start page-aligned
        for i in range(len(keys), full):
            page = block.page_ids[i - first_page]
            tokens = tuple(log.ids[i * ps:(i + 1) * ps])
            keys.append(self._index.register(page, keys[-1] if keys else None, tokens, log.salt, i))

    def pop_copy_needed(self, seq: Sequence, plan: PopPlan, new_length: int) -> tuple[int, int]:
        """For a pop that trims ``seq`` in place to ``new_length``: the page its kept partial
        last page is (-1: none) and the pages the trim frees (for the copy-on-write check)."""
        if plan.remaining or plan.trim_block == -1 or not new_length % self._ps:
            return -1, 0
        pool, blocks = self._tree.pages, self._tree.blocks
        block = blocks[plan.trim_block]
        if block.sink_length or block.sliding_window_offset:  # slid: holds no cached page
            return -1, 0
        kept = block.page_ids[: len(block.page_ids) - plan.trim_pages]
        if not kept:
            return -1, 0
        dropped = [p for i in plan.freed_blocks for p in blocks[i].page_ids]
        dropped += block.page_ids[len(kept):]
        return kept[-1], sum(pool.refs(p) == 1 for p in dropped)

    def after_pop(self, seq: Sequence, page: int, new_length: int) -> list[PageCopy]:
        """Once ``seq`` was trimmed to ``new_length``: its partial last page ``page`` (from
        `pop_copy_needed`) will be written again: copy it when shared, else unregister it."""
        if seq.tokens is not None:
            seq.tokens = seq.tokens.truncated(new_length, self._ps)
        if page == -1:
            return []
        pool = self._tree.pages
        if pool.refs(page) == 1:
            pool.drop_cached(page)
            return []
        block = self._tree.blocks[seq.last_block]
        fresh = pool.allocate(1)[0]
        block.page_ids[-1] = fresh
        pool.release([page])
        return [PageCopy(page, fresh, new_length % self._ps)]

    def check_window(self, seq: Sequence) -> None:
        """A sequence that slides must not hold cached pages (other sequences may read them)."""
        held = [p for b in self._tree.trace_blocks(seq.last_block) for p in b.page_ids
                if self._index.is_registered(p)]
        if held:
            raise SequenceError(f"sequence {seq.seq_id} holds {len(held)} cached prefix page(s); a sliding window "
                                "drops pages as it slides, so it needs a sequence added without token_ids")

    def forked_log(self, parent: Sequence, pos: int) -> Optional[TokenLog]:
        return None if parent.tokens is None else parent.tokens.truncated(pos, self._ps)
