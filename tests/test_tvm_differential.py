"""Differential tests: our cache vs TVM's native C++ paged KV cache, through ``vm.builtin``.

Both caches get exactly the same inputs through TVM's global functions
(``vm.builtin.kv_state_*`` / ``vm.builtin.attention_kv_cache_*``, which dispatch on the cache
object once ``relax_kvcache`` is imported). TVM's native cache runs TVM's own CPU TIR kernels
(built from ``tvm.relax.frontend.nn.llm.kv_cache``, test-only); it is the baseline. Caches under
test:

* ``ours``: ``rk.PagedAttentionKVCache`` with our kernels (the product);
* ``ours_tvmk``: our cache logic created through ``relax_kvcache.paged_attention_kv_cache_create``
  with TVM's kernels, which isolates the cache logic from the kernels;
* ``ours_packed``: the same creation function fed our kernels in TVM's argument format.

After every operation the counters (free pages -- exactly TVM's --, total length, ``empty``)
are compared, after every step/fork/popn/remove the ``debug_get_kv`` contents of every live
sequence, and every attention output; everything is also checked against an independent numpy
model (``benchmarks/reference_model.py``). Tolerance: max abs error < 2e-3 (float32).

Invalid operations (``ERROR_CASES``) must be rejected by TVM's cache and by ours; ours must raise
a ``KVCacheError`` (a ``ValueError``) and keep its state exactly, after which the next valid
step still matches TVM (replayed from the operation log, since TVM is not transactional).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import tvm

import relax_kvcache as rk

import native_baseline as tb
from reference_model import CacheModel, attend, rope
from reference_model import tree_depths as cm_tree_depths
from support.workloads import TREE_SHAPES, random_tree

pytestmark = pytest.mark.tvm_native

TOL = 2e-3
DTYPE = "float32"

# (rope_mode, support_sliding_window): TVM switches NORMAL to INLINE with sliding windows, so
# that combination is covered separately (test_sliding_window_normal_rope_becomes_inline).
CONFIGS = [(0, False), (1, False), (2, False), (0, True), (2, True)]
CONFIG_IDS = ["none", "normal", "inline", "none-sw", "inline-sw"]


def make_shape(rope_mode: int, sliding: bool, **kw) -> tb.Shape:
    return tb.Shape(rope_mode=rope_mode, support_sliding_window=sliding, **kw)


#: caches that run TVM's kernels
TVM_KERNEL_CACHES = ("tvm", "ours_tvmk")

FACTORIES: Dict[str, Callable[[tb.Shape], object]] = {
    "tvm": tb.create_native,
    "ours": tb.create_ours_direct,
    "ours_tvmk": lambda s: tb.create_ours_packed(s, tvm_kernel_set=True),
    "ours_packed": tb.create_ours_packed,
}


# ============================================================================ harness


@dataclasses.dataclass
class Op:
    """One logged operation; ``qkv`` holds the step inputs so a cache can be replayed."""

    kind: str
    args: tuple
    qkv: Optional[List[np.ndarray]] = None
    #: a token-tree step: parents of each sequence's new nodes (concatenated in batch order)
    tree: Optional[List[int]] = None

    def __str__(self) -> str:
        return f"{self.kind}{self.args}"


class Diff:
    """Drives the same operations on several caches and a numpy model, comparing everything."""

    def __init__(self, shape: tb.Shape, names: Sequence[str] = ("tvm", "ours", "ours_tvmk"),
                 seed: int = 0) -> None:
        self.shape = shape
        self.B = tb.Builtins()
        self.caches = {name: FACTORIES[name](shape) for name in names}
        assert "tvm" in self.caches
        self.model = CacheModel(shape.num_layers, shape.num_qo_heads, shape.num_kv_heads,
                                shape.head_dim, shape.effective_rope_mode, shape.rope_theta,
                                shape.rope_scale)
        self.model.layer_windows = [shape.layer_window_size if kind == 3 else 0 for kind in shape.kinds]
        self.rng = np.random.default_rng(seed)
        self.sm_scale = 1.0 / math.sqrt(shape.head_dim)
        self.log: List[Op] = []
        self.max_err: Dict[str, float] = collections.defaultdict(float)
        self.check_counters()

    # ------------------------------------------------------------------ reporting

    def where(self) -> str:
        tail = self.log[-12:]
        start = len(self.log) - len(tail)
        ops = "; ".join(f"#{start + i} {op}" for i, op in enumerate(tail))
        return f"[{self.shape}] after {len(self.log)} ops (last: {ops})"

    def close(self, what: str, name: str, got: np.ndarray, expected: np.ndarray,
              tol: float = TOL) -> None:
        assert got.shape == expected.shape, f"{what}: {name} shape {got.shape} != {expected.shape}"
        err = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
        if not err < tol:  # also catches NaN
            bad = np.argwhere(~(np.abs(got - expected) < tol))[:5].tolist()
            raise AssertionError(f"{what}: {name} max abs error {err:.3g} >= {tol} at {bad}; "
                                 f"{self.where()}")
        self.max_err[name] = max(self.max_err[name], err)

    # ------------------------------------------------------------------ checks

    def check_counters(self) -> None:
        B, tvm_c = self.B, self.caches["tvm"]
        expected = (int(B.num_available_pages(tvm_c)), int(B.total_sequence_length(tvm_c)),
                    bool(B.empty(tvm_c)))
        assert expected[1] == self.model.total_length(), f"TVM total length vs model; {self.where()}"
        for name, c in self.caches.items():
            got = (int(B.num_available_pages(c)), int(B.total_sequence_length(c)), bool(B.empty(c)))
            assert got == expected, (f"(free pages, total length, empty): {name} {got} != tvm "
                                     f"{expected}; {self.where()}")

    def read_kv(self, cache, seq_id: int, start: int = 0, end: Optional[int] = None):
        end = self.model.length(seq_id) if end is None else end
        s = self.shape
        shp = (s.num_layers, end - start, s.num_kv_heads, s.head_dim)
        k, v = tvm.runtime.empty(shp, DTYPE), tvm.runtime.empty(shp, DTYPE)
        self.B.debug_get_kv(cache, seq_id, start, end, k, v)
        return k.numpy(), v.numpy()

    def check_kv(self) -> None:
        # TVM's DebugGetKV refuses caches with MHA_SLIDING layers: there ours is checked
        # against the model only
        tvm_kv = all(kind == 0 for kind in self.shape.kinds)
        for seq_id, seq in self.model.seqs.items():
            if seq.length == 0:
                continue
            if tvm_kv:
                base = self.read_kv(self.caches["tvm"], seq_id)
                self.close(f"debug_get_kv K of seq {seq_id}", "tvm~model", base[0], seq.k)
                self.close(f"debug_get_kv V of seq {seq_id}", "tvm~model", base[1], seq.v)
            else:
                base = (seq.k, seq.v)
            for name, c in self.caches.items():
                if name == "tvm":
                    continue
                got = self.read_kv(c, seq_id)
                self.close(f"debug_get_kv K of seq {seq_id}", name, got[0], base[0])
                self.close(f"debug_get_kv V of seq {seq_id}", name, got[1], base[1])
                # a partial window starting mid-page
                if seq.length > 3:
                    lo, hi = seq.length // 3, seq.length - 1
                    part = self.read_kv(c, seq_id, lo, hi)
                    self.close(f"debug_get_kv[{lo}:{hi}] K of seq {seq_id}", name, part[0], base[0][:, lo:hi])
                    self.close(f"debug_get_kv[{lo}:{hi}] V of seq {seq_id}", name, part[1], base[1][:, lo:hi])

    def check_all(self) -> None:
        self.check_counters()
        self.check_kv()

    # ------------------------------------------------------------------ operations

    def _each(self, fn: str, *args) -> None:
        for c in self.caches.values():
            getattr(self.B, fn)(c, *args)

    def add(self, seq_id: int) -> None:
        self.log.append(Op("add", (seq_id,)))
        self._each("add", seq_id)
        self.model.add(seq_id)
        self.check_counters()

    def remove(self, seq_id: int) -> None:
        self.log.append(Op("remove", (seq_id,)))
        self._each("remove", seq_id)
        self.model.remove(seq_id)
        self.check_all()

    def fork(self, parent: int, child: int, pos: int) -> None:
        self.log.append(Op("fork", (parent, child, pos)))
        self._each("fork", parent, child, pos)
        self.model.fork(parent, child, pos)
        self.check_all()

    def popn(self, seq_id: int, n: int) -> None:
        self.log.append(Op("popn", (seq_id, n)))
        self._each("popn", seq_id, n)
        self.model.popn(seq_id, n)
        self.check_all()

    def enable_window(self, seq_id: int, window: int, sink: int) -> None:
        self.log.append(Op("enable_window", (seq_id, window, sink)))
        self._each("enable_window", seq_id, window, sink)
        self.model.enable_window(seq_id, window, sink)
        self.check_counters()

    def commit(self, seq_ids: Sequence[int], leaves: Sequence[int],
               caches: Optional[Dict[str, object]] = None) -> None:
        """``commit_accepted_token_tree_nodes`` on every cache (or ``caches``), then all checks."""
        seq_ids, leaves = [int(s) for s in seq_ids], [int(x) for x in leaves]
        self.log.append(Op("commit", (seq_ids, leaves)))
        for c in (self.caches if caches is None else caches).values():
            self.B.commit(c, seq_ids, leaves)
        for seq_id, leaf in zip(seq_ids, leaves):
            self.model.commit(seq_id, leaf)
        self.check_all()

    def clear(self) -> None:
        self.log.append(Op("clear", ()))
        self._each("clear")
        self.model.clear()
        self.check_counters()

    def random_qkv(self, n: int) -> List[np.ndarray]:
        s = self.shape
        return [self.rng.standard_normal((n, s.num_qo_heads + 2 * s.num_kv_heads, s.head_dim))
                .astype(DTYPE) for _ in range(s.num_layers)]

    def expected_positions(self, batch) -> np.ndarray:
        return np.concatenate([np.arange(self.model.length(s), self.model.length(s) + n)
                               for s, n in batch]).astype(np.int32)

    def step(self, batch: Sequence[Tuple[int, int]], qkv: Optional[List[np.ndarray]] = None,
             caches: Optional[Dict[str, object]] = None,
             shared_kv: Optional[Dict[int, np.ndarray]] = None, baseline: str = "tvm",
             tree: Optional[Dict[int, Sequence[int]]] = None) -> None:
        """A forward step on every cache; compares outputs, query positions and the cache.

        ``tree``: a token-tree step (``begin_forward`` with ``token_tree_parent_ptr``):
        ``tree[seq]`` holds the parents of the sequence's new nodes, indexing its accumulated
        uncommitted tree.

        ``shared_kv``: source layer -> queries (n, Hq, D); right after that layer's
        ``attention_with_fused_qkv`` every cache also runs ``attention_with_shared_kv`` over it
        with those queries and the layer's new K/V (as a KV-sharing model does).

        ``baseline="model"``: the outputs of caches running TVM's kernels are not compared (they
        are known to be unreliable for this step, see ``tvm_layer_window_output_reliable``);
        the others are compared with the numpy model instead. The caches' contents are still
        compared with TVM's.
        """
        batch = [(int(s), int(n)) for s, n in batch]
        n = sum(length for _, length in batch)
        qkv = self.random_qkv(n) if qkv is None else qkv
        parents = None if tree is None else [int(p) for s, _ in batch for p in tree[s]]
        self.log.append(Op("step", tuple(batch), qkv, parents))
        caches = self.caches if caches is None else caches
        ids, lengths = [s for s, _ in batch], [length for _, length in batch]
        positions = (self.expected_positions(batch) if tree is None
                     else self.model.tree_positions(batch, tree))
        for c in caches.values():
            self.B.begin(c, ids, lengths, parents)
        # begin_forward reserves the pages and counts the appended tokens already
        counters = {name: (int(self.B.num_available_pages(c)), int(self.B.total_sequence_length(c)))
                    for name, c in caches.items()}
        assert len(set(counters.values())) == 1, f"counters after begin_forward {counters}; {self.where()}"
        for name, c in caches.items():
            got = self.B.query_positions(c).numpy()
            assert got.tolist() == positions.tolist(), (
                f"get_query_positions: {name} {got.tolist()} != {positions.tolist()}; {self.where()}")
        outs = {name: [] for name in caches}
        shared_kv = shared_kv or {}
        shared_outs: Dict[int, Dict[str, np.ndarray]] = {layer: {} for layer in shared_kv}
        hq, hkv = self.shape.num_qo_heads, self.shape.num_kv_heads
        for layer in range(self.shape.num_layers):
            for name, c in caches.items():
                o = tvm.runtime.tensor(np.full((n, self.shape.num_qo_heads, self.shape.head_dim),
                                               np.nan, DTYPE))
                self.B.attention(c, layer, self.sm_scale, tvm.runtime.tensor(qkv[layer]), o)
                outs[name].append(o.numpy())
                if layer in shared_kv:
                    so = tvm.runtime.tensor(np.full(o.shape, np.nan, DTYPE))
                    k_new = np.ascontiguousarray(qkv[layer][:, hq:hq + hkv])
                    v_new = np.ascontiguousarray(qkv[layer][:, hq + hkv:])
                    self.B.shared_kv(c, layer, self.sm_scale, tvm.runtime.tensor(shared_kv[layer]),
                                     tvm.runtime.tensor(k_new), tvm.runtime.tensor(v_new), so)
                    shared_outs[layer][name] = so.numpy()
        for c in caches.values():
            self.B.end(c)
        starts = [self.model.length(s) for s in ids]
        assert not (shared_kv and any(s in self.model.windows for s in ids)), "not modelled"
        if tree is None:
            expected = self.model.step(batch, qkv, self.sm_scale)
        else:
            assert not shared_kv, "not modelled"
            expected = self.model.tree_step(batch, tree, qkv, self.sm_scale)
        if baseline == "model":
            for layer in range(self.shape.num_layers):
                for name in caches:
                    if name not in TVM_KERNEL_CACHES:
                        self.close(f"attention output layer {layer} batch {batch} (vs model)",
                                   f"{name}~model", outs[name][layer], expected[layer])
        for layer, q_shared in shared_kv.items():
            exp = self.model.shared_kv_attention(batch, starts, layer, q_shared, self.sm_scale)
            for name, got in shared_outs[layer].items():
                what = f"shared-KV output over layer {layer} batch {batch}"
                if baseline == "tvm":
                    self.close(what, "tvm~model" if name == "tvm" else name, got,
                               exp if name == "tvm" else shared_outs[layer]["tvm"])
                elif name not in TVM_KERNEL_CACHES:
                    self.close(what + " (vs model)", f"{name}~model", got, exp)
        if baseline == "model":
            self.check_all()
            return
        for layer in range(self.shape.num_layers):
            self.close(f"attention output layer {layer} batch {batch}", "tvm~model",
                       outs["tvm"][layer], expected[layer])
            for name in caches:
                if name != "tvm":
                    self.close(f"attention output layer {layer} batch {batch}", name,
                               outs[name][layer], outs["tvm"][layer])
        self.check_all()

    def replay(self, name: str) -> None:
        """Replace cache ``name`` by a fresh one and replay the log onto it (no checks)."""
        c = FACTORIES[name](self.shape)
        B = self.B
        for op in self.log:
            if op.kind == "step":
                ids = [s for s, _ in op.args]
                B.begin(c, ids, [n for _, n in op.args], op.tree)
                for layer in range(self.shape.num_layers):
                    o = tvm.runtime.empty(
                        (op.qkv[layer].shape[0], self.shape.num_qo_heads, self.shape.head_dim), DTYPE)
                    B.attention(c, layer, self.sm_scale, tvm.runtime.tensor(op.qkv[layer]), o)
                B.end(c)
            else:
                getattr(B, op.kind)(c, *op.args)
        self.caches[name] = c


# ============================================================================ random workloads

FORK_KINDS = ("minus1", "zero", "page_aligned", "mid_page", "in_shared_prefix", "at_end")
POP_KINDS = ("zero", "last_block", "across_blocks", "into_shared_prefix", "all")


class Workload:
    """Seeded generator of valid random operations, run through a :class:`Diff`."""

    def __init__(self, diff: Diff, seed: int, *, max_live: Optional[int] = None) -> None:
        self.d = diff
        self.r = np.random.default_rng(1000 + seed)
        self.next_id = 0
        self.max_live = max_live or diff.shape.max_num_seqs
        self.stats: collections.Counter = collections.Counter()
        self.last_child: Optional[int] = None

    @property
    def live(self) -> List[int]:
        return sorted(self.d.model.seqs)

    def free_pages(self) -> int:
        return int(self.d.B.num_available_pages(self.d.caches["tvm"]))

    def new_id(self) -> int:
        # ids are not contiguous and not small, on purpose
        self.next_id += 1
        return self.next_id * 7 + int(self.r.integers(0, 7)) if self.r.random() < 0.3 else self.next_id * 7

    # -------------------------------------------------------------- ops
    def op_add(self) -> None:
        seq_id = self.new_id()
        self.d.add(seq_id)
        self.stats["add"] += 1

    def op_remove(self) -> None:
        self.d.remove(int(self.r.choice(self.live)))
        self.stats["remove"] += 1

    def fork_pos(self, parent: int, kind: str) -> Optional[int]:
        m = self.d.model.seqs[parent]
        length, ps = m.length, self.d.shape.page_size
        if kind == "minus1":
            return -1
        if kind == "zero":
            return 0
        if kind == "at_end":
            return length
        if kind == "page_aligned":
            return ps * int(self.r.integers(1, length // ps + 1)) if length >= ps else None
        if kind == "mid_page":
            cands = [p for p in range(1, length) if p % ps]
            return int(self.r.choice(cands)) if cands else None
        if kind == "in_shared_prefix":
            return int(self.r.integers(1, m.shared)) if m.shared > 1 else None
        raise AssertionError(kind)

    def op_fork(self) -> None:
        live = [s for s in self.live if self.d.model.length(s) > 0]
        if not live:
            return self.op_add()
        # bias towards the latest child, to grow fork chains deeper than 2 levels
        if self.last_child in live and self.r.random() < 0.5:
            parent = self.last_child
        else:
            parent = int(self.r.choice(live))
        for kind in self.least_used("fork", FORK_KINDS):
            pos = self.fork_pos(parent, kind)
            if pos is not None:
                break
        need = 2  # a partial page copy and, at a page-aligned end, a new block: at most one page
        if self.free_pages() < need:
            return self.op_remove()
        child = self.new_id()
        self.d.fork(parent, child, pos)
        self.last_child = child
        self.stats[f"fork:{kind}"] += 1

    def least_used(self, prefix: str, kinds: Sequence[str]) -> List[str]:
        """Kinds ordered by how often they ran (random tie-break): steers towards coverage."""
        return sorted(kinds, key=lambda k: (self.stats[f"{prefix}:{k}"], self.r.random()))

    def pop_length(self, seq_id: int, kind: str) -> Optional[int]:
        m = self.d.model.seqs[seq_id]
        length, ps, own = m.length, self.d.shape.page_size, m.length - m.shared
        if kind == "zero":
            return 0
        if kind == "all":
            return length
        if kind == "last_block":
            top = min(own, length % ps or ps)
            return int(self.r.integers(1, top + 1)) if top >= 1 else None
        if kind == "across_blocks":
            return int(self.r.integers(ps + 1, length + 1)) if length > ps + 1 else None
        if kind == "into_shared_prefix":
            return int(self.r.integers(own + 1, length)) if m.shared > 0 and length > own + 1 else None
        raise AssertionError(kind)

    def op_popn(self) -> None:
        live = [s for s in self.live if self.d.model.length(s) > 0]
        if not live:
            return self.op_add()
        if self.free_pages() < 2:
            return self.op_remove()
        for kind in self.least_used("pop", POP_KINDS):
            cands = [s for s in live if self.pop_length(s, kind) is not None]
            if cands:
                seq_id = int(self.r.choice(cands))
                self.d.popn(seq_id, self.pop_length(seq_id, kind))
                self.stats[f"pop:{kind}"] += 1
                return

    def op_step(self) -> None:
        live = self.live
        if not live:
            return self.op_add()
        k = int(self.r.integers(1, min(len(live), 8) + 1))
        ids = [int(s) for s in self.r.choice(live, size=k, replace=False)]
        all_decode = self.r.random() < 0.3
        budget = self.d.shape.prefill_chunk_size
        batch = []
        pages = self.free_pages()
        for s in ids:
            if all_decode or self.r.random() < 0.5:
                n = 1
            else:
                n = int(self.r.integers(2, 70)) if self.r.random() < 0.8 else int(self.r.integers(70, 160))
            n = min(n, max(1, budget - (len(ids) - len(batch) - 1)))
            need = n // self.d.shape.page_size + 2
            if need > pages:
                n, need = 1, 1
                if pages < 1:
                    break
            pages -= need
            budget -= n
            batch.append((s, n))
        if not batch:
            return self.op_remove()
        self.d.step(batch)
        kind = "decode" if all(n == 1 for _, n in batch) else (
            "prefill" if all(n > 1 for _, n in batch) else "mixed")
        self.stats[f"step:{kind}"] += 1

    def op_clear(self) -> None:
        self.d.clear()
        self.parents.clear()
        self.stats["clear"] += 1

    # -------------------------------------------------------------- driver
    def run(self, num_ops: int) -> collections.Counter:
        self.parents: Dict[int, Tuple[int, int]] = {}
        ops = [("add", 0.12), ("fork", 0.2), ("popn", 0.13), ("remove", 0.07), ("step", 0.47),
               ("clear", 0.01)]
        names, weights = zip(*ops)
        weights = np.asarray(weights) / sum(weights)
        for _ in range(num_ops):
            live = self.live
            name = str(self.r.choice(names, p=weights))
            if len(live) < 2 and name in ("remove", "clear"):
                name = "add"
            if name in ("add", "fork") and len(live) >= self.max_live:
                name = "remove"
            if self.free_pages() < 6 and name in ("step", "fork", "add"):
                name = "remove" if live else "add"
            before = set(live)
            getattr(self, f"op_{name}")()
            # track fork chains: child depth = parent depth + 1
            if self.d.log[-1].kind == "fork":
                parent, child, _ = self.d.log[-1].args
                self.parents[child] = (parent, self.parents.get(parent, (None, 0))[1] + 1)
                self.stats["max_fork_chain"] = max(self.stats["max_fork_chain"],
                                                   self.parents[child][1])
            for gone in before - set(self.live):
                self.parents.pop(gone, None)
        return self.stats


def run_workload(rope_mode: int, sliding: bool, seed: int, num_ops: int, **shape_kw) -> Diff:
    d = Diff(make_shape(rope_mode, sliding, **shape_kw), seed=seed)
    w = Workload(d, seed)
    stats = w.run(num_ops)
    d.stats = stats
    return d


@pytest.mark.parametrize("rope_mode,sliding", CONFIGS, ids=CONFIG_IDS)
def test_random_workload(rope_mode, sliding):
    d = run_workload(rope_mode, sliding, seed=0, num_ops=110)
    stats = d.stats
    # the generator must have exercised every kind of operation the test is about
    missing = [k for k in [f"fork:{k}" for k in FORK_KINDS] + [f"pop:{k}" for k in POP_KINDS]
               + ["step:decode", "step:mixed", "step:prefill", "remove"] if stats[k] == 0]
    assert not missing, f"workload did not exercise {missing}: {dict(stats)}"
    assert stats["max_fork_chain"] >= 3, dict(stats)
    assert d.max_err["ours_tvmk"] < 1e-5, dict(d.max_err)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("rope_mode,sliding", CONFIGS, ids=CONFIG_IDS)
def test_random_workload_more_seeds(rope_mode, sliding, seed):
    run_workload(rope_mode, sliding, seed=seed, num_ops=110)


@pytest.mark.slow
def test_random_workload_rope_params_and_small_pool():
    """Non-default RoPE theta/scale, small page pool (pressure, page reuse), clears."""
    d = run_workload(1, False, seed=7, num_ops=150, rope_theta=5e5, rope_scale=0.5,
                     max_total_seq_len=512)
    assert d.stats["clear"] + d.stats["remove"] > 0


def test_sliding_window_normal_rope_becomes_inline():
    """With sliding-window support TVM runs NORMAL RoPE as INLINE; ours must do the same."""
    d = Diff(make_shape(1, True))
    assert d.model.rope_mode == 2
    for s in (0, 1):
        d.add(s)
    d.step([(0, 20), (1, 33)])
    d.fork(1, 2, 17)
    d.step([(0, 1), (1, 1), (2, 1)])
    d.step([(2, 9), (0, 1)])


# ============================================================================ scripted scenarios


@pytest.mark.parametrize("rope_mode,sliding", CONFIGS, ids=CONFIG_IDS)
def test_fork_chain_and_pops(rope_mode, sliding):
    """A fork chain 6 levels deep with forks at every kind of position, decode on the leaves,
    pops into shared prefixes of several depths, removal of inner ancestors."""
    d = Diff(make_shape(rope_mode, sliding))
    d.add(0)
    d.step([(0, 40)])
    d.fork(0, 1, -1)  # at the end, mid-page (40)
    d.step([(1, 24)])  # 64: page-aligned
    d.fork(1, 2, 64)  # at the end, page-aligned: TVM adds an empty block to the parent
    d.step([(2, 5), (1, 1)])
    d.fork(2, 3, 50)  # inside the shared prefix (0..64 shared), mid-page
    d.fork(3, 4, 32)  # inside a shared prefix, page-aligned
    d.fork(4, 5, 0)  # empty child
    d.step([(3, 17), (4, 3), (5, 2), (0, 1)])
    d.fork(3, 6, 20)
    d.step([(6, 1), (3, 1), (2, 1), (1, 1), (4, 1), (0, 1)])  # all decode, 6 levels
    d.step([(6, 30), (2, 1), (5, 1)])
    d.popn(6, 5)  # within the last block
    d.popn(3, 30)  # across blocks into the shared prefix
    d.popn(2, 2)
    d.step([(3, 1), (6, 1), (2, 1)])
    d.popn(0, 30)  # the root pops into the prefix all its descendants share
    d.step([(0, 4), (1, 1)])
    d.remove(1)  # an inner ancestor: its blocks stay alive for descendants
    d.remove(3)
    d.step([(6, 2), (2, 1), (4, 1)])
    d.popn(2, 40)  # into a prefix that was shared with the removed ancestors
    d.step([(2, 1), (6, 1)])
    d.popn(6, d.model.length(6))  # pop everything
    d.step([(6, 3)])
    for s in list(d.model.seqs):
        d.remove(s)
    assert d.B.empty(d.caches["ours"])


@pytest.mark.parametrize("rope_mode,sliding", [(0, False), (2, True)], ids=["none", "inline-sw"])
def test_edge_cases(rope_mode, sliding):
    """Forks of empty sequences, pops to block boundaries, int64 ids, a full 16-sequence batch."""
    d = Diff(make_shape(rope_mode, sliding))
    big = 2**40 + 3
    d.add(big)
    d.fork(big, 1, -1)  # fork of an empty sequence
    d.fork(big, 2, 0)
    d.step([(big, 32), (1, 1), (2, 16)])
    d.fork(big, 3, 32)  # page-aligned end: TVM gives the parent a new empty block
    d.fork(big, 4, -1)
    d.step([(3, 10), (big, 1)])
    d.popn(3, 10)  # exactly back to the fork point: the child's own block becomes empty
    d.popn(3, 5)  # then into the shared prefix
    d.step([(3, 1), (4, 1)])
    d.fork(4, 5, 16)
    d.popn(4, 17)  # 4 has 33 tokens, all shared at fork time except the last
    d.remove(big)  # parent of everything
    d.step([(4, 2), (5, 1), (1, 1), (2, 1), (3, 1)])
    for s in range(6, 17):
        d.add(s)
    live = sorted(d.model.seqs)
    assert len(live) == 16
    d.step([(s, 1) for s in live])  # a full batch of decode rows, some on empty sequences
    d.step([(s, 1 + (i % 3) * 4) for i, s in enumerate(live)])  # a full mixed batch


def test_layer_offset():
    """A cache for layers [1, 3) of a 3-layer model (layer_indptr = (1, 3)): global layer ids."""
    shape = make_shape(2, False)
    B = tb.Builtins()
    outs = {}
    for name, create, kernels in (("tvm", tb.CREATE_NATIVE, tb.tvm_kernels(shape)),
                                  ("ours", tb.CREATE_OURS, tb.our_kernels(shape))):
        args = tb.create_args(shape, kernels, merge_functions=2)
        args[1], args[6] = tvm.runtime.ShapeTuple([1, 3]), tvm.runtime.ShapeTuple([0, 0, 0])
        c = tvm.get_global_func(create)(*args)
        rng = np.random.default_rng(0)
        B.add(c, 0)
        res = []
        for lengths in ([20], [1], [5]):
            B.begin(c, [0], lengths)
            for layer in (1, 2):
                qkv = rng.standard_normal((lengths[0], 12, 64)).astype(DTYPE)
                o = tvm.runtime.empty((lengths[0], 8, 64), DTYPE)
                B.attention(c, layer, 0.125, tvm.runtime.tensor(qkv), o)
                res.append(o.numpy())
            for bad in (0, 3):
                with pytest.raises(Exception):
                    B.attention(c, bad, 0.125, tvm.runtime.tensor(qkv), o)
            B.end(c)
        k, v = tvm.runtime.empty((2, 26, 2, 64), DTYPE), tvm.runtime.empty((2, 26, 2, 64), DTYPE)
        B.debug_get_kv(c, 0, 0, 26, k, v)
        outs[name] = res + [k.numpy(), v.numpy()]
    for got, expected in zip(outs["ours"], outs["tvm"]):
        np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def test_padded_qkv_rows():
    """qkv / o with more rows than the step's tokens: only the first n are read and written."""
    d = Diff(make_shape(2, False), names=("tvm", "ours"))
    d.add(0)
    d.step([(0, 20)])
    n, extra = 3, 4
    qkv = d.random_qkv(n + extra)
    outs = []
    for c in d.caches.values():
        d.B.begin(c, [0], [n])
        o = tvm.runtime.tensor(np.full((n + extra, 8, 64), 7.0, DTYPE))
        d.B.attention(c, 0, d.sm_scale, tvm.runtime.tensor(qkv[0]), o)
        d.B.end(c)
        outs.append(o.numpy())
    d.close("padded output", "ours", outs[1][:n], outs[0][:n])
    assert np.all(outs[1][n:] == 7.0) and np.all(outs[0][n:] == 7.0)


def test_ours_packed_create_matches_tvm():
    """``relax_kvcache.paged_attention_kv_cache_create`` with our kernels in TVM's format."""
    d = Diff(make_shape(2, False), names=("tvm", "ours_packed"))
    Workload(d, seed=5).run(40)


# ============================================================================ self / cross / merge


@pytest.mark.parametrize("rope_mode,sliding", CONFIGS, ids=CONFIG_IDS)
def test_self_cross_merge(rope_mode, sliding):
    """self_attention + cross_attention + merge_attn_output_inplace vs numpy (and TVM).

    Prefill-type steps only: then the paged metadata covers the cached prefix only (with an
    all-decode batch TVM appends before attention, so cross attention would see unwritten slots).
    """
    shape = make_shape(rope_mode, sliding)
    d = Diff(shape, names=("tvm", "ours"))
    d.add(0)
    d.add(1)
    d.step([(0, 45), (1, 16)])
    d.fork(0, 2, 30)  # shared prefix -> two depths for seq 2
    d.step([(2, 3), (0, 1)])
    d.add(3)  # nothing cached: cross attention must give the empty state
    batch = [(0, 1), (2, 7), (3, 5), (1, 1)]
    hq, hkv, hd = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    n = sum(length for _, length in batch)
    ids, lengths = [s for s, _ in batch], [length for _, length in batch]
    starts = [d.model.length(s) for s in ids]
    for c in d.caches.values():
        d.B.begin(c, ids, lengths)
    inline = shape.effective_rope_mode == 2
    for layer in range(shape.num_layers):
        q = d.rng.standard_normal((n, hq, hd)).astype(DTYPE)
        k = d.rng.standard_normal((n, hkv, hd)).astype(DTYPE)
        v = d.rng.standard_normal((n, hkv, hd)).astype(DTYPE)
        # numpy expectations per sequence
        exp_self_o, exp_self_lse = np.zeros((n, hq, hd)), np.zeros((n, hq))
        exp_cross_o, exp_cross_lse = np.zeros((n, hq, hd)), np.full((n, hq), -np.inf)
        off = 0
        for (s, length), start in zip(batch, starts):
            sl = slice(off, off + length)
            qs, ks = q[sl].astype(np.float64), k[sl].astype(np.float64)
            if inline:
                pos = np.arange(start, start + length)
                qs, ks = rope(qs, pos, shape.rope_theta, shape.rope_scale), rope(ks, pos, shape.rope_theta, shape.rope_scale)
            exp_self_o[sl], exp_self_lse[sl] = attend(qs, ks, v[sl], d.sm_scale, causal_offset=0)
            if start:
                kc, vc = d.model.cached_kv_for_attention(s, layer, start)
                exp_cross_o[sl], exp_cross_lse[sl] = attend(qs, kc, vc, d.sm_scale, causal_offset=None)
            off += length
        outs = {}
        for name, c in d.caches.items():
            o_s, lse_s = tvm.runtime.empty((n, hq, hd), DTYPE), tvm.runtime.empty((n, hq), "float32")
            o_c, lse_c = tvm.runtime.empty((n, hq, hd), DTYPE), tvm.runtime.empty((n, hq), "float32")
            tq, tk, tv = (tvm.runtime.tensor(a) for a in (q, k, v))
            d.B.self_attention(c, layer, d.sm_scale, tq, tk, tv, o_s, lse_s)
            d.B.cross_attention(c, layer, d.sm_scale, tq, o_c, lse_c)
            pre = (o_s.numpy(), lse_s.numpy(), o_c.numpy(), lse_c.numpy())
            ret = d.B.merge(c, o_s, lse_s, o_c, lse_c)
            assert len(ret) == 2
            outs[name] = pre + (o_s.numpy(), lse_s.numpy(), ret[0].numpy(), ret[1].numpy())
        has_prefix = np.repeat([start > 0 for start in starts], lengths)
        exp_o, exp_lse = exp_self_o.copy(), exp_self_lse.copy()
        for i in np.nonzero(has_prefix)[0]:  # merge of the two disjoint key sets
            m = np.maximum(exp_self_lse[i], exp_cross_lse[i])
            w1, w2 = np.exp2(exp_self_lse[i] - m), np.exp2(exp_cross_lse[i] - m)
            exp_o[i] = (exp_self_o[i] * w1[:, None] + exp_cross_o[i] * w2[:, None]) / (w1 + w2)[:, None]
            exp_lse[i] = np.log2(w1 + w2) + m
        for name, (so, slse, co, clse, mo, mlse, ro, rlse) in outs.items():
            what = f"layer {layer} {name}"
            d.close(f"self_attention o {what}", name, so, exp_self_o)
            d.close(f"self_attention lse {what}", name, slse, exp_self_lse)
            d.close(f"cross_attention o {what}", name, co[has_prefix], exp_cross_o[has_prefix])
            d.close(f"cross_attention lse {what}", name, clse[has_prefix], exp_cross_lse[has_prefix])
            d.close(f"merged o {what}", name, mo, exp_o)
            d.close(f"merged lse {what}", name, mlse, exp_lse)
            np.testing.assert_array_equal(ro, mo)
            np.testing.assert_array_equal(rlse, mlse)
        # documented: rows with nothing cached get the empty state (o = 0, lse = -inf)
        so, slse, co, clse = outs["ours"][:4]
        assert np.all(co[~has_prefix] == 0) and np.all(np.isneginf(clse[~has_prefix]))
        d.close(f"merged o ours vs tvm, layer {layer}", "ours", outs["ours"][4], outs["tvm"][4])
    positions = [d.B.query_positions(c).numpy().tolist() for c in d.caches.values()]
    assert positions[0] == positions[1] == np.concatenate(
        [np.arange(st, st + ln) for st, ln in zip(starts, lengths)]).tolist()
    for c in d.caches.values():
        d.B.end(c)


# ============================================================================ errors


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    name: str
    action: Callable  # action(diff, cache, direct: bool) performs the invalid operation
    prep: Optional[Callable] = None  # valid operations run on every cache first
    in_step: bool = False  # the invalid call happens inside a (valid) step


SEQ_BIG = 99  # an id that is never live


def fill_pages(d: Diff, leave_free: int) -> None:
    """Add sequence 7 and grow it until exactly ``leave_free`` pages are free."""
    d.add(7)
    ps = d.shape.page_size
    while True:
        free = int(d.B.num_available_pages(d.caches["tvm"]))
        if free <= leave_free:
            break
        tokens = min((free - leave_free) * ps, d.shape.prefill_chunk_size)
        if d.model.length(7) % ps:
            tokens = min(tokens, ps - d.model.length(7) % ps)  # finish the partial page first
        d.step([(7, tokens)])
    assert int(d.B.num_available_pages(d.caches["tvm"])) == leave_free


def kv_tensors(d: Diff, length: int, **kw):
    s = d.shape
    shp = (kw.get("layers", s.num_layers), length, kw.get("heads", s.num_kv_heads), kw.get("dim", s.head_dim))
    return tvm.runtime.empty(shp, kw.get("dtype", DTYPE)), tvm.runtime.empty(shp, kw.get("dtype", DTYPE))


def _call(d: Diff, cache, direct: bool, builtin: str, method: str, *args):
    """Call the builtin (any cache) or, for ours with ``direct``, the Python method."""
    if direct:
        return getattr(cache, method)(*args)
    return getattr(d.B, builtin)(cache, *args)


def _debug_get_kv(d, c, direct, seq, lo, hi, **kw):
    k, v = kv_tensors(d, max(hi - lo, 1), **kw)
    if direct:
        return c.debug_get_kv(seq, lo, hi, k, v)
    return d.B.debug_get_kv(c, seq, lo, hi, k, v)


def _begin(d, c, direct, ids, lengths):
    if direct:
        return c.begin_forward(ids, lengths)
    return d.B.begin(c, ids, lengths)


def _attention(d, c, direct, layer, rows=None, heads=None, dim=None, dtype=DTYPE, o_heads=None):
    s = d.shape
    n = d.cur_tokens if rows is None else rows
    heads = s.num_qo_heads + 2 * s.num_kv_heads if heads is None else heads
    dim = s.head_dim if dim is None else dim
    qkv = tvm.runtime.tensor(np.ones((n, heads, dim), dtype))
    o = tvm.runtime.empty((n, s.num_qo_heads if o_heads is None else o_heads, dim), dtype)
    if direct:
        return c.attention_with_fused_qkv(layer, qkv, o, d.sm_scale)
    return d.B.attention(c, layer, d.sm_scale, qkv, o)


def _len(d, s):
    return d.model.length(s)


ERROR_CASES = [
    # unknown sequence ids
    ErrorCase("remove_unknown", lambda d, c, x: _call(d, c, x, "remove", "remove_sequence", SEQ_BIG)),
    ErrorCase("popn_unknown", lambda d, c, x: _call(d, c, x, "popn", "popn", SEQ_BIG, 1)),
    ErrorCase("fork_unknown_parent", lambda d, c, x: _call(d, c, x, "fork", "fork_sequence", SEQ_BIG, 50, -1)),
    ErrorCase("begin_forward_unknown", lambda d, c, x: _begin(d, c, x, [0, SEQ_BIG], [1, 1])),
    ErrorCase("debug_get_kv_unknown", lambda d, c, x: _debug_get_kv(d, c, x, SEQ_BIG, 0, 1)),
    # duplicates
    ErrorCase("add_duplicate", lambda d, c, x: _call(d, c, x, "add", "add_sequence", 1)),
    ErrorCase("fork_child_exists", lambda d, c, x: _call(d, c, x, "fork", "fork_sequence", 0, 1, -1)),
    # fork / popn ranges
    ErrorCase("fork_pos_below_minus1", lambda d, c, x: _call(d, c, x, "fork", "fork_sequence", 0, 50, -2)),
    ErrorCase("fork_pos_beyond_length", lambda d, c, x: _call(d, c, x, "fork", "fork_sequence", 0, 50, _len(d, 0) + 1)),
    ErrorCase("popn_beyond_length", lambda d, c, x: _call(d, c, x, "popn", "popn", 0, _len(d, 0) + 1)),
    ErrorCase("popn_negative", lambda d, c, x: _call(d, c, x, "popn", "popn", 0, -1)),
    ErrorCase("debug_get_kv_end_beyond_length", lambda d, c, x: _debug_get_kv(d, c, x, 0, 0, _len(d, 0) + 1)),
    ErrorCase("debug_get_kv_empty_range", lambda d, c, x: _debug_get_kv(d, c, x, 0, 3, 3)),
    ErrorCase("debug_get_kv_wrong_tensor_shape",
              lambda d, c, x: _debug_get_kv(d, c, x, 0, 0, 4, heads=d.shape.num_kv_heads + 1)),
    # begin_forward
    ErrorCase("begin_forward_append_zero", lambda d, c, x: _begin(d, c, x, [0, 1], [3, 0])),
    ErrorCase("begin_forward_mismatched_lists", lambda d, c, x: _begin(d, c, x, [0, 1], [3])),
    ErrorCase("begin_forward_cache_full", lambda d, c, x: _begin(d, c, x, [0, 1], [40, 40]),
              prep=lambda d: fill_pages(d, 2)),
    ErrorCase("begin_forward_decode_cache_full", lambda d, c, x: _begin(d, c, x, [7, 0], [1, 1]),
              prep=lambda d: fill_pages(d, 0)),
    # structure changes that need a free page when none is left
    ErrorCase("fork_mid_page_cache_full",
              lambda d, c, x: _call(d, c, x, "fork", "fork_sequence", 0, 50, 20),
              prep=lambda d: fill_pages(d, 0)),
    ErrorCase("popn_into_shared_prefix_cache_full",
              lambda d, c, x: _call(d, c, x, "popn", "popn", 4, 5),
              prep=lambda d: (d.fork(0, 4, 32), fill_pages(d, 0))),
    # inside a step
    ErrorCase("qkv_wrong_head_count", lambda d, c, x: _attention(d, c, x, 0, heads=d.shape.num_qo_heads + 1), in_step=True),
    ErrorCase("qkv_wrong_head_dim", lambda d, c, x: _attention(d, c, x, 0, dim=d.shape.head_dim // 2), in_step=True),
    ErrorCase("qkv_wrong_dtype", lambda d, c, x: _attention(d, c, x, 0, dtype="float16"), in_step=True),
    ErrorCase("qkv_too_few_rows", lambda d, c, x: _attention(d, c, x, 0, rows=d.cur_tokens - 1), in_step=True),
    ErrorCase("output_wrong_head_count", lambda d, c, x: _attention(d, c, x, 0, o_heads=d.shape.num_qo_heads - 1), in_step=True),
    ErrorCase("layer_id_too_large", lambda d, c, x: _attention(d, c, x, d.shape.num_layers), in_step=True),
    ErrorCase("layer_id_negative", lambda d, c, x: _attention(d, c, x, -1), in_step=True),
]

ERROR_SHAPE = dict(max_total_seq_len=256, prefill_chunk_size=128, max_num_seqs=8)


def error_prestate(d: Diff) -> None:
    """seq 0: 38 tokens, seq 1: 21, seq 2: forked from 0 at 20 (+5), seq 3: forked from 2 at its end."""
    for s in (0, 1, 2):
        if s != 2:
            d.add(s)
    d.step([(0, 37), (1, 20)])
    d.fork(0, 2, 20)
    d.step([(0, 1), (1, 1), (2, 5)])
    d.fork(2, 3, -1)


def snapshot(cache, d: Diff) -> dict:
    """Everything observable about our cache, bit-exact (plus the paging state if exposed)."""
    snap = {
        "free_pages": cache.get_num_available_pages(),
        "total_length": cache.get_total_sequence_length(),
        "empty": cache.empty(),
        "lengths": {s: cache.get_sequence_length(s) for s in d.model.seqs},
        "active_step": getattr(cache, "_step", None) is not None,
    }
    for s, length in snap["lengths"].items():
        if length:
            k, v = d.read_kv(cache, s, 0, length)
            snap[f"kv{s}"] = (k.view(np.uint32).tobytes(), v.view(np.uint32).tobytes())
    paging = getattr(cache, "_paging", None)
    if paging is not None and hasattr(paging, "debug_snapshot"):
        snap["paging"] = paging.debug_snapshot()
    return snap


def assert_same_snapshot(before: dict, after: dict, what: str) -> None:
    for key in before:
        assert before[key] == after[key], f"{what}: our cache changed ({key}) although the call failed"


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c.name for c in ERROR_CASES])
def test_invalid_operation(case: ErrorCase):
    d = Diff(make_shape(1, False, **ERROR_SHAPE), names=("tvm", "ours"))
    error_prestate(d)
    if case.prep is not None:
        case.prep(d)
    ours, native = d.caches["ours"], d.caches["tvm"]
    step_batch = [(0, 2), (3, 1)]
    if case.in_step:
        d.cur_tokens = sum(n for _, n in step_batch)
        for c in (native, ours):
            d.B.begin(c, [s for s, _ in step_batch], [n for _, n in step_batch])
    before = snapshot(ours, d)

    with pytest.raises(Exception):  # tvm.error.TVMError / InternalError in practice
        case.action(d, native, False)
    # ours, through the vm.builtin dispatcher: must fail too, and not as "not implemented"
    with pytest.raises(Exception) as info:
        case.action(d, ours, False)
    assert not isinstance(info.value, NotImplementedError), info.value
    assert_same_snapshot(before, snapshot(ours, d), f"{case.name} (builtin)")
    # ours, called directly: the documented exception type
    with pytest.raises(rk.KVCacheError) as info:
        case.action(d, ours, True)
    assert isinstance(info.value, ValueError)
    assert_same_snapshot(before, snapshot(ours, d), f"{case.name} (direct)")

    # the next valid operations still match TVM
    if case.in_step:
        # finish the interrupted step with valid inputs on both caches (TVM checks before acting)
        qkv = d.random_qkv(d.cur_tokens)
        expected = d.model.step(step_batch, qkv, d.sm_scale)
        for layer in range(d.shape.num_layers):
            outs = []
            for c in (native, ours):
                o = tvm.runtime.empty((d.cur_tokens, d.shape.num_qo_heads, d.shape.head_dim), DTYPE)
                d.B.attention(c, layer, d.sm_scale, tvm.runtime.tensor(qkv[layer]), o)
                outs.append(o.numpy())
            d.close("output after error", "tvm~model", outs[0], expected[layer])
            d.close("output after error", "ours", outs[1], outs[0])
        for c in (native, ours):
            d.B.end(c)
        d.log.append(Op("step", tuple(step_batch), qkv))
        d.check_all()
    else:
        d.replay("tvm")  # TVM's cache may be half-updated after its error: rebuild it
        d.check_all()
        if 7 in d.model.seqs:
            d.remove(7)
    d.step([(0, 1), (1, 17), (2, 1), (3, 4)])
    d.fork(3, 5, -1)
    d.popn(0, 3)
    d.step([(5, 1), (0, 2)])


# Calls where our cache is documented to be stricter than TVM's (TVM accepts them or fails later).
STRICTER_CASES = {
    "begin_forward_empty_batch": (False, lambda d, c: c.begin_forward([], [])),
    "begin_forward_duplicate_ids": (False, lambda d, c: c.begin_forward([0, 0], [1, 1])),
    "begin_forward_over_prefill_chunk": (False, lambda d, c: c.begin_forward([0], [d.shape.prefill_chunk_size + 1])),
    "begin_forward_while_step_active": (True, lambda d, c: c.begin_forward([1], [1])),
    "remove_while_step_active": (True, lambda d, c: c.remove_sequence(1)),
    "fork_while_step_active": (True, lambda d, c: c.fork_sequence(1, 50, -1)),
    "popn_while_step_active": (True, lambda d, c: c.popn(1, 1)),
    "attention_without_step": (False, lambda d, c: c.attention_with_fused_qkv(
        0, tvm.runtime.empty((1, 12, 64), DTYPE), tvm.runtime.empty((1, 8, 64), DTYPE), 0.125)),
}


@pytest.mark.parametrize("name", list(STRICTER_CASES))
def test_stricter_than_tvm(name):
    """Ours rejects these (state unchanged) and continues to match TVM afterwards."""
    in_step, action = STRICTER_CASES[name]
    d = Diff(make_shape(1, False, **ERROR_SHAPE), names=("tvm", "ours"))
    error_prestate(d)
    ours = d.caches["ours"]
    if in_step:
        ours.begin_forward([0], [2])
    before = snapshot(ours, d)
    with pytest.raises(rk.KVCacheError):
        action(d, ours)
    assert_same_snapshot(before, snapshot(ours, d), name)
    if in_step:
        ours.end_forward()
        # the begun step reserved 2 tokens for seq 0 without writing them: drop them again
        ours.popn(0, 2)
    d.step([(0, 1), (1, 17), (3, 4)])


def test_builtin_errors_keep_their_type():
    """Through ``vm.builtin.*`` our errors should still be ``KVCacheError`` / ``ValueError``."""
    d = Diff(make_shape(0, False, **ERROR_SHAPE), names=("tvm", "ours"))
    d.add(0)
    with pytest.raises(rk.SequenceError):
        d.B.remove(d.caches["ours"], SEQ_BIG)
    with pytest.raises(NotImplementedError):
        tvm.get_global_func("vm.builtin.kv_cache_disagg_prepare_recv")(d.caches["ours"], 0, 4)
    with pytest.raises(rk.KVCacheError, match="support_sliding_window"):
        tvm.get_global_func("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")(d.caches["ours"], 0, 8, 2)


# ============================================================================ sliding windows
#
# Per-sequence windows with attention sinks, per-layer windows (AttnKind.MHA_SLIDING) and
# shared-KV attention, against TVM's native cache, in the regimes where TVM is correct (see the
# documented differences in the README): no fork of a windowed sequence whose last block has
# slid, no fork at a windowed sequence's page-aligned end, no popn of windowed sequences; per-layer
# windows without forks, every append <= window, RoPE NONE or NORMAL.
#
# Two more TVM limits found while writing these tests (both TVM bugs, worked around here):
# * a sequence without an attention sink in its last block must not get an append that frees a
#   page within the step (TVM indexes page_ids[-1]); see WindowWorkload;
# * TVM's CPU paged prefill kernel with a layer window reads uninitialised memory for rows whose
#   first key column is masked, so on MHA_SLIDING layers TVM's outputs are only compared for
#   all-decode steps and steps that end within the window; other steps compare ours with the
#   numpy model (see tvm_layer_window_output_reliable). Cache contents are always compared.

SEQ_WINDOW_SHAPE = dict(max_total_seq_len=1024, prefill_chunk_size=256, max_num_seqs=16)


class WindowWorkload:
    """Seeded random operations on a cache with per-sequence sliding windows (through a Diff).

    Windowed sequences (random window 8..60, sink 0..window-1) and plain ones share batches;
    prefill appends are often longer than the window; windowed sequences are forked only within
    their sink and before their last block first slides; plain sequences are forked anywhere and
    popped; sequences are removed and new ones added.

    A windowed sequence whose last block has no sink of its own (sink 0, or a fork moved the
    whole sink into a prefix block) only gets appends <= window: when such an append is longer
    and frees a page within the step, TVM computes negative in-block offsets for the tokens that
    slide out (``page_ids[-1]``: undefined behaviour), and ours miscomputes their slots too
    (see ``test_sink_zero_append_longer_than_window``).
    """

    def __init__(self, d: Diff, seed: int) -> None:
        self.d = d
        self.r = np.random.default_rng(2000 + seed)
        self.next_id = 100
        self.slid: set = set()  # windowed sequences whose last block has slid at least once
        self.no_block_sink: set = set()  # windowed sequences whose last block may have no sink
        self.slid_tokens = 0  # tokens dropped by sliding, over all sequences
        self.stats: collections.Counter = collections.Counter()

    @property
    def m(self) -> CacheModel:
        return self.d.model

    def free_pages(self) -> int:
        return int(self.d.B.num_available_pages(self.d.caches["tvm"]))

    def new_id(self) -> int:
        self.next_id += int(self.r.integers(1, 5))
        return self.next_id

    def add_windowed(self) -> int:
        seq = self.new_id()
        window = int(self.r.integers(8, 61))
        sink = int(self.r.integers(0, window))
        self.d.add(seq)
        self.d.enable_window(seq, window, sink)
        if sink == 0:
            self.no_block_sink.add(seq)
        self.stats["add_windowed"] += 1
        return seq

    def add_plain(self) -> int:
        seq = self.new_id()
        self.d.add(seq)
        self.stats["add_plain"] += 1
        return seq

    def append_length(self, seq: int, decode: bool) -> int:
        if decode:
            return 1
        if seq in self.m.windows:
            window = self.m.windows[seq][0]
            if seq in self.no_block_sink:
                return int(self.r.integers(2, window + 1))
            # often longer than the window (the step slides inside one append)
            self.stats["long_append"] += 1
            return int(self.r.integers(2, 2 * window + 10))
        return int(self.r.integers(2, 60))

    def step(self, seqs: Sequence[int], decode: bool) -> None:
        ps = self.d.shape.page_size
        budget, pages, batch = self.d.shape.prefill_chunk_size, self.free_pages() - 2, []
        for seq in seqs:
            n = min(self.append_length(seq, decode), budget - (len(seqs) - len(batch) - 1))
            need = -(-n // ps) + 1
            if n < 1 or need > pages:
                continue
            pages -= need
            budget -= n
            batch.append((seq, n))
        if not batch:
            return
        before = {s: self.m.length(s) for s, _ in batch}
        self.d.step(batch)
        for s, n in batch:
            if s in self.m.windows and before[s] + n > self.m.windows[s][0]:
                self.slid.add(s)
                self.slid_tokens += before[s] + n - self.m.length(s)
        self.stats["decode" if decode else "prefill"] += 1
        self.check_bounded()

    def check_bounded(self) -> None:
        """Used pages never exceed what the kept tokens need (+2 pages per sequence)."""
        ps = self.d.shape.page_size
        used = self.d.shape.num_total_pages - self.free_pages()
        bound = sum(-(-self.m.length(s) // ps) + 2 for s in self.m.seqs)
        assert used <= bound, f"{used} pages in use, more than {bound}; {self.d.where()}"
        for s, (window, _) in self.m.windows.items():
            assert self.m.length(s) <= window

    def fork_candidates(self, windowed: bool) -> List[Tuple[int, List[int]]]:
        ps = self.d.shape.page_size
        cands = []
        for s in sorted(self.m.seqs):
            length = self.m.length(s)
            if (s in self.m.windows) != windowed or length == 0:
                continue
            if windowed:
                if s in self.slid:
                    continue
                top = min(self.m.windows[s][1], length)
                positions = [p for p in range(0, top + 1) if not (p == length and p % ps == 0)]
                if positions:
                    cands.append((s, positions))
            else:
                cands.append((s, [-1, 0] + list(range(1, length + 1))))
        return cands

    def fresh_windowed_parent(self) -> None:
        """A new windowed sequence with a sink of 16..29 tokens, prefilled within its window."""
        seq = self.new_id()
        window = int(self.r.integers(32, 61))
        sink = int(self.r.integers(16, 30))
        self.d.add(seq)
        self.d.enable_window(seq, window, sink)
        self.d.step([(seq, int(self.r.integers(sink - 4, window + 1)))])
        self.stats["add_windowed"] += 1

    def fork(self, windowed: bool) -> None:
        if self.free_pages() < 8:
            return
        cands = self.fork_candidates(windowed)
        if not cands and windowed:
            self.fresh_windowed_parent()
            cands = self.fork_candidates(windowed)
        if not cands:
            return
        parent, positions = cands[int(self.r.integers(len(cands)))]
        pos = int(self.r.choice(positions))
        ps = self.d.shape.page_size
        child = self.new_id()
        self.d.fork(parent, child, pos)
        windowed = parent in self.m.windows
        self.stats["fork_windowed_parent" if windowed else "fork_plain_parent"] += 1
        if windowed and pos >= ps:
            self.stats["fork_splits_windowed_block"] += 1
            if pos // ps * ps == self.m.windows[parent][1]:
                self.no_block_sink.add(parent)  # the whole sink moved to the new prefix block
        # sometimes the child gets a window of its own, with its whole prefix inside the sink
        end = self.m.length(child)
        if self.r.random() < 0.3 and end < 59:
            sink = int(self.r.integers(end + 1, 60))
            window = int(self.r.integers(sink + 1, 61))
            self.d.enable_window(child, window, sink)
            self.stats["window_on_child"] += 1

    def popn(self) -> None:
        plain = [s for s in self.m.seqs if s not in self.m.windows and self.m.length(s) > 0]
        if not plain or self.free_pages() < 4:
            return
        s = int(self.r.choice(plain))
        self.d.popn(s, int(self.r.integers(1, self.m.length(s) + 1)))
        self.stats["popn_plain"] += 1

    def remove(self) -> None:
        s = int(self.r.choice(sorted(self.m.seqs)))
        windowed = s in self.m.windows
        self.d.remove(s)
        self.slid.discard(s)
        self.no_block_sink.discard(s)
        self.stats["remove_windowed" if windowed else "remove_plain"] += 1

    def random_batch(self, decode: bool) -> List[int]:
        live = sorted(self.m.seqs)
        k = int(self.r.integers(1, min(len(live), 8) + 1))
        return [int(s) for s in self.r.choice(live, size=k, replace=False)]

    def run(self, num_ops: int, decode_runs: Sequence[int] = (40,)) -> None:
        for _ in range(3):
            self.add_windowed()
        self.add_plain()
        runs = {int(x) for x in np.linspace(num_ops // 3, num_ops - 1, len(decode_runs))}
        run_lengths = iter(decode_runs)
        for i in range(num_ops):
            live = len(self.m.seqs)
            if i in runs:
                # a long decode run over (up to 8 of) the live sequences: windows slide many pages
                seqs = sorted(self.m.seqs)[:8]
                for _ in range(next(run_lengths)):
                    self.step(seqs, decode=True)
                continue
            x = self.r.random()
            if live < 3 or (x < 0.12 and live < 12):
                self.add_windowed() if self.r.random() < 0.6 else self.add_plain()
            elif x < 0.24 and live < 12:
                self.fork(windowed=self.r.random() < 0.6)
            elif x < 0.30:
                self.popn()
            elif x < 0.38 or self.free_pages() < 12:
                self.remove()
            else:
                self.step(self.random_batch(False), decode=self.r.random() < 0.35)


@pytest.mark.parametrize("rope_mode", [0, 2], ids=["none", "inline"])
def test_sequence_windows_random(rope_mode):
    d = Diff(make_shape(rope_mode, True, **SEQ_WINDOW_SHAPE), seed=11)
    w = WindowWorkload(d, seed=rope_mode)
    w.run(70, decode_runs=(40,))
    s = w.stats
    for key in ("fork_windowed_parent", "fork_splits_windowed_block", "fork_plain_parent", "prefill",
                "decode", "long_append", "remove_windowed", "popn_plain"):
        assert s[key] >= 1, (key, dict(s))
    assert w.slid_tokens >= 10 * d.shape.page_size, (w.slid_tokens, dict(s))
    assert d.max_err["ours_tvmk"] < 1e-5, dict(d.max_err)
    for seq in sorted(d.model.seqs):
        d.remove(seq)
    assert all(d.B.empty(c) for c in d.caches.values())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("rope_mode", [0, 1, 2], ids=["none", "normal-becomes-inline", "inline"])
def test_sequence_windows_random_more_seeds(rope_mode, seed):
    d = Diff(make_shape(rope_mode, True, **SEQ_WINDOW_SHAPE), seed=seed)
    w = WindowWorkload(d, seed=10 * seed + rope_mode)
    w.run(60, decode_runs=(30, 30))
    assert w.slid_tokens >= 10 * d.shape.page_size, (w.slid_tokens, dict(w.stats))


def tvm_layer_window_output_reliable(d: Diff, batch) -> bool:
    """Whether TVM's outputs on MHA_SLIDING layers are deterministic for this step.

    TVM's CPU paged prefill kernel (``_attention_prefill_cpu``, causal with a window) leaves
    ``new_m`` unset for masked key columns, so a row whose first key column is masked starts
    its online softmax from uninitialised memory (NaN or wrong rows, depending on what the
    memory held). All-decode steps use the decode kernel (no masking); a prefill step is safe
    while every sequence ends it within the window (nothing masked).
    """
    window = d.shape.layer_window_size
    return all(n == 1 for _, n in batch) or all(d.model.length(s) + n <= window for s, n in batch)


def layer_window_steps(d: Diff, seed: int, num_steps: int, *, popn: bool = False) -> collections.Counter:
    """Random prefill / decode steps with every append <= the layer window, no forks; sequences
    are added and removed (and, with ``popn``, popped within their last block)."""
    r = np.random.default_rng(3000 + seed)
    window = d.shape.layer_window_size
    stats: collections.Counter = collections.Counter()
    next_id = 0
    for i in range(num_steps):
        live = sorted(d.model.seqs)
        x = r.random()
        if len(live) < 2 or (x < 0.08 and len(live) < 6):
            d.add(next_id)
            next_id += 1
            stats["add"] += 1
            continue
        if x < 0.12 and len(live) > 2:
            d.remove(int(r.choice(live)))
            stats["remove"] += 1
            continue
        if popn and x < 0.18:
            s = int(r.choice(live))
            if d.model.length(s) > 1:
                d.popn(s, int(r.integers(1, min(window, d.model.length(s)) + 1)))
                stats["popn"] += 1
                continue
        k = int(r.integers(1, len(live) + 1))
        ids = [int(s) for s in r.choice(live, size=k, replace=False)]
        decode = r.random() < 0.4
        batch = [(s, 1 if decode or r.random() < 0.3 else int(r.integers(2, window + 1))) for s in ids]
        reliable = tvm_layer_window_output_reliable(d, batch)
        d.step(batch, baseline="tvm" if reliable else "model")
        stats["decode" if decode else "prefill"] += 1
        stats["vs_tvm" if reliable else "vs_model"] += 1
    stats["max_len"] = max(d.model.length(s) for s in d.model.seqs)
    return stats


# (page size, layer window, rope mode, extra shape)
LAYER_WINDOW_CASES = {
    "p16-w5-none": (16, 5, 0, {}),
    "p16-w23-normal": (16, 23, 1, {}),
    "p16-w40-normal-theta": (16, 40, 1, dict(rope_theta=5e5, rope_scale=0.5)),
    "p4-w12-none": (4, 12, 0, {}),
    "p4-w5-normal": (4, 5, 1, {}),
}


LAYER_WINDOW_SLOW = ("p16-w23-normal", "p4-w5-normal")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in LAYER_WINDOW_SLOW else c
                                  for c in LAYER_WINDOW_CASES])
def test_layer_windows_random(case):
    """MHA_SLIDING layers mixed with MHA layers vs TVM's native cache and the numpy model."""
    ps, window, rope_mode, extra = LAYER_WINDOW_CASES[case]
    kinds = (3, 0) if ps == 16 else (0, 3)
    d = Diff(make_shape(rope_mode, False, page_size=ps, attn_kinds=kinds, layer_window=window,
                        max_total_seq_len=1024, prefill_chunk_size=128, **extra), seed=21)
    stats = layer_window_steps(d, seed=len(case), num_steps=40, popn=ps == 4)
    assert stats["max_len"] > 3 * window and stats["decode"] and stats["prefill"], dict(stats)
    assert ps != 4 or stats["popn"], dict(stats)
    assert stats["vs_tvm"] >= 10 and stats["vs_model"] >= 5, dict(stats)
    # ours_tvmk reads the windows through other (equally valid) page views: not bit-identical
    assert d.max_err["ours_tvmk"] < 1e-4, dict(d.max_err)


# (source layer kind, rope mode, page size, layer window)
SHARED_KV_CASES = {
    "mha-none": (0, 0, 16, None),
    "mha-inline": (0, 2, 16, None),
    "sliding-none-p16-w6": (3, 0, 16, 6),
    "sliding-none-p4-w9": (3, 0, 4, 9),
}


@pytest.mark.parametrize("case", list(SHARED_KV_CASES))
def test_attention_with_shared_kv_vs_tvm(case):
    """``attention_with_shared_kv`` over a source layer (MHA or MHA_SLIDING) in prefill, mixed
    and decode steps of several sequences, after the source layer's fused attention."""
    kind, rope_mode, ps, window = SHARED_KV_CASES[case]
    d = Diff(make_shape(rope_mode, False, page_size=ps, attn_kinds=(kind, 0), layer_window=window,
                        max_total_seq_len=512, prefill_chunk_size=96), seed=31)
    r = np.random.default_rng(len(case))
    limit = window or 40  # appends stay within the source layer's window
    hq, hd = d.shape.num_qo_heads, d.shape.head_dim
    for s in range(3):
        d.add(s)
    stats: collections.Counter = collections.Counter()
    for i in range(16):
        live = sorted(d.model.seqs)
        kind_of_step = ("prefill", "decode", "mixed")[i % 3]
        ids = [int(s) for s in r.choice(live, size=int(r.integers(1, len(live) + 1)), replace=False)]
        batch = [(s, 1 if kind_of_step == "decode" or (kind_of_step == "mixed" and j % 2)
                  else int(r.integers(2, limit + 1))) for j, s in enumerate(ids)]
        n = sum(length for _, length in batch)
        q_shared = r.standard_normal((n, hq, hd)).astype(DTYPE)
        reliable = kind != 3 or tvm_layer_window_output_reliable(d, batch)
        d.step(batch, shared_kv={0: q_shared}, baseline="tvm" if reliable else "model")
        stats[kind_of_step] += 1
        stats["vs_tvm" if reliable else "vs_model"] += 1
        if i == 7:
            d.remove(live[0])
            d.add(10)
    assert stats["vs_tvm"] >= 6, dict(stats)


# ---------------------------------------------------------------------------- window errors

def window_prestate(d: Diff) -> None:
    """seq 0: plain, 20 tokens; seq 1: window 20 / sink 6, 12 tokens (not slid yet);
    seq 2: window 10 / sink 3, slid (a 30-token append, then decode)."""
    for s in (0, 1, 2):
        d.add(s)
    d.enable_window(1, 20, 6)
    d.enable_window(2, 10, 3)
    d.step([(0, 20), (1, 12), (2, 30)])
    d.step([(2, 1), (0, 1)])


def _enable(d, c, x, seq, window, sink):
    return _call(d, c, x, "enable_window", "enable_sliding_window_for_seq", seq, window, sink)


def _fork(d, c, x, parent, child, pos):
    return _call(d, c, x, "fork", "fork_sequence", parent, child, pos)


WINDOW_ERROR_CASES = {
    "window_size_zero": lambda d, c, x: _enable(d, c, x, 0, 0, 0),
    "window_size_negative": lambda d, c, x: _enable(d, c, x, 0, -4, 0),
    "sink_negative": lambda d, c, x: _enable(d, c, x, 0, 10, -1),
    "sink_equals_window": lambda d, c, x: _enable(d, c, x, 0, 10, 10),
    "sink_above_window": lambda d, c, x: _enable(d, c, x, 0, 10, 12),
    "enabled_twice": lambda d, c, x: _enable(d, c, x, 1, 20, 6),
    "enabled_twice_other_sizes": lambda d, c, x: _enable(d, c, x, 2, 30, 1),
    "unknown_sequence": lambda d, c, x: _enable(d, c, x, SEQ_BIG, 10, 2),
    "fork_past_sink": lambda d, c, x: _fork(d, c, x, 1, 50, 7),
    "fork_at_end_past_sink": lambda d, c, x: _fork(d, c, x, 1, 50, -1),
    "fork_past_sink_of_slid_sequence": lambda d, c, x: _fork(d, c, x, 2, 50, 4),
    "fork_at_end_of_slid_sequence": lambda d, c, x: _fork(d, c, x, 2, 50, 10),
}


@pytest.mark.parametrize("name", list(WINDOW_ERROR_CASES))
def test_invalid_window_operation(name):
    """TVM rejects it; ours raises a KVCacheError (through the builtin and directly) and keeps
    its state exactly; both caches go on matching afterwards."""
    action = WINDOW_ERROR_CASES[name]
    d = Diff(make_shape(0, True, max_total_seq_len=256, prefill_chunk_size=128, max_num_seqs=8),
             names=("tvm", "ours"))
    window_prestate(d)
    ours, native = d.caches["ours"], d.caches["tvm"]
    before = snapshot(ours, d)
    native_before = (int(d.B.num_available_pages(native)), int(d.B.total_sequence_length(native)))
    with pytest.raises(Exception):  # tvm.error.InternalError in practice
        action(d, native, False)
    with pytest.raises(rk.KVCacheError):
        action(d, ours, False)
    assert_same_snapshot(before, snapshot(ours, d), f"{name} (builtin)")
    with pytest.raises(rk.KVCacheError) as info:
        action(d, ours, True)
    assert isinstance(info.value, ValueError)
    assert_same_snapshot(before, snapshot(ours, d), f"{name} (direct)")
    # TVM checks before it mutates: its cache is unchanged too, and both continue identically
    assert native_before == (int(d.B.num_available_pages(native)), int(d.B.total_sequence_length(native)))
    d.check_all()
    d.fork(1, 60, 6)  # at the sink: fine
    d.fork(2, 61, 3)
    d.step([(0, 1), (1, 9), (2, 1), (60, 2), (61, 1)])  # seq 1 slides now (21 > 20)
    d.step([(1, 1), (2, 1), (60, 1)])


@pytest.mark.parametrize("layer_windows", [False, True], ids=["plain", "layer-window-is-not-support"])
def test_window_without_support(layer_windows):
    """A cache without support_sliding_window (and no MHA_SLIDING layer) rejects windows in TVM
    and ours. With MHA_SLIDING layers both accept the call (the sequence is marked, never slides)
    and then restrict forks to the sink."""
    kw = dict(attn_kinds=(3, 0), layer_window=8) if layer_windows else {}
    d = Diff(make_shape(0, False, max_total_seq_len=256, **kw), names=("tvm", "ours"))
    d.add(0)
    d.step([(0, 6)])
    ours = d.caches["ours"]
    if not layer_windows:
        before = snapshot(ours, d)
        with pytest.raises(Exception):
            d.B.enable_window(d.caches["tvm"], 0, 20, 4)
        with pytest.raises(rk.KVCacheError, match="support_sliding_window"):
            d.B.enable_window(ours, 0, 20, 4)
        with pytest.raises(rk.KVCacheError, match="support_sliding_window"):
            ours.enable_sliding_window_for_seq(0, 20, 4)
        assert_same_snapshot(before, snapshot(ours, d), "enable without support")
        d.step([(0, 5)])
        return
    for c in d.caches.values():
        d.B.enable_window(c, 0, 20, 4)
    for _ in range(16):  # decode past the sequence window: nothing slides (the model has none)
        d.step([(0, 1)])
    assert d.model.length(0) == 22
    before = snapshot(ours, d)
    with pytest.raises(Exception):
        d.B.fork(d.caches["tvm"], 0, 1, 5)
    with pytest.raises(rk.KVCacheError):
        d.B.fork(ours, 0, 1, 5)
    assert_same_snapshot(before, snapshot(ours, d), "fork past the sink")
    d.fork(0, 1, 4)
    d.step([(0, 1), (1, 1)])


# ------------------------------------------------- windows sliding within a step

@pytest.mark.parametrize("batch", [[(0, 24)], [(0, 24), (1, 2)], [(1, 2), (0, 40)]],
                         ids=["alone", "batched", "batched-longer"])
def test_sink_zero_append_longer_than_window(batch):
    """Ours against the numpy model only: TVM computes the same negative offsets
    (``block.page_ids[-1]``, undefined behaviour), so it is not run here.

    Window 8, sink 0, page 16: an append of 24 tokens reserves 2 pages and slides 16 tokens out,
    freeing the first page within the step: the kept 8 tokens are the last 8 appended, the
    tokens that slid out within the step are not written (append position -1)."""
    shape = make_shape(0, True, max_total_seq_len=256, prefill_chunk_size=128, max_num_seqs=4)
    B, cache = tb.Builtins(), tb.create_ours_direct(shape)
    model = CacheModel(shape.num_layers, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, 0,
                       shape.rope_theta, shape.rope_scale)
    for s in (0, 1):
        B.add(cache, s)
        model.add(s)
    B.enable_window(cache, 0, 8, 0)
    model.enable_window(0, 8, 0)
    rng = np.random.default_rng(0)
    n = sum(length for _, length in batch)
    qkv = [rng.standard_normal((n, 12, 64)).astype(DTYPE) for _ in range(shape.num_layers)]
    B.begin(cache, [s for s, _ in batch], [length for _, length in batch])
    outs = []
    for layer in range(shape.num_layers):
        o = tvm.runtime.empty((n, 8, 64), DTYPE)
        B.attention(cache, layer, 0.125, tvm.runtime.tensor(qkv[layer]), o)
        outs.append(o.numpy())
    B.end(cache)
    expected = model.step(batch, qkv, 0.125)
    for got, exp in zip(outs, expected):
        np.testing.assert_allclose(got, exp, atol=TOL, rtol=0)
    for s, seq in model.seqs.items():
        if seq.length == 0:
            continue
        k, v = tvm.runtime.empty((2, seq.length, 2, 64), DTYPE), tvm.runtime.empty((2, seq.length, 2, 64), DTYPE)
        B.debug_get_kv(cache, s, 0, seq.length, k, v)
        np.testing.assert_allclose(k.numpy(), seq.k, atol=TOL, rtol=0)
        np.testing.assert_allclose(v.numpy(), seq.v, atol=TOL, rtol=0)


# ============================================================================ token trees
#
# Speculative decoding: ``begin_forward`` with ``token_tree_parent_ptr`` and
# ``commit_accepted_token_tree_nodes``, against TVM's native cache, RoPE NONE and NORMAL (TVM
# forbids trees with INLINE RoPE and with sliding windows). Regimes where TVM is correct, i.e.
# around its documented bugs (docs/status.md):
#
# 1. commit decides whether to copy from the last sequence's chain flag only: in every commit the
#    last sequence's tree is not a chain, or all are chains (see ``order_for_commit``);
# 2. each tree is appended in one step and committed before the next: trees grown over several
#    steps make TVM's native cache read out of bounds (a segfault, depending on the heap's state)
#    in some workloads, so they are tested against the float64 reference only
#    (tests/test_token_tree.py) and through TVM's own suite;
# 3. commits only accept paths whose nodes are < the sequence's last append length.
#
# Found while writing these: TVM's commit indexes the LAST STEP's batch by position
# (``cur_seq_ids_[i]``, ``cur_append_lengths_[i]``, the i-th sequence's append positions), not by
# the sequence ids it is given: a commit must list the last step's sequences in the same order
# (or a prefix of them). Ours resolves each sequence by id.

TREE_SHAPE_KW = dict(max_total_seq_len=4096, prefill_chunk_size=256, max_num_seqs=16)


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def order_for_commit(batch: List[Tuple[int, int]], chains: Dict[int, bool]) -> List[Tuple[int, int]]:
    """Reorder so that the last sequence's (accumulated) tree is not a chain when any is not
    (TVM's commit copies nothing when the last one is a chain: documented difference 1)."""
    non_chain = [item for item in batch if not chains[item[0]]]
    if not non_chain:
        return batch
    last = non_chain[-1]
    return [item for item in batch if item != last] + [last]


def prefill(d: Diff, lengths: Dict[int, int]) -> None:
    """Add the sequences and append ``lengths[seq]`` tokens each, in steps within the chunk size."""
    for s in lengths:
        d.add(s)
    todo = {s: n for s, n in lengths.items() if n}
    chunk = d.shape.prefill_chunk_size
    while todo:
        batch, budget = [], chunk
        for s, n in list(todo.items()):
            take = min(n, budget)
            if take <= 0:
                break
            batch.append((s, take))
            budget -= take
            todo[s] -= take
            if not todo[s]:
                del todo[s]
        d.step(batch)


def random_leaves(r: np.random.Generator, trees: Dict[int, List[int]], last_lengths: Dict[int, int],
                  stats: collections.Counter) -> Dict[int, int]:
    """An accepted leaf per sequence: -1, the deepest node, or any node < the last append length."""
    leaves = {}
    for s, parents in trees.items():
        limit = last_lengths[s]
        x = r.random()
        if x < 0.2:
            leaf = -1
        elif x < 0.4:
            depths = cm_tree_depths(parents)
            leaf = int(np.argmax(depths[:limit]))
        else:
            leaf = int(r.integers(0, limit))
        stats["leaf:-1" if leaf == -1 else ("leaf:0" if leaf == 0 else "leaf:node")] += 1
        leaves[s] = leaf
    return leaves


def decode_steps(d: Diff, r: np.random.Generator, seqs: Sequence[int], count: int) -> None:
    """Decode (or short prefill) steps over random subsets of committed sequences."""
    for _ in range(count):
        ids = [int(s) for s in r.choice(seqs, size=int(r.integers(1, len(seqs) + 1)), replace=False)]
        prefill_too = r.random() < 0.3
        d.step([(s, int(r.integers(2, 9)) if prefill_too and r.random() < 0.5 else 1) for s in ids])


@pytest.mark.parametrize("rope_mode", [0, 1], ids=["none", "normal"])
def test_token_tree_single_step_vs_tvm(rope_mode):
    """Random trees (chains, stars, binary, deep, wide, forests; 1..40 nodes) on several
    sequences per batch, prefixes from empty to 21 pages, mostly not page-aligned; random leaves
    committed (-1 included), then decode steps continue from the committed paths."""
    d = Diff(make_shape(rope_mode, False, **TREE_SHAPE_KW), seed=41 + rope_mode)
    r = np.random.default_rng(500 + rope_mode)
    prefill(d, {0: 0, 1: 5, 2: 37, 3: 150, 4: 97, 5: 333, 6: 16, 7: 64})
    seqs = sorted(d.model.seqs)
    stats: collections.Counter = collections.Counter()
    for round_ in range(7):
        ids = [int(s) for s in r.choice(seqs, size=int(r.integers(3, len(seqs) + 1)), replace=False)]
        trees, budget = {}, d.shape.prefill_chunk_size
        for j, s in enumerate(ids):
            shape = TREE_SHAPES[(round_ + j) % len(TREE_SHAPES)]
            if round_ == 3:  # one-node trees only: a decode-kernel step appended before attention
                size = 1
            else:
                size = int(r.integers(1, 41)) if r.random() < 0.7 else int(r.integers(1, 6))
            size = max(1, min(size, budget - (len(ids) - j - 1)))
            budget -= size
            trees[s] = random_tree(r, size, shape)
            stats[f"shape:{shape}" if size > 1 else "size1"] += 1
        batch = order_for_commit([(s, len(trees[s])) for s in ids], {s: is_chain(t) for s, t in trees.items()})
        d.step(batch, tree=trees)
        leaves = random_leaves(r, trees, {s: n for s, n in batch}, stats)
        d.commit([s for s, _ in batch], [leaves[s] for s, _ in batch])
        decode_steps(d, r, seqs, int(r.integers(1, 3)))
    assert all(stats[f"shape:{s}"] for s in TREE_SHAPES), dict(stats)
    assert stats["leaf:-1"] and stats["leaf:0"] and stats["leaf:node"] and stats["size1"], dict(stats)
    assert d.max_err["ours_tvmk"] == 0.0, dict(d.max_err)  # same kernels: bit-identical
    for s in seqs:
        d.remove(s)
    assert all(d.B.empty(c) for c in d.caches.values())
