"""Repeated decode steps take the incremental path (`decode_plan`, `DecodeLane`, fixed slots).

Each test drives two caches with the same operations: one as shipped, one whose incremental
path is switched off (every step planned in full). After every step the two step metadata must
be identical and so must the paging state; the shipped cache's attention outputs and KV contents
are checked against the float64 reference (`Harness`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tvm.runtime import ShapeTuple

import relax_kvcache as rk
from relax_kvcache.cache import step as step_module
from relax_kvcache.decode_plan import _drop_first_pages as _DROP_FIRST_PAGES
from support.harness import CONFIGS, Harness

# (caches with support_sliding_window attend before appending: always planned in full)
CHECKED = ["fp32-gqa-normal", "fp32-mqa-inline-d128", "fp32-d96-page8"]
#: Caches with local layers: their decode steps recompute the window pages of every depth.
LOCAL = {
    "layer-window-inline": dataclasses.replace(
        CONFIGS["fp32-gqa-normal"], rope_mode=rk.RopeMode.INLINE, page_size=8, layer_sliding_window_size=13,
        attn_kinds=(rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA)),
    "chunked-normal": dataclasses.replace(
        CONFIGS["fp32-gqa-normal"], page_size=8, attention_chunk_size=11,
        attn_kinds=(rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA)),
}


class Twin:
    """A `Harness` (shipped cache vs float64) plus a cache that plans every step in full."""

    def __init__(self, cache_factory, config, seed, shape_tuples=False):
        self.h = Harness(cache_factory(config), np.random.default_rng(seed))
        self.h.ref.layer_windows = [config.layer_sliding_window_size if k == rk.AttnKind.MHA_SLIDING else 0
                                    for k in config.attn_kinds]
        self.h.ref.layer_chunks = [config.attention_chunk_size if k == rk.AttnKind.MHA_CHUNKED_LOCAL else 0
                                   for k in config.attn_kinds]
        self.full = cache_factory(config)
        self.full._planner.decode.next_step = lambda *args: None
        self.full._planner.decode.fresh = lambda *args: None
        self.depths_seen = set()
        self.shape_tuples = shape_tuples  # pass the batch as vm.builtin does (the in-place path takes only that)
        self.steps = {"next_step": 0, "repeat": 0, "fresh": 0}  # steps each planner path made
        planner = self.h.cache._planner.decode
        for name in self.steps:
            setattr(planner, name, self._counted(name, getattr(planner, name)))

    def _counted(self, name, method):
        def counted(*args):
            step = method(*args)
            if step is not None:
                self.steps[name] += 1
                if name == "next_step":
                    self.depths_seen.add(len(step.depths))
            return step
        return counted

    @property
    def incremental_steps(self):
        return self.steps["next_step"]

    @property
    def in_place_steps(self):
        return self.steps["repeat"]

    @property
    def fresh_steps(self):
        return self.steps["fresh"]

    def op(self, name, *args):
        getattr(self.h, name)(*args)
        method = {"add": "add_sequence", "fork": "fork_sequence", "popn": "popn", "remove": "remove_sequence"}[name]
        getattr(self.full, method)(*args)
        self.same_paging()

    def step(self, batch):
        ids, lengths = [s for s, _ in batch], [n for _, n in batch]
        self.full.begin_forward(ids, lengths)
        expected = self.full._step.meta
        self.full.end_forward()
        original_begin = self.h.cache.begin_forward

        def begin_and_compare(seq_ids, append_lengths, *args):
            if self.shape_tuples:
                seq_ids, append_lengths = ShapeTuple(seq_ids), ShapeTuple(append_lengths)
            original_begin(seq_ids, append_lengths, *args)
            same_step(self.h.cache._step.meta, expected)

        self.h.cache.begin_forward = begin_and_compare
        try:
            self.h.step(batch)
        finally:
            del self.h.cache.begin_forward
        self.same_paging()

    def same_paging(self):
        assert self.h.cache._paging.debug_snapshot() == self.full._paging.debug_snapshot()


def same_step(got, expected, where="step"):
    assert type(got) is type(expected), where
    if isinstance(got, np.ndarray):
        assert got.dtype == expected.dtype and np.array_equal(got, expected), f"{where}: {got} != {expected}"
    elif dataclasses.is_dataclass(got):
        for field in dataclasses.fields(got):
            same_step(getattr(got, field.name), getattr(expected, field.name), f"{where}.{field.name}")
    elif isinstance(got, tuple):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            same_step(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def _decode_runs(t: Twin, rng, rounds: int) -> None:
    """Runs of repeated decode steps over random batches, forks at any position between runs."""
    cfg = t.h.cfg
    live, next_id = [], 0
    for _ in range(3):
        t.op("add", next_id)
        t.step([(next_id, int(rng.integers(1, 60)))])
        live.append(next_id)
        next_id += 1
    for _ in range(rounds):
        action = rng.choice(["fork", "popn", "remove", "none"])
        if action == "fork" and len(live) < cfg.max_num_seqs:
            parent = int(rng.choice(live))
            length = t.h.ref.length(parent)
            t.op("fork", parent, next_id, int(rng.choice([-1, rng.integers(0, length + 1)])))
            live.append(next_id)
            next_id += 1
        elif action == "popn":
            seq = int(rng.choice(live))
            t.op("popn", seq, int(rng.integers(0, min(t.h.ref.length(seq), 20) + 1)))
        elif action == "remove" and len(live) > 2:
            seq = int(rng.choice(live))
            t.op("remove", seq)
            live.remove(seq)
        batch = [int(s) for s in rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]]
        for _ in range(int(rng.integers(2, 2 * cfg.page_size + 3))):
            if t.h.cache.get_num_available_pages() < len(batch) + 2:
                break
            t.step([(s, 1) for s in batch])
    t.h.check_contents()


@pytest.mark.parametrize("name", CHECKED + list(LOCAL))
def test_repeated_decode_matches_full_planning(cache_factory, name):
    t = Twin(cache_factory, LOCAL.get(name) or CONFIGS[name], seed=11)
    _decode_runs(t, np.random.default_rng(5), rounds=8)
    assert t.incremental_steps > 40  # the runs really took the incremental path
    assert t.depths_seen == {1, 2}  # with and without shared prefixes
    assert t.fresh_steps > 3  # new batches of single-block sequences, planned from their blocks


@pytest.mark.parametrize("name", CHECKED + list(LOCAL))
def test_in_place_decode_steps_match_full_planning(cache_factory, name):
    """Batches passed as ShapeTuples (vm.builtin's way) take `DecodePlanner.repeat` where no
    page fills: the step before, updated in place (window pages of local layers too, while the
    same pages drop), with the sequences' lengths caught up lazily. Every step's metadata, the
    paging state and the outputs are checked as above."""
    t = Twin(cache_factory, LOCAL.get(name) or CONFIGS[name], seed=12, shape_tuples=True)
    _decode_runs(t, np.random.default_rng(6), rounds=12)
    assert t.in_place_steps > 20 and t.incremental_steps > 20  # both paths ran


@pytest.mark.parametrize("shape_tuples", [False, True])
def test_incremental_step_that_runs_out_of_pages_changes_nothing(cache_factory, shape_tuples):
    cfg = dataclasses.replace(CONFIGS["fp32-gqa-normal"], max_total_seq_len=6 * 16, max_num_seqs=4)  # 7 pages
    assert cfg.num_total_pages == 7
    t = Twin(cache_factory, cfg, seed=3, shape_tuples=shape_tuples)
    for s in range(3):
        t.op("add", s)
    t.step([(0, 16), (1, 16), (2, 15)])  # 3 pages used, 4 free
    for _ in range(16):  # 0 and 1 take a page at once, 2 one step later: 1 free
        t.step([(0, 1), (1, 1), (2, 1)])
    cache = t.h.cache
    assert cache._planner.decode.current is not None
    before = cache._paging.debug_snapshot()
    in_place = t.in_place_steps
    batch = [[0, 1, 2], [1, 1, 1]]
    with pytest.raises(rk.CacheFullError, match=r"2 page\(s\) needed, 1 free"):  # 0 and 1 are full again, 1 page free
        cache.begin_forward(*(map(ShapeTuple, batch) if shape_tuples else batch))
    assert cache._paging.debug_snapshot() == before
    assert cache._step is None
    assert t.in_place_steps == in_place and (in_place > 5) == shape_tuples
    t.op("remove", 2)
    fresh, repeated = t.fresh_steps, t.incremental_steps + t.in_place_steps
    t.step([(0, 1), (1, 1)])
    t.step([(0, 1), (1, 1)])
    # a new batch is planned from its blocks once, then repeated
    assert (t.fresh_steps, t.incremental_steps + t.in_place_steps) == (fresh + 1, repeated + 1)
    t.h.check_contents()


@pytest.mark.parametrize("shape_tuples", [False, True])
def test_new_batch_that_runs_out_of_pages_changes_nothing(cache_factory, shape_tuples):
    """A new decode batch planned from its blocks (`DecodePlanner.fresh`) that needs more pages
    than are free is refused as the full planner refuses it, and changes nothing."""
    cfg = dataclasses.replace(CONFIGS["fp32-gqa-normal"], max_total_seq_len=6 * 16, max_num_seqs=4)  # 7 pages
    t = Twin(cache_factory, cfg, seed=4, shape_tuples=shape_tuples)
    for s in range(3):
        t.op("add", s)
    t.step([(0, 32), (1, 32), (2, 31)])  # 6 pages used, 1 free
    t.op("popn", 2, 0)  # nothing changes
    cache = t.h.cache
    before, planner = cache._paging.debug_snapshot(), cache._planner.decode
    batch = [[1, 0, 2], [1, 1, 1]]  # another batch: 0 and 1 need a page each
    for args in ([ShapeTuple(b) for b in batch] if shape_tuples else batch, batch):
        with pytest.raises(rk.CacheFullError, match=r"append to 3 sequence\(s\): 2 page\(s\) needed, 1 free"):
            cache.begin_forward(*args)
        assert cache._paging.debug_snapshot() == before and cache._step is None
    t.op("remove", 1)  # 3 pages free
    fresh = t.fresh_steps
    t.step([(2, 1), (0, 1)])  # planned from the blocks, then repeated
    t.step([(2, 1), (0, 1)])
    assert t.fresh_steps == fresh + 1
    t.op("fork", 2, 3, 20)  # its first page moves to a shared parent block: planned in full
    t.step([(3, 1), (0, 1)])
    assert t.fresh_steps == fresh + 1 and planner.current is not None
    t.h.check_contents()


@pytest.mark.parametrize("seq_ids, lengths, match", [
    ([0.0, 1], [1, 1], r"seq_ids\[0\] must be an integer"),
    ([0, 1], [True, 1], r"append_lengths\[0\] must be an integer"),
    ([0, 1], [1.0, 1], r"append_lengths\[0\] must be an integer"),
    ([0, 1, 1], [1, 1, 1], "more than once"),
])
def test_bad_repeated_batch_is_refused(cache_factory, seq_ids, lengths, match):
    h = Harness(cache_factory(CONFIGS["fp32-gqa-normal"]), np.random.default_rng(2))
    h.add(0)
    h.add(1)
    h.step([(0, 9), (1, 30)])
    h.step([(0, 1), (1, 1)])
    before = h.cache._paging.debug_snapshot()
    with pytest.raises(rk.KVCacheError, match=match):
        h.cache.begin_forward(seq_ids, lengths)
    assert h.cache._paging.debug_snapshot() == before
    h.step([(0, 1), (1, 1)])


@pytest.mark.parametrize("name", ["fp32-gqa-normal", "chunked-normal"])
def test_fixed_slots_keep_kernel_arguments_until_the_batch_changes(cache_factory, monkeypatch, name):
    monkeypatch.setattr(step_module, "DECODE_PAGE_HEADROOM", 1)
    config = dataclasses.replace(LOCAL[name], page_size=16) if name in LOCAL else CONFIGS[name]
    h = Harness(cache_factory(config), np.random.default_rng(4))
    h.ref.layer_chunks = [config.attention_chunk_size if k == rk.AttnKind.MHA_CHUNKED_LOCAL else 0
                          for k in config.attn_kinds]
    for s in range(3):
        h.add(s)
    h.step([(0, 20), (1, 33), (2, 5)])
    seen = []
    cache = h.cache
    original = cache._active_step

    def record(what):
        step = original(what)
        seen.append(step.device)
        return step

    cache._active_step = record
    for _ in range(12):  # sequence 2 reaches a second page: within the headroom of one page each
        h.step([(0, 1), (1, 1), (2, 1)])
    assert len({id(s) for s in seen}) == 1, "repeated decode steps reuse the same device views"
    seen.clear()
    for _ in range(30):  # past the headroom: new slots once, then stable again
        h.step([(0, 1), (1, 1), (2, 1)])
    assert len({id(s) for s in seen}) == 2
    previous = seen[-1]
    seen.clear()
    h.step([(1, 1), (0, 1)])  # another batch: planned in full, new slots, then reused
    h.step([(1, 1), (0, 1)])
    assert len({id(s) for s in seen}) == 1 and seen[0] is not previous
    h.check_contents()


def test_lane_is_refused_after_any_change(cache_factory):
    """A DecodeLane goes stale with every change of the paging state."""
    cache = cache_factory(CONFIGS["fp32-gqa-normal"])
    paging = cache._paging
    for s in range(2):
        cache.add_sequence(s)
    cache.begin_forward([0, 1], [5, 7])
    cache.end_forward()
    cache.begin_forward([0, 1], [1, 1])
    cache.end_forward()
    lane = paging.open_lane([0, 1])
    assert lane is not None and lane.seq_ids == (0, 1)
    paging.advance_lane(lane)
    assert paging.sequence_length(0) == 7 and paging.sequence_length(1) == 9
    cache.add_sequence(2)
    with pytest.raises(rk.KVCacheError, match="stale"):
        paging.advance_lane(lane)
    assert paging.sequence_length(0) == 7
    cache.fork_sequence(0, 3, 3)
    assert paging.open_lane([3]) is None  # a new sequence has not grown by one token
    assert paging.open_lane([1, 3]) is None
    assert paging.open_lane([1, 1]) is None
    assert paging.open_lane([1, 99]) is None


def test_capturable_step_only_for_repeated_decode(cache_factory):
    h = Harness(cache_factory(CONFIGS["fp32-gqa-normal"]), np.random.default_rng(8))
    cache = h.cache
    h.add(0)
    h.add(1)
    cache.begin_forward([0, 1], [12, 3])  # prefill: arguments change with every step
    assert cache.capturable_step() is None
    cache.end_forward()
    tokens = []
    for _ in range(3):
        cache.begin_forward([0, 1], [1, 1])
        tokens.append(cache.capturable_step())
        cache.end_forward()
    assert tokens[0] is not None and tokens[0] is tokens[1] is tokens[2]
    with pytest.raises(rk.ForwardError, match="without an active step"):
        cache.capturable_step()


def test_capturable_step_changes_with_the_batch(cache_factory):
    """Regression: another batch of the same structure reused the fixed slots and
    returned the same object, so DecodeGraphs replayed the old batch's captured forward (its
    buffers) instead of running the new one's. The slots are reused; the object is new."""
    h = Harness(cache_factory(CONFIGS["fp32-gqa-normal"]), np.random.default_rng(9))
    cache = h.cache
    for s in range(4):
        h.add(s)
    cache.begin_forward([0, 1, 2, 3], [5, 9, 6, 10])
    cache.end_forward()
    tokens = {}
    for batch in [(0, 1)] * 2 + [(2, 3)] * 2 + [(1, 0)] * 2:
        cache.begin_forward(list(batch), [1, 1])
        tokens.setdefault(batch, []).append(cache.capturable_step())
        cache.end_forward()
    for batch, seen in tokens.items():
        assert seen[0] is not None and seen[0] is seen[1], batch
    assert len({id(seen[0]) for seen in tokens.values()}) == 3


def test_capturable_step_any_batch_stands_for_the_slots_of_a_size(cache_factory, monkeypatch):
    """``capturable_step(any_batch=True)``: one object per batch size and structure, kept while
    other sizes run (a set of slots each, the least recently used dropped beyond
    MAX_SLOT_SETS); every step's outputs still against float64."""
    monkeypatch.setattr(step_module, "MAX_SLOT_SETS", 2)
    h = Harness(cache_factory(CONFIGS["fp32-gqa-normal"]), np.random.default_rng(10))
    cache = h.cache
    for s in range(5):
        h.add(s)
    h.step([(0, 5), (1, 9), (2, 6), (3, 10), (4, 3)])
    slots, steps = {}, {}

    def decode(*seqs):
        h.step([(s, 1) for s in seqs], during=lambda: (
            slots.setdefault(len(seqs), []).append(cache.capturable_step(any_batch=True)),
            steps.setdefault(seqs, []).append(cache.capturable_step())))

    for batch in [(0, 1), (2, 3), (0, 1, 2), (1, 0), (3, 4), (2, 3, 4), (0, 1), (0, 1)]:
        decode(*batch)
    assert all(x is not None for seen in slots.values() for x in seen)

    def refused() -> None:
        with pytest.raises(rk.ArgumentError, match="any_batch must be a bool, got 1"):
            cache.capturable_step(any_batch=1)

    h.step([(0, 1), (1, 1)], during=refused)
    assert len({id(x) for x in slots[2]}) == 1 and len({id(x) for x in slots[3]}) == 1
    assert slots[2][0] is not slots[3][0]
    assert steps[(0, 1)][-1] is steps[(0, 1)][-2]  # the same batch again: the same arguments
    assert len({id(steps[b][0]) for b in [(0, 1), (2, 3), (1, 0), (3, 4)]}) == 4
    decode(0)  # a third size: the least recently used set (size 3) goes
    decode(1, 2, 3)
    assert slots[3][-1] is not slots[3][0]
    decode(2, 4)
    assert slots[2][-1] is not slots[2][0]  # evicted by sizes 1 and 3 in turn


def test_decode_graphs_refuse_a_cpu_cache(cache_factory):
    from relax_kvcache.cuda_graph import DecodeGraphs

    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        DecodeGraphs(cache_factory(CONFIGS["fp32-gqa-normal"]))
    with pytest.raises(TypeError, match="PagedAttentionKVCache, got int"):
        DecodeGraphs(3)
    with pytest.raises(TypeError, match="any_batch must be a bool, got int"):
        DecodeGraphs(cache_factory(CONFIGS["fp32-gqa-normal"]), any_batch=1)
    with pytest.raises(ValueError, match="max_graphs must be a positive int, got 0"):
        DecodeGraphs(cache_factory(CONFIGS["fp32-gqa-normal"]), any_batch=True, max_graphs=0)


@pytest.mark.parametrize("name", ["fp32-gqa-normal", "layer-window-inline"])
def test_new_batch_of_many_sequences_matches_full_planning(cache_factory, name):
    """`DecodePlanner.fresh` over more sequences than `first_step` handles in Python lists and
    more page ids than `int32_array` converts through numpy: every step (new batches after a
    `popn` of every sequence, and their repeats) against a full plan and float64."""
    from relax_kvcache.paging.decode_lane import PYTHON_ROWS

    config = dataclasses.replace(LOCAL.get(name) or CONFIGS[name], page_size=8, max_num_seqs=32,
                                 max_total_seq_len=2560)
    t = Twin(cache_factory, config, seed=13, shape_tuples=True)
    rng = np.random.default_rng(14)
    n = PYTHON_ROWS + 6
    for s in range(n):
        t.op("add", s)
        t.step([(s, int(rng.integers(17, 41)))])
    assert sum(t.h.ref.length(s) // 8 for s in range(n)) > 48  # page ids packed with struct
    for _ in range(3):
        for _ in range(int(rng.integers(2, 10))):
            t.step([(s, 1) for s in range(n)])
        for s in range(n):
            t.op("popn", s, 1)
    t.h.check_contents()
    assert t.fresh_steps == 3 and t.in_place_steps > 3


def test_windows_drop_first_pages_on_schedule(cache_factory, monkeypatch):
    """Once every window of a repeated batch moves, each drops its first page every page_size
    steps, at steps of its own (staggered lengths): those steps update the window pages in place
    too (`_drop_first_pages`). Every step against a full plan, the contents against float64."""
    from relax_kvcache import decode_plan

    calls = []
    monkeypatch.setattr(decode_plan, "_drop_first_pages",
                        lambda *a: calls.append(a[2]) or _DROP_FIRST_PAGES(*a))
    config = dataclasses.replace(LOCAL["layer-window-inline"], max_num_seqs=12, max_total_seq_len=1024)
    t = Twin(cache_factory, config, seed=15, shape_tuples=True)
    for s in range(10):
        t.op("add", s)
        t.step([(s, 20 + 3 * s)])  # windows of 13: every one moves from the first decode step
    for _ in range(3 * config.page_size + 2):
        t.step([(s, 1) for s in range(10)])
    t.h.check_contents()
    assert t.in_place_steps > 20 and len(calls) >= 20 and max(len(rows) for rows in calls) >= 2


def test_first_pages_drop_as_list_slices_drop_them():
    """`_drop_first_pages` against a list-by-list reference."""
    from relax_kvcache.decode_plan import grow_shifts

    rng = np.random.default_rng(4)
    counts = rng.integers(1, 6, size=40)
    indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    indices = rng.permutation(5_000)[:indptr[-1]].astype(np.int32)
    rows = tuple(sorted(rng.choice(40, size=9, replace=False).tolist()))
    before = (indptr.copy(), indices.copy())
    new_indptr, new_indices = _DROP_FIRST_PAGES(indptr, indices, rows, grow_shifts([rows], 41)[0])
    lists = [list(indices[indptr[i]:indptr[i + 1]]) for i in range(40)]
    for r in rows:
        lists[r] = lists[r][1:]
    assert new_indptr.dtype == np.int32 and new_indptr.tolist() == np.cumsum([0] + [len(x) for x in lists]).tolist()
    assert new_indices.dtype == np.int32 and new_indices.tolist() == [p for x in lists for p in x]
    assert new_indptr.base is new_indices.base  # one array, as `_append_pages` makes
    assert np.array_equal(indptr, before[0]) and np.array_equal(indices, before[1])  # inputs unchanged


def test_int32_arrays_of_python_ints():
    """`int32_array` (numpy below a few dozen values, `struct` above) against ``np.array``."""
    from relax_kvcache.paging.decode_lane import int32_array

    rng = np.random.default_rng(15)
    for count in (0, 1, 47, 48, 300):
        values = [int(v) for v in rng.integers(-2**31, 2**31, size=count)]
        for given in (values, iter(values)):
            got = int32_array(given, count)
            assert got.dtype == np.int32 and got.flags.writeable
            assert np.array_equal(got, np.array(values, dtype=np.int64))


@pytest.mark.parametrize("grown", [1, 2, 3, 7, 48, 49, 60])
def test_page_lists_grow_as_np_insert_grows_them(grown):
    """`_append_pages` (by slices for a few rows, by masks for more) against ``np.insert``;
    the grown lists are one array, indptr first."""
    from relax_kvcache.decode_plan import GROW_ROWS_BY_SLICES, _append_pages, grow_shifts

    assert GROW_ROWS_BY_SLICES in range(3, 60)  # both ways are tested
    rng = np.random.default_rng(grown)
    counts = rng.integers(0, 5, size=64)
    indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    indices = rng.permutation(10_000)[:indptr[-1]].astype(np.int32)
    rows = np.sort(rng.choice(64, size=grown, replace=False))
    pages = rng.integers(10_000, 20_000, size=grown)
    before = (indptr.copy(), indices.copy())
    new_indptr, new_indices = _append_pages(indptr, indices, list(rows), list(pages),
                                            grow_shifts([list(rows), [0, 5]], 65)[0])
    block = new_indptr.base
    assert new_indices.base is block and block.size == 65 + new_indices.size
    assert np.array_equal(block, np.concatenate((new_indptr, new_indices)))
    expected = np.insert(indices, indptr[rows + 1], pages)
    assert new_indices.dtype == np.int32 and np.array_equal(new_indices, expected)
    assert new_indptr.dtype == np.int32 and np.array_equal(new_indptr, np.concatenate(
        ([0], np.cumsum(counts + np.isin(np.arange(64), rows)))))
    assert np.array_equal(indptr, before[0]) and np.array_equal(indices, before[1])  # inputs unchanged


def test_page_lists_drop_their_first_pages():
    """`_drop_pages` against a list-by-list reference."""
    from relax_kvcache.decode_plan import _drop_pages

    rng = np.random.default_rng(3)
    counts = rng.integers(1, 6, size=40)
    indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    indices = rng.permutation(5_000)[:indptr[-1]].astype(np.int32)
    rows = np.sort(rng.choice(40, size=9, replace=False))
    dropped = np.array([rng.integers(0, counts[r] + 1) for r in rows], dtype=np.int32)
    before = (indptr.copy(), indices.copy())
    new_indptr, new_indices = _drop_pages(indptr, indices, rows, dropped)
    lists = [list(indices[indptr[i]:indptr[i + 1]]) for i in range(40)]
    for r, d in zip(rows, dropped):
        lists[r] = lists[r][d:]
    assert new_indptr.dtype == np.int32 and new_indptr.tolist() == np.cumsum([0] + [len(x) for x in lists]).tolist()
    assert new_indices.dtype == np.int32 and new_indices.tolist() == [p for x in lists for p in x]
    assert np.array_equal(indptr, before[0]) and np.array_equal(indices, before[1])  # inputs unchanged
