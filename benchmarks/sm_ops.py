"""The state machine's operation mix (``state_machine_model``): random choices (`Draw`, `NumpyDraw`; the
property test adapts hypothesis), one ``op_*`` per kind of operation, valid and invalid, and
`random_op`, which draws one by weight (the soak).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import numpy as np

from sm_cache import CHUNK, PAGE_SIZE, STEMS
from sm_harness import Harness


class Draw:
    """Random choices for the operation mix; `NumpyDraw` and the property test's hypothesis adapter."""

    def integer(self, lo: int, hi: int) -> int:  # inclusive
        raise NotImplementedError

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def chance(self, p: float) -> bool:
        return self.integer(0, 999) < p * 1000


class NumpyDraw(Draw):
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


ID_RANGE = 8  # sequence ids 0..7: existing and unknown ids are both drawn often
UNKNOWN_IDS = (-7, 99, 2 ** 40)


def draw_id(draw: Draw, h: Harness, existing: float = 0.7) -> int:
    live = sorted(h.model.seqs)
    if live and draw.chance(existing):
        return draw.choice(live)
    return draw.integer(0, ID_RANGE - 1) if draw.chance(0.9) else draw.choice(UNKNOWN_IDS)


def draw_new_id(draw: Draw, h: Harness) -> int:
    free = [i for i in range(ID_RANGE) if i not in h.model.seqs]
    return draw.choice(free) if free and draw.chance(0.85) else draw_id(draw, h)


def draw_position(draw: Draw, length: int) -> int:
    """-1, 0, mid-page, a page boundary, the full length, anything, or out of range."""
    boundary = (draw.integer(0, length) // PAGE_SIZE) * PAGE_SIZE
    mid = min(length, boundary + draw.integer(1, PAGE_SIZE - 1))
    return draw.choice([-1, 0, mid, boundary, length, draw.integer(0, length), -2, length + 1])


def draw_length(draw: Draw, length: int) -> int:
    """An append length: decode, to the page boundary, a page or two, or long."""
    to_boundary = PAGE_SIZE - length % PAGE_SIZE
    return draw.choice([1, 1, 2, to_boundary, to_boundary + PAGE_SIZE, draw.integer(1, 12), draw.integer(1, CHUNK)])


def op_add(h: Harness, draw: Draw) -> None:
    ids = None
    if h.kind == "prefix" and draw.chance(0.8):  # a prompt: part of a stem, then a few other ids
        stem = draw.choice(STEMS)
        ids = list(stem[:draw.integer(1, len(stem))]) + [draw.integer(0, 15) for _ in range(draw.integer(0, 3))]
    h.add(draw_new_id(draw, h), ids)


def op_remove(h: Harness, draw: Draw) -> None:
    h.remove(draw_id(draw, h, existing=0.9))


def op_fork(h: Harness, draw: Draw) -> None:
    parent = draw_id(draw, h, existing=0.9)
    length = h.model.seqs[parent].length if parent in h.model.seqs else 5
    h.fork(parent, draw_new_id(draw, h), draw_position(draw, length))


def op_checkpoint(h: Harness, draw: Draw) -> None:
    if h.cache.config.kv_dtype is not None:  # refused (NotImplementedError; tests/test_fp8_cache.py)
        return
    h.checkpoint(draw_id(draw, h, existing=0.9), draw_new_id(draw, h))


def op_popn(h: Harness, draw: Draw) -> None:
    seq_id = draw_id(draw, h, existing=0.9)
    length = h.model.seqs[seq_id].length if seq_id in h.model.seqs else 3
    to_boundary = length % PAGE_SIZE or PAGE_SIZE
    h.popn(seq_id, draw.choice([0, 1, length, to_boundary, draw.integer(0, length), length + 1, -1]))


def op_step(h: Harness, draw: Draw) -> None:
    live = sorted(h.model.seqs)
    if not live:
        h.step([draw_id(draw, h)], [1])
        return
    size = draw.integer(1, len(live))
    start = draw.integer(0, len(live) - 1)
    batch = [live[(start + i) % len(live)] for i in range(size)]
    if draw.chance(0.5):
        batch.reverse()
    lengths = [draw_length(draw, h.model.seqs[s].length) for s in batch]
    h.step(batch, lengths, interrupt=draw.choice(["remove", "fork", "popn", "begin"]) if draw.chance(0.05) else None)


def draw_tree(draw: Draw, old: int, n: int) -> List[int]:
    """Parents of ``n`` new nodes after ``old`` earlier ones: chains, stars, random trees, forests."""
    shape = draw.choice(["chain", "star", "random", "random", "forest"])
    out = []
    for i in range(old, old + n):
        if i == 0:
            out.append(-1)
        elif shape == "chain":
            out.append(i - 1)
        elif shape == "star":
            out.append(max(old - 1, 0) if i > old or old else -1)
        elif shape == "forest" and draw.chance(0.3):
            out.append(-1)
        else:
            out.append(draw.integer(max(old - 1, 0), i - 1))
    return out


def op_tree_step(h: Harness, draw: Draw) -> None:
    """A forward step with token trees (speculative decoding), valid or not; on the sliding cache
    trees are rejected (``ForwardError``), so it is drawn there rarely."""
    live = sorted(h.model.seqs)
    if not live or ((h.sliding or h.chunk) and not draw.chance(0.1)):
        return
    size = draw.integer(1, min(len(live), 3))
    start = draw.integer(0, len(live) - 1)
    batch = [live[(start + i) % len(live)] for i in range(size)]
    lengths = [draw.choice([1, 2, 3, draw.integer(1, 8)]) for _ in batch]
    parents: List[Any] = []
    for seq_id, n in zip(batch, lengths):
        tree = h.model.seqs[seq_id].tree
        parents += draw_tree(draw, len(tree) if tree is not None else 0, n)
    if draw.chance(0.1):  # invalid: a node its own parent, a parent below -1, too few entries, unknown id
        i = draw.integer(0, len(parents) - 1)
        bad = draw.choice(["self", "low", "short", "unknown", "dup"])
        if bad == "self":
            parents[i] = i + 50
        elif bad == "low":
            parents[i] = -2
        elif bad == "short":
            parents.pop()
        elif bad == "unknown":
            batch[0] = draw.choice(UNKNOWN_IDS)
        else:
            batch, lengths, parents = batch + batch[:1], lengths + [1], parents + [-1]
    h.step(batch, lengths, parents=parents)


def op_commit(h: Harness, draw: Draw) -> None:
    """commit_accepted_token_tree_nodes: mostly the sequences with uncommitted trees, a leaf among
    the last step's nodes (or -1: accept nothing); sometimes invalid."""
    seqs = h.model.seqs
    pending = sorted(s for s, m in seqs.items() if m.tree is not None)
    if pending and draw.chance(0.85):
        ids = [s for s in pending if draw.chance(0.7)] or pending[:1]
    else:
        ids = [draw_id(draw, h)]  # often a committed sequence: leaf -1 pops its last step (popn rules)
    leaves: List[Any] = []
    for seq_id in ids:
        m = seqs.get(seq_id)
        last = m.last_append if m is not None and m.tree is not None else 0
        leaves.append(draw.integer(-1, last - 1) if last and draw.chance(0.85) else -1)
    if draw.chance(0.15):
        bad = draw.choice(["unknown", "range", "neg", "dup", "lengths", "float", "committed"])
        i = draw.integer(0, len(ids) - 1)
        if bad == "unknown":
            ids[i] = draw.choice(UNKNOWN_IDS)
        elif bad == "range":
            m = seqs.get(ids[i])
            leaves[i] = len(m.tree) if m is not None and m.tree is not None else draw.integer(0, 3)
        elif bad == "neg":
            leaves[i] = draw.choice([-2, -5])
        elif bad == "dup":
            ids, leaves = ids + [ids[i]], leaves + [-1]
        elif bad == "lengths":
            leaves = leaves + [0] if draw.chance(0.5) else leaves[:-1]
        elif bad == "float":
            leaves[i] = 0.0
        else:  # a committed sequence with a leaf: "already committed"
            done = [s for s in seqs if seqs[s].tree is None]
            if done:
                ids[i], leaves[i] = draw.choice(done), 0
                if len(set(ids)) != len(ids):
                    return
    h.commit(ids, leaves)


def op_repeat_decode(h: Harness, draw: Draw) -> None:
    h.repeat_decode()


def op_enable_window(h: Harness, draw: Draw) -> None:
    window = draw.integer(1, 24)
    sink = draw.choice([0, 0, 1, draw.integer(0, window - 1), PAGE_SIZE, window])  # window: invalid
    h.enable_window(draw_id(draw, h, existing=0.9), window, sink)


def op_invalid(h: Harness, draw: Draw) -> None:
    """Requests that are wrong whatever the state (they must raise and change nothing)."""
    live = sorted(h.model.seqs) or [0]
    a = draw.choice(live)
    cases = [
        lambda: h.step([], []),
        lambda: h.step([a], [1, 1]),
        lambda: h.step([a, a], [1, 1]),
        lambda: h.step([a], [0]),
        lambda: h.step([a], [-2]),
        lambda: h.step([a], [CHUNK + 1]),
        lambda: h.step(live + [draw.choice(UNKNOWN_IDS)], [1] * (len(live) + 1)),
        lambda: h.step([a], [1.5]),
        lambda: h.add(2.5),
        lambda: h.add(True),
        lambda: h.remove(draw.choice(UNKNOWN_IDS)),
        lambda: h.fork(draw.choice(UNKNOWN_IDS), ID_RANGE + 1, -1),
        lambda: h.fork(a, a, 0),
        lambda: h.fork(a, ID_RANGE + 1, 1.0),
        lambda: h.popn(a, 0.5),
        lambda: h.popn(draw.choice(UNKNOWN_IDS), 1),
        lambda: h.enable_window(a, 0, 0),
        lambda: h.enable_window(a, 4, -1),
        lambda: h.enable_window(draw.choice(UNKNOWN_IDS), 8, 2),
    ]
    draw.choice(cases)()


#: The soak's operation mix: (operation, weight).
OPERATIONS: Tuple[Tuple[Callable[[Harness, Draw], None], int], ...] = (
    (op_add, 10), (op_remove, 10), (op_fork, 12), (op_popn, 10), (op_step, 16), (op_repeat_decode, 6),
    (op_enable_window, 5), (op_invalid, 6), (op_tree_step, 8), (op_commit, 8), (op_checkpoint, 5),
)


def random_op(h: Harness, draw: Draw) -> None:
    """One operation of the mix, drawn by weight."""
    total = sum(w for _, w in OPERATIONS)
    r = draw.integer(0, total - 1)
    for op, weight in OPERATIONS:
        if r < weight:
            op(h, draw)
            return
        r -= weight
