"""Model-based property test of prefix caching in the paging layer (no kernels).

A `PagingState` with prefix caching runs random operations: add with or without token ids (and
one of two salts), steps that append tokens with or without their ids, remove, fork, popn and
steps big enough to force evictions. A shadow of the page memory records, per slot, the
``(token id, position)`` written there: a step writes its tokens at the slots the paging state
gave them, and a `PageCopy` copies slots as the cache's copy kernel would. Each sequence's
expected contents are its token ids. After every operation:

* every live sequence's slots hold exactly its tokens (a cached page was never evicted or
  written while a sequence reads it, and a hit brings exactly the prompt's tokens);
* every registered page holds exactly the tokens of its entry at positions
  ``depth * page_size + j``, and its key chain is its tokens' (``PrefixIndex.key``);
* reference counts equal the number of live blocks holding each page; free, cached and held
  pages partition the pool; only registered pages are shared between blocks or cached;
* a hit returns whole pages, at most ``len(token_ids) - 1`` tokens, and at least the longest
  prefix a live sequence of the same salt holds in registered pages (those cannot be evicted);
* a refused operation (`CacheFullError`) leaves the state exactly as it was.

`HostTierMachine` runs the same with a host tier of a few slots: the `HostMove` copies the
paging state asks for after each operation are applied to a shadow of the host memory first,
and every page on the host holds exactly its entry's tokens.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relax_kvcache.errors import CacheFullError
from relax_kvcache.paging import PagingState
from relax_kvcache.paging.prefix import PrefixIndex

PS = 4
VOCAB = 50
#: prompts start with a prefix of one of these (system prompts), then a few random ids
STEMS = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14), (1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5), (7,) * 16)
SALTS = (None, "tenant")


class PrefixMachine(RuleBasedStateMachine):
    PAGES, HOST_PAGES = 12, 0

    def __init__(self) -> None:
        super().__init__()
        self.state = PagingState(self.PAGES, PS, prefix_caching=True, host_pages=self.HOST_PAGES)
        self.host: dict[int, tuple[int, int]] = {}  # host slot * PS + j -> (token id, position)
        self.prompt: dict[int, list[int]] = {}  # seq -> the rest of its prompt, appended by steps first
        self.memory: dict[int, tuple[int, int]] = {}  # slot -> (token id, position)
        self.tokens: dict[int, list[int]] = {}  # seq -> its token ids
        self.salt: dict[int, object] = {}
        self.known: dict[int, bool] = {}  # whether every token of the sequence came with its id
        self.next_id = 0

    # ------------------------------------------------------------------ helpers

    def _write(self, seq: int, start: int) -> None:
        toks = self.tokens[seq]
        for pos, slot in zip(range(start, len(toks)), self.state.position_map(seq, start).tolist()):
            self.memory[slot] = (toks[pos], pos)

    def _sync(self) -> None:
        """Carry out the host-tier copies the last operation asked for, in order."""
        for move in self.state.take_host_moves():
            src, dst = (self.memory, self.host) if move.to_host else (self.host, self.memory)
            a, b = (move.page, move.slot) if move.to_host else (move.slot, move.page)
            for j in range(PS):
                if a * PS + j in src:
                    dst[b * PS + j] = src[a * PS + j]
                else:
                    dst.pop(b * PS + j, None)

    def _copy(self, copies) -> None:
        self._sync()
        for c in copies:
            for j in range(c.length):
                src = c.src_page * PS + j
                if src in self.memory:
                    self.memory[c.dst_page * PS + j] = self.memory[src]
                else:
                    self.memory.pop(c.dst_page * PS + j, None)

    def _try(self, fn):
        before = (copy.deepcopy(self.state.debug_snapshot()), self.state.num_free_pages)
        try:
            return True, fn()
        except CacheFullError:
            assert (self.state.debug_snapshot(), self.state.num_free_pages) == before, "refusal changed the state"
            assert self.state.take_host_moves() == [], "a refusal asked for copies"
            return False, None

    def _live_registered_prefix(self, ids: list[int], salt) -> int:
        """Tokens of ``ids`` that a live sequence of the same salt holds in pages registered under
        its own key chain (a page whose twin holds the key is not counted)."""
        entries = dict(self.state.registered_pages())
        best = 0
        for seq, toks in self.tokens.items():
            log = self.state.sequence(seq).tokens
            if self.salt[seq] != salt or log is None:
                continue
            pages = (self.state.position_map(seq)[::PS] // PS).tolist()
            held = 0
            while (held < len(log.keys) and pages[held] in entries
                   and entries[pages[held]].key == log.keys[held]):
                held += 1
            n = 0
            while n < min(held * PS, len(ids) - 1, len(toks)) and toks[n] == ids[n]:
                n += 1
            best = max(best, n // PS * PS)
        return best

    # ------------------------------------------------------------------ rules

    @initialize(warm=st.booleans())
    def start(self, warm: bool) -> None:
        """Often start warm: each stem's prompt computed and finished, so that its pages are
        cached (or, with a small pool, evicted)."""
        for stem in STEMS if warm else ():
            self._add(list(stem) + [0], None)
            seq = max(self.tokens)
            self._step([seq], [self.prompt[seq]], True)
            self.state.remove_sequence(seq)
            del self.tokens[seq], self.salt[seq], self.known[seq]

    @rule(data=st.data(), with_ids=st.sampled_from((True,) * 7 + (False,)))
    def add(self, data, with_ids: bool) -> None:
        salt = data.draw(st.sampled_from(SALTS))
        ids = None
        if with_ids:
            stem = data.draw(st.sampled_from(STEMS))
            ids = list(stem[:data.draw(st.sampled_from((len(stem), len(stem), 2 * PS + 1, PS + 2, 3)))])
            ids += data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if ids else 1, max_size=6))
        self._add(ids, salt)

    @precondition(lambda self: self.state.registered_pages() or self.state.host_pages())
    @rule(data=st.data())
    def add_cached_prompt(self, data) -> None:
        """A prompt comes back: the tokens of a cached page's chain (device or host), and more."""
        on_host = [e for _, e in self.state.host_pages()]
        entries = {e.key: e for e in [e for _, e in self.state.registered_pages()] + on_host}
        tips = on_host if on_host and data.draw(st.booleans()) else list(entries.values())
        tip = data.draw(st.sampled_from(sorted(tips, key=lambda e: (e.depth, e.tokens, str(e.salt)))))
        chain = [tip]
        while chain[-1].parent_key in entries:
            chain.append(entries[chain[-1].parent_key])
        ids = [t for entry in reversed(chain) for t in entry.tokens]
        self._add(ids + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)), tip.salt)

    def _add(self, ids, salt) -> None:
        seq = self.next_id
        self.next_id += 1
        floor = self._live_registered_prefix(ids, salt) if ids else 0
        hit = self.state.add_sequence(seq, ids, salt)
        self._sync()
        self.tokens[seq], self.salt[seq], self.known[seq] = (ids or [])[:hit], salt, True
        self.prompt[seq] = (ids or [])[hit:]
        if ids:
            assert hit % PS == 0 and hit <= len(ids) - 1, (hit, len(ids))
            assert hit >= floor, f"a live sequence holds {floor} registered tokens of the prompt, hit {hit}"
        else:
            assert hit == 0

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), with_ids=st.sampled_from((True,) * 7 + (False,)))
    def step(self, data, with_ids: bool) -> None:
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=3, unique=True))
        new = []
        for seq in seqs:  # the rest of its prompt (chunked prefill), or often the rest of a stem
            toks, stem = self.tokens[seq], data.draw(st.sampled_from(STEMS))
            rest = list(stem[len(toks):]) if tuple(toks) == stem[:len(toks)] else []
            rest = self.prompt.get(seq) or rest
            new.append(rest[:data.draw(st.integers(1, 9))] or data.draw(
                st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9)))
        self._step(seqs, new, with_ids)

    def _step(self, seqs: list[int], new: list[list[int]], with_ids: bool) -> None:
        ok, _ = self._try(lambda: self.state.reserve_append(seqs, [len(n) for n in new]))
        if not ok:
            return
        self._sync()
        for seq, ids in zip(seqs, new):
            start = len(self.tokens[seq])
            self.prompt[seq] = self.prompt.get(seq, [])[len(ids):]
            self.tokens[seq] += ids
            self._write(seq, start)
            self.known[seq] = self.known[seq] and with_ids
        flat = [t for ids in new for t in ids] if with_ids else None
        self.state.record_tokens(seqs, [len(n) for n in new], flat)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def remove(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.state.remove_sequence(seq)
        del self.tokens[seq], self.salt[seq], self.known[seq]

    @precondition(lambda self: len(self.tokens) > 1)
    @rule()
    def finish_oldest(self) -> None:
        """Requests finish: their pages become cached, and the next ones must evict."""
        seq = min(self.tokens)
        self.state.remove_sequence(seq)
        del self.tokens[seq], self.salt[seq], self.known[seq]

    @precondition(lambda self: len(self.tokens) > 2)
    @rule()
    def finish_all(self) -> None:
        """Every request finishes: the next ones start on cached (or host) pages."""
        for seq in list(self.tokens):
            self.state.remove_sequence(seq)
        self.tokens.clear(), self.salt.clear(), self.known.clear()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        pos = data.draw(st.integers(0, len(self.tokens[parent])))
        child = self.next_id
        ok, copies = self._try(lambda: self.state.fork_sequence(parent, child, pos))
        if not ok:
            return
        self.next_id += 1
        self._copy(copies)
        self.tokens[child] = self.tokens[parent][:pos]
        self.salt[child], self.known[child] = self.salt[parent], self.known[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def popn(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tokens[seq])))
        ok, copies = self._try(lambda: self.state.popn(seq, n))
        if ok:
            self._copy(copies)
            del self.tokens[seq][len(self.tokens[seq]) - n:]

    @precondition(lambda self: any(len(t) > PS for t in self.tokens.values()))
    @rule(data=st.data())
    def popn_into_full_page(self, data) -> None:
        """Pop into a full page (often cached, and shared with another sequence)."""
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.tokens.items() if len(t) > PS)))
        full = len(self.tokens[seq]) // PS
        keep = data.draw(st.integers(0, full - 1)) * PS + data.draw(st.integers(1, PS - 1))
        ok, copies = self._try(lambda: self.state.popn(seq, len(self.tokens[seq]) - keep))
        if ok:
            self._copy(copies)
            del self.tokens[seq][keep:]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def contents(self) -> None:
        for seq, toks in self.tokens.items():
            assert self.state.sequence_length(seq) == len(toks)
            got = [self.memory.get(slot) for slot in self.state.position_map(seq).tolist()]
            assert got == [(t, p) for p, t in enumerate(toks)], f"sequence {seq} reads other tokens"
            log = self.state.sequence(seq).tokens
            if log is not None:
                assert self.known[seq] and log.ids == toks and len(log.keys) == len(toks) // PS

    @invariant()
    def registered_pages(self) -> None:
        keys = {}
        for page, entry in self.state.registered_pages():
            slots = [self.memory.get(page * PS + j) for j in range(PS)]
            assert slots == [(t, entry.depth * PS + j) for j, t in enumerate(entry.tokens)], f"page {page}"
            assert entry.key == PrefixIndex.key(entry.parent_key, entry.tokens, entry.salt)
            keys[entry.key] = entry
        for entry in keys.values():  # a page's parent, when still registered, is one level up
            parent = keys.get(entry.parent_key)
            assert entry.parent_key is None or parent is None or parent.depth == entry.depth - 1

    @invariant()
    def host_pages(self) -> None:
        assert self.state.take_host_moves() == [], "copies left undone"
        slots = self.state.host_pages()
        assert len(slots) <= self.HOST_PAGES
        for slot, entry in slots:
            got = [self.host.get(slot * PS + j) for j in range(PS)]
            assert got == [(t, entry.depth * PS + j) for j, t in enumerate(entry.tokens)], f"host slot {slot}"

    @invariant()
    def page_ownership(self) -> None:
        snap = self.state.debug_snapshot()
        pool = self.state._tree.pages
        held: dict[int, int] = {}
        for block in snap["blocks"].values():
            for page in block[1]:
                held[page] = held.get(page, 0) + 1
        free, cached = set(snap["free_pages"]), set(snap["cached_pages"])
        registered = {page for page, _ in snap["registered"]}
        assert not free & cached and not (free | cached) & held.keys()
        assert free | cached | held.keys() == set(range(self.PAGES))
        assert cached <= registered
        for page in range(self.PAGES):
            assert pool.refs(page) == held.get(page, 0), f"page {page}"
            if held.get(page, 0) > 1:
                assert page in registered, f"page {page} is shared but not registered"
        assert self.state.num_free_pages == len(free) + len(cached)

    def teardown(self) -> None:
        for seq in list(self.tokens):
            self.state.remove_sequence(seq)
        assert self.state.empty() and self.state.num_free_pages == self.PAGES


class HostTierMachine(PrefixMachine):
    PAGES, HOST_PAGES = 8, 6  # a small pool: most runs spill to the host and load back


SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCaching = PrefixMachine.TestCase
TestPrefixCaching.settings = SETTINGS
TestHostTier = HostTierMachine.TestCase
TestHostTier.settings = SETTINGS
