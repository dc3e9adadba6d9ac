"""The state machine's checker (``state_machine_model``): `Harness` runs each operation on a real cache,
after deriving from the model what it must do (`Expect`), and checks the outcome, the unchanged state
after an error, the attention outputs and the invariants.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable, List, Optional, Tuple

import ml_dtypes
import numpy as np
import tvm

from relax_kvcache.errors import CacheFullError, ForwardError, KVCacheError, SequenceError

from reference_model import attend, tree_visible
from sm_cache import (ATTENTION_CHUNK, CHUNK, FP8_SCALES, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, NUM_QO_HEADS,
                      PAGE_SIZE, SM_SCALE, STEMS, Mismatch, assert_unchanged, check_paging_invariants,
                      ensure, make_cache, snapshot, token_kv)
from sm_model import Model, check_against_model


@dataclasses.dataclass(frozen=True)
class Expect:
    """What an operation must do: raise one of ``raises`` (``must_raise``) or succeed; with
    ``must_raise`` False an error in ``raises`` is also accepted. ``free_delta``: the exact change of
    the free page count on success, where the model knows it."""

    raises: Tuple[type, ...] = ()
    must_raise: bool = False
    free_delta: Optional[int] = None


def _fail(*errors: type) -> Expect:
    return Expect(tuple(errors), True)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


# ----------------------------------------------------------------------------------- the harness

class Harness:
    """One cache plus its model; each method is one operation, checked as the module docstring says.

    Methods return True when the operation succeeded, False when it raised (as allowed).
    """

    def __init__(self, kind: str, seed: int = 0, record: bool = False) -> None:
        self.kind = kind
        self.cache = make_cache(kind)
        self.model = Model(slides=self.sliding)
        self.rng = np.random.default_rng(seed)  # K/V values
        self.errors: collections.Counter = collections.Counter()
        self.ops = 0
        self.outcomes: collections.Counter = collections.Counter()  # (operation, "ok" or error type)
        self.undecided = 0  # operations the model allowed both to succeed and to fail
        self.last_batch: Optional[List[int]] = None
        self._kv: Optional[dict] = {}  # debug_get_kv contents of the current state, when known
        self.history: Optional[list] = [] if record else None  # (method, args) of every operation
        self._ids: Optional[List[int]] = None  # the current step's token ids (prefix cache)

    @property
    def sliding(self) -> bool:
        return self.cache.config.support_sliding_window

    @property
    def chunk(self) -> int:
        """Attention chunk of layer 0 (0: not a chunked cache)."""
        return ATTENTION_CHUNK if self.kind == "chunked" else 0

    def free_pages(self) -> int:
        return self.cache.get_num_available_pages()

    # -- core
    def _run(self, what: str, expect: Expect, action: Callable[[], Any],
             apply: Optional[Callable[[Any], None]] = None) -> bool:
        self.ops += 1
        op = what.split("(")[0]
        self.undecided += bool(expect.raises) and not expect.must_raise
        before = snapshot(self.cache, self._kv)
        self._kv = None
        try:
            result = action()
        except KVCacheError as err:
            if not isinstance(err, expect.raises):
                raise Mismatch(f"{what}: unexpected {type(err).__name__}: {err}") from err
            after = snapshot(self.cache)
            assert_unchanged(before, after, what)
            self._kv = after["kv"]
            self.errors[type(err).__name__] += 1
            self.outcomes[op, type(err).__name__] += 1
            return False
        self.outcomes[op, "ok"] += 1
        if expect.must_raise:
            raise Mismatch(f"{what} succeeded; expected {' or '.join(e.__name__ for e in expect.raises)}")
        if apply is not None:
            apply(result)
        if expect.free_delta is not None:
            ensure(self.free_pages() == before["free_pages"] + expect.free_delta,
                    f"{what}: {self.free_pages()} free pages, expected "
                    f"{before['free_pages']} {expect.free_delta:+d}")
        self.check()
        return True

    def _record(self, method: str, *args: Any) -> None:
        if self.history is not None:
            self.history.append((method, args))

    def check(self) -> None:
        check_paging_invariants(self.cache)
        self._kv = check_against_model(self.cache, self.model)
        for page, entry in self.cache._paging.registered_pages():  # hold exactly their tokens' K/V
            stored = np.stack([p.numpy()[page] for p in self.cache._pages])  # (layers, 2, Hkv, ps, D)
            for j, token in enumerate(entry.tokens):
                want = token_kv(token, entry.depth * PAGE_SIZE + j).reshape(NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM)
                ensure(stored[:, :, :, j].tobytes() == want.tobytes(), f"registered page {page} holds other K/V")
        for slot, entry in self.cache._paging.host_pages():  # so do the pages on the host tier
            stored = np.stack([self.cache._host.read(layer, slot).view(np.float32).reshape(
                2, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM) for layer in range(NUM_LAYERS)])
            for j, token in enumerate(entry.tokens):
                want = token_kv(token, entry.depth * PAGE_SIZE + j).reshape(NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM)
                ensure(stored[:, :, :, j].tobytes() == want.tobytes(), f"host slot {slot} holds other K/V")

    # -- operations
    def add(self, seq_id: Any, ids: Optional[List[int]] = None) -> bool:
        """``add_sequence(seq_id)``; with prefix caching and ``ids`` (a prompt), the sequence may
        start on cached pages (the model then holds the tokens the cache says it found)."""
        self._record("add", seq_id, ids)
        if not _is_int(seq_id):
            expect = _fail(KVCacheError)
        else:  # reusing cached pages changes the available count
            expect = _fail(SequenceError) if seq_id in self.model.seqs else Expect(free_delta=None if ids else 0)

        def apply(hit: int) -> None:
            ensure(hit % PAGE_SIZE == 0 and hit <= max(len(ids or ()) - 1, 0), f"add_sequence found {hit} tokens")
            self.model.add(seq_id)
            self.model.load(seq_id, (ids or [])[:hit])
        return self._run(f"add_sequence({seq_id!r}, {ids!r})", expect, lambda: self.cache.add_sequence(seq_id, ids),
                         apply)

    def remove(self, seq_id: Any) -> bool:
        self._record("remove", seq_id)
        expect = Expect() if seq_id in self.model.seqs and _is_int(seq_id) else _fail(KVCacheError)

        def apply(_):
            self.model.remove(seq_id)
        return self._run(f"remove_sequence({seq_id!r})", expect, lambda: self.cache.remove_sequence(seq_id), apply)

    def checkpoint(self, src: Any, dst: Any) -> bool:
        """Save ``src`` (metadata and a page group per layer) and import it into ``dst``."""
        self._record("checkpoint", src, dst)
        return self._run(f"checkpoint({src!r} -> {dst!r})", self._expect_checkpoint(src, dst),
                         lambda: self._save_and_restore(src, dst), lambda _: self.model.restore(src, dst))

    def _save_and_restore(self, src: Any, dst: Any) -> None:
        cache = self.cache
        meta = cache.get_checkpoint_metadata(src)
        length = cache.get_sequence_length(src)
        groups = []
        for group in range(NUM_LAYERS):
            groups.append(tvm.runtime.empty((1, _pages(length), 2, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM), "float32"))
            cache.export_page_group(src, group, groups[-1])
        cache.prepare_import(dst, meta)
        for group in reversed(range(NUM_LAYERS)):
            cache.import_page_group(dst, group, groups[group])
        cache.finish_import(dst)

    def _expect_checkpoint(self, src: Any, dst: Any) -> Expect:
        seqs = self.model.seqs
        if not (_is_int(src) and _is_int(dst)) or src not in seqs:
            return _fail(KVCacheError)
        s = seqs[src]
        if s.window != -1 or s.tree is not None:
            return _fail(SequenceError)
        if dst in seqs:
            d = seqs[dst]
            if d.length or d.window != -1 or d.tree is not None:
                return _fail(SequenceError)
            return Expect((SequenceError, CacheFullError))  # an empty sequence forked from: refused
        if _pages(s.length) > self.free_pages():
            return _fail(CacheFullError)
        return Expect(free_delta=-_pages(s.length))

    def fork(self, parent: Any, child: Any, pos: Any) -> bool:
        self._record("fork", parent, child, pos)
        return self._run(f"fork_sequence({parent!r}, {child!r}, {pos!r})", self._expect_fork(parent, child, pos),
                         lambda: self.cache.fork_sequence(parent, child, pos),
                         lambda _: self.model.fork(parent, child, pos))

    def _expect_fork(self, parent: Any, child: Any, pos: Any) -> Expect:
        seqs = self.model.seqs
        errors = []
        if not _is_int(parent) or parent not in seqs:
            errors.append(SequenceError)
        if not _is_int(child) or child in seqs:
            errors.append(SequenceError)
        if not _is_int(pos):
            errors.append(KVCacheError)
        elif parent in seqs and not -1 <= pos <= seqs[parent].length:
            errors.append(SequenceError)
        if errors:
            return _fail(*errors)
        p = seqs[parent]
        pos = p.length if pos == -1 else pos
        if p.tree is not None:  # uncommitted token-tree nodes: no fork
            return _fail(SequenceError)
        if p.window != -1 and pos > p.sink_limit:
            return _fail(SequenceError)
        copies = int(pos % PAGE_SIZE != 0)  # a partial page is copied into a fresh page
        if copies > self.free_pages():
            return _fail(CacheFullError)
        return Expect(free_delta=-copies)

    def popn(self, seq_id: Any, n: Any) -> bool:
        self._record("popn", seq_id, n)
        return self._run(f"popn({seq_id!r}, {n!r})", self._expect_popn(seq_id, n),
                         lambda: self.cache.popn(seq_id, n), lambda _: self.model.popn(seq_id, n))

    def _expect_popn(self, seq_id: Any, n: Any, *, in_commit: bool = False) -> Expect:
        seqs = self.model.seqs
        if not _is_int(seq_id) or seq_id not in seqs or not _is_int(n) or not 0 <= n <= seqs[seq_id].length:
            return _fail(KVCacheError)
        s = seqs[seq_id]
        left, shared = s.length - n, self.model.max_share(seq_id)
        if n == 0:
            return Expect(free_delta=0)
        if s.tree is not None and not in_commit:  # popn: not with uncommitted token-tree nodes
            return _fail(SequenceError)
        if left >= shared:  # prefix caching: a page shared by cached-prefix reuse is copied
            cow = self.kind == "prefix" and left % PAGE_SIZE and self.free_pages() == 0
            return Expect((CacheFullError,) if cow else ())
        if s.tree is not None:  # the re-fork is a fork: not with uncommitted token-tree nodes
            return _fail(SequenceError)
        # Re-fork from the sequence's own prefix (inside prefix blocks: no sink check)
        if left % PAGE_SIZE and self.free_pages() == 0:
            if s.slid:
                return Expect((CacheFullError,))
            if s.length == shared:  # nothing unshared to free: no page for the partial copy
                return _fail(CacheFullError)
        return Expect()

    def enable_window(self, seq_id: Any, window: Any, sink: Any) -> bool:
        self._record("enable_window", seq_id, window, sink)
        return self._run(f"enable_sliding_window_for_seq({seq_id!r}, {window!r}, {sink!r})",
                         self._expect_window(seq_id, window, sink),
                         lambda: self.cache.enable_sliding_window_for_seq(seq_id, window, sink),
                         lambda _: self.model.enable_window(seq_id, window, sink))

    def _expect_window(self, seq_id: Any, window: Any, sink: Any) -> Expect:
        seqs = self.model.seqs
        if not (self.sliding or self.chunk) or not all(map(_is_int, (seq_id, window, sink))):
            return _fail(KVCacheError)
        if seq_id not in seqs or not 0 <= sink < window or seqs[seq_id].window != -1:
            return _fail(SequenceError)
        if self.sliding and window < seqs[seq_id].prefix:  # its prefix blocks cannot slide: every append would fail
            return _fail(SequenceError)
        return Expect(free_delta=0)

    def step(self, seq_ids: List[Any], lengths: List[Any], interrupt: Optional[str] = None,
             parents: Optional[List[Any]] = None) -> bool:
        """A forward step: begin_forward, attention_with_fused_qkv on every layer, end_forward.

        ``interrupt``: after begin_forward, try an operation not allowed during a step ("remove",
        "fork", "popn", "begin"); it must raise `ForwardError` and change nothing.
        ``parents``: the step's ``token_tree_parent_ptr`` (a token-tree step; plain cache only).
        """
        self._record("step", list(seq_ids), list(lengths), interrupt, parents)
        expect = self._expect_step(seq_ids, lengths, parents)

        def apply(_):
            self._attend_and_end(seq_ids, lengths, interrupt, parents)

        what = "step" if parents is None else "tree_step"
        ids = self._step_ids(seq_ids, lengths) if self.kind == "prefix" and parents is None else None
        self._ids = ids
        ok = self._run(f"{what}({seq_ids!r}, {lengths!r}{'' if parents is None else ', ' + repr(parents)})",
                       expect, lambda: self.cache.begin_forward(seq_ids, lengths, parents, token_ids=ids), apply)
        if ok:
            self.last_batch = list(seq_ids)
        return ok

    def _step_ids(self, seq_ids: List[Any], lengths: List[Any]) -> Optional[List[int]]:
        """Token ids of a step (prefix cache): a sequence on a stem continues it, others draw."""
        if not all(map(_is_int, lengths)) or any(n < 1 for n in lengths):
            return None
        ids = []
        for seq_id, n in zip(seq_ids, lengths):
            s = self.model.seqs.get(seq_id)
            known = list(s.ids) if s is not None and s.ids is not None else []
            stem = next((st for st in STEMS if tuple(known) == st[:len(known)]), ())
            new = list(stem[len(known):len(known) + n])
            ids += new + self.rng.integers(0, 16, n - len(new)).tolist()
        return ids

    def _tree_error(self, seq_ids: List[Any], lengths: List[Any], parents: List[Any]) -> bool:
        """Whether a tree step's trees are rejected (``ForwardError``): windows, or bad parents."""
        if self.sliding or self.chunk or not all(map(_is_int, parents)) or len(parents) != sum(lengths):
            return True
        off = 0
        for seq_id, n in zip(seq_ids, lengths):
            s = self.model.seqs.get(seq_id)
            old = len(s.tree) if s is not None and s.tree is not None else 0
            if old + n > 256 or any(not -1 <= p < old + i for i, p in enumerate(parents[off:off + n])):
                return True
            off += n
        return False

    def _expect_step(self, seq_ids: List[Any], lengths: List[Any], parents: Optional[List[Any]] = None) -> Expect:
        seqs = self.model.seqs
        errors = []
        if len(seq_ids) != len(lengths) or not seq_ids:
            errors.append(ForwardError)
        if not all(map(_is_int, lengths)):
            errors.append(KVCacheError)
        elif any(n < 1 for n in lengths) or sum(lengths) > CHUNK:
            errors.append(ForwardError)
        if any(not _is_int(s) or s not in seqs for s in seq_ids) or len(set(seq_ids)) != len(seq_ids):
            errors.append(SequenceError)
        if parents is None and any(_is_int(s) and s in seqs and seqs[s].tree is not None for s in seq_ids):
            errors.append(SequenceError)  # a step without a tree needs the trees committed
        if parents is not None:
            if not all(map(_is_int, lengths)) or len(seq_ids) != len(lengths):
                errors.append(ForwardError)
            elif self._tree_error(seq_ids, lengths, parents):
                errors.append(ForwardError)
        if errors:
            return _fail(*errors)
        exact, need, most, window_error = True, 0, 0, False
        for seq_id, n in zip(seq_ids, lengths):
            s = seqs[seq_id]
            slides = self.sliding and s.window != -1 and s.length + n > s.window
            if s.slid or slides:  # pages depend on the window offset, or the slide frees some
                exact = False
                most += _pages(n)
                window_error |= slides and s.window < s.sink_limit
            else:
                add = _pages(s.length + n) - _pages(s.length)  # last blocks start on page boundaries
                need += add
                most += add
        free = self.free_pages()
        if exact:
            return _fail(CacheFullError) if need > free else Expect(free_delta=-need)
        raises = ((SequenceError,) if window_error else ()) + ((CacheFullError,) if most > free else ())
        return Expect(raises, must_raise=window_error)

    def _attend_and_end(self, seq_ids: List[int], lengths: List[int], interrupt: Optional[str],
                        parents: Optional[List[int]] = None) -> None:
        cache, model = self.cache, self.model
        if interrupt is not None:
            self._interrupt(interrupt, seq_ids[0])
        n = sum(lengths)
        qkv = self.rng.standard_normal((NUM_LAYERS, n, NUM_QO_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        if self.cache.config.kv_dtype is not None:  # K / V on the 8-bit grid times the scales: stored exactly
            hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
            for part, scale in ((slice(hq, hq + hkv), FP8_SCALES[0]), (slice(hq + hkv, None), FP8_SCALES[1])):
                grid = qkv[:, :, part] * np.exp2(self.rng.integers(-3, 3, qkv[:, :, part].shape))
                qkv[:, :, part] = grid.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
        ids = self._ids if parents is None else None
        if ids is not None:  # prefix cache: K / V a function of the token and its position
            rows = []
            for seq_id, m in zip(seq_ids, lengths):
                start = model.seqs[seq_id].length
                rows += [token_kv(t, start + i) for i, t in enumerate(ids[len(rows):len(rows) + m])]
            qkv[:, :, NUM_QO_HEADS:] = np.stack(rows, axis=1)
        for layer in range(NUM_LAYERS):
            o = tvm.runtime.tensor(np.full((n, NUM_QO_HEADS, HEAD_DIM), np.nan, np.float32))
            cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer]), o, SM_SCALE)
            self._check_attention(seq_ids, lengths, qkv[layer], layer, o.numpy(), parents)
        cache.end_forward()
        hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
        off = 0
        for seq_id, m in zip(seq_ids, lengths):
            rows = qkv[:, off:off + m]
            if parents is None:
                model.append(seq_id, rows[:, :, hq:hq + hkv], rows[:, :, hq + hkv:],
                             None if ids is None else ids[off:off + m])
            else:
                model.tree_append(seq_id, parents[off:off + m], rows[:, :, hq:hq + hkv], rows[:, :, hq + hkv:])
            off += m

    def _check_attention(self, seq_ids, lengths, qkv: np.ndarray, layer: int, o: np.ndarray,
                         parents: Optional[List[int]] = None) -> None:
        """Each new token attends causally over its sequence's kept tokens and the step's; a token-tree
        node over the tokens before its tree, its ancestors and itself."""
        hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
        off = 0
        for seq_id, m in zip(seq_ids, lengths):
            s = self.model.seqs[seq_id]
            rows = qkv[off:off + m]
            k = np.concatenate([s.k[layer], rows[:, hq:hq + hkv]])
            v = np.concatenate([s.v[layer], rows[:, hq + hkv:]])
            if parents is None:
                expected = attend(rows[:, :hq], k, v, SM_SCALE, causal_offset=s.length,
                                  chunk=self.chunk if layer == 0 else 0)[0]
            else:
                old = s.tree or []
                start = s.tree_start if s.tree is not None else s.length
                vis = tree_visible(old + list(parents[off:off + m]))[len(old):]
                expected = np.stack([
                    attend(rows[i:i + 1, :hq], k[keys], v[keys], SM_SCALE, causal_offset=None)[0][0]
                    for i, keys in enumerate(np.r_[0:start, start + np.nonzero(row)[0]] for row in vis)])
            if not np.allclose(o[off:off + m], expected, rtol=1e-4, atol=1e-4):
                raise Mismatch(f"attention output of sequence {seq_id} (layer {layer}) differs from the "
                               f"reference by {np.nanmax(np.abs(o[off:off + m] - expected)):.3g}")
            off += m

    def _interrupt(self, what: str, seq_id: int) -> None:
        """An operation during the step must raise ForwardError and change nothing."""
        actions = {
            "remove": lambda: self.cache.remove_sequence(seq_id),
            "fork": lambda: self.cache.fork_sequence(seq_id, max(self.model.seqs) + 1, -1),
            "popn": lambda: self.cache.popn(seq_id, 0),
            "begin": lambda: self.cache.begin_forward([seq_id], [1]),
        }
        before = snapshot(self.cache)
        try:
            actions[what]()
        except ForwardError:
            assert_unchanged(before, snapshot(self.cache), f"{what} during a step")
            self.errors["ForwardError"] += 1
            return
        raise Mismatch(f"{what} during a step did not raise ForwardError")

    def commit(self, seq_ids: List[Any], leaves: List[Any]) -> bool:
        """``commit_accepted_token_tree_nodes(seq_ids, leaves)``."""
        self._record("commit", list(seq_ids), list(leaves))

        def apply(_):
            for seq_id, leaf in zip(seq_ids, leaves):
                self.model.commit(seq_id, leaf)
        return self._run(f"commit_accepted_token_tree_nodes({seq_ids!r}, {leaves!r})",
                         self._expect_commit(seq_ids, leaves),
                         lambda: self.cache.commit_accepted_token_tree_nodes(seq_ids, leaves), apply)

    def _expect_commit(self, seq_ids: List[Any], leaves: List[Any]) -> Expect:
        """Argument and leaf checks first (all `SequenceError`, nothing changes), then every
        sequence pops what the commit drops (``popn``'s rules, before its tree is cleared)."""
        seqs = self.model.seqs
        if not all(map(_is_int, list(seq_ids) + list(leaves))):
            return _fail(KVCacheError)
        if len(seq_ids) != len(leaves) or len(set(seq_ids)) != len(seq_ids):
            return _fail(SequenceError)
        for seq_id, leaf in zip(seq_ids, leaves):
            s = seqs.get(seq_id)
            if s is None or leaf < -1 or (leaf != -1 and (s.tree is None or leaf >= len(s.tree))):
                return _fail(SequenceError)
        expects, independent = [], True
        for seq_id, leaf in zip(seq_ids, leaves):
            s = seqs[seq_id]
            pop, path = self.model.commit_pop(seq_id, leaf)
            if pop > s.length:
                return _fail(SequenceError)  # whatever the other sequences do
            if s.length < self.model.commit_span(seq_id) and any(p != j for j, p in enumerate(path)):
                return _fail(KVCacheError)  # moves from positions popped since: out of range
            e = self._expect_popn(seq_id, pop, in_commit=True)
            independent &= pop == 0 or s.length - pop >= self.model.max_share(seq_id)
            expects.append(e)
        if len(expects) == 1:
            return dataclasses.replace(expects[0], free_delta=None)
        raises = tuple({err for e in expects for err in e.raises})
        if independent:  # trims only: each pop as on its own
            return Expect(raises, must_raise=any(e.must_raise for e in expects))
        return Expect(raises + (SequenceError,) * (not raises))  # re-forks interact: not predicted exactly

    def repeat_decode(self) -> bool:
        """The last batch again with one token each (the decode fast path of the plain cache)."""
        batch = [s for s in (self.last_batch or []) if s in self.model.seqs]
        if not batch:
            return False
        return self.step(batch, [1] * len(batch))

    def remove_all(self, order: Iterable[int]) -> None:
        """Remove every sequence; the cache must be empty with every page free."""
        for seq_id in order:
            self.remove(seq_id)
        ensure(self.cache.empty(), "empty() is False after removing every sequence")
        ensure(self.free_pages() == self.cache.config.num_total_pages, "pages still in use after removing all")
