"""Soak run: a long random mix of cache operations, valid and invalid, checked against a model.

    python benchmarks/soak.py --ops 100000 [--seed N]

Drives small caches (one without and one with per-sequence sliding windows) with the operation mix
of ``state_machine_model.py`` from a numpy RNG: adds, removes, forks at any position, pops,
forward steps (attention on every layer), repeated decode steps, windows, token-tree steps and
commits of accepted nodes (speculative decoding), and requests that must
fail (unknown or duplicate ids, bad positions and lengths, batches and forks that run out of pages).
Every operation is checked against the model and the paging invariants; an error must leave the
cache exactly unchanged. Prints progress (ops, ops/s, errors by type, free pages, RSS) and a
summary; exits non-zero on any mismatch or when RSS grows by more than ``--leak-mb`` between 10 %
of the run (after warm-up) and its end.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
for path in (ROOT / "python", ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import numpy as np  # noqa: E402

import state_machine_model as sm  # noqa: E402

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """Resident set size of this process in MB (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES / 2**20


def _errors(harnesses) -> collections.Counter:
    total = collections.Counter()
    for h in harnesses:
        total.update(h.errors)
    return total


def _outcomes(harnesses) -> str:
    total = collections.Counter()
    for h in harnesses:
        total.update(h.outcomes)
    ops = sorted({op for op, _ in total})
    return "\n".join(f"[soak]     {op:<30} " + ", ".join(f"{r}={n}" for (o, r), n in sorted(total.items()) if o == op)
                     for op in ops)


def _fmt(counter) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counter.items())) or "none"


def run(ops: int, seed: int = 0, report_every: int = 0, leak_mb: float = 20.0, kinds=sm.KINDS,
        out=sys.stdout) -> dict:
    """Run the soak; return its summary (``mismatches``, ``errors``, ``rss_growth_mb``, ...)."""
    report_every = report_every or max(ops // 20, 1)
    rng = np.random.default_rng(seed)
    draw = sm.NumpyDraw(rng)
    harnesses = [sm.Harness(kind, seed + i) for i, kind in enumerate(kinds)]
    mismatches, examples = 0, []
    drains = 0
    rss_start = rss_at_10 = rss_mb()
    t0 = time.perf_counter()
    for i in range(1, ops + 1):
        h = harnesses[i % len(harnesses)]
        try:
            if rng.random() < 0.002:  # now and then: remove everything, the cache must be empty
                h.remove_all([int(s) for s in rng.permutation(sorted(h.model.seqs))])
                drains += 1
            else:
                sm.random_op(h, draw)
        except Exception as err:  # noqa: BLE001 - every failure is a mismatch, reported below
            mismatches += 1
            if len(examples) < 5:
                examples.append(f"op {i} ({h.kind}): {type(err).__name__}: {err}\n{traceback.format_exc()}")
            harnesses[harnesses.index(h)] = sm.Harness(h.kind, seed + i)  # start over from a clean cache
        if i == max(ops // 10, 1):
            rss_at_10 = rss_mb()
        if i % report_every == 0 or i == ops:
            elapsed = time.perf_counter() - t0
            free = "/".join(str(x.free_pages()) for x in harnesses)
            print(f"[soak] {i:>7} ops  {i / elapsed:7.0f} ops/s  mismatches={mismatches}  free pages={free}  "
                  f"RSS={rss_mb():.1f} MB  errors: {_fmt(_errors(harnesses))}", file=out, flush=True)
    elapsed = time.perf_counter() - t0
    rss_end = rss_mb()
    summary = dict(ops=ops, seconds=elapsed, ops_per_s=ops / elapsed, mismatches=mismatches,
                   errors=dict(_errors(harnesses)), drains=drains, rss_start_mb=rss_start,
                   rss_at_10pct_mb=rss_at_10, rss_end_mb=rss_end, rss_growth_mb=rss_end - rss_at_10,
                   leak=rss_end - rss_at_10 > leak_mb, examples=examples,
                   free_pages={h.kind: h.free_pages() for h in harnesses},
                   total_pages={h.kind: h.cache.config.num_total_pages for h in harnesses})
    for text in examples:
        print(f"[soak] MISMATCH {text}", file=out)
    print(f"[soak] summary: {ops} ops in {elapsed:.1f} s ({summary['ops_per_s']:.0f} ops/s), seed {seed}\n"
          f"[soak]   mismatches: {mismatches}\n"
          f"[soak]   errors raised (as expected, state unchanged): {_fmt(summary['errors'])} "
          f"(total {sum(summary['errors'].values())})\n"
          f"[soak]   outcomes by operation (harnesses alive at the end):\n{_outcomes(harnesses)}\n"
          f"[soak]   operations the model allowed to succeed or fail: {sum(h.undecided for h in harnesses)}\n"
          f"[soak]   full drains (remove all, empty() checked): {drains}\n"
          f"[soak]   free pages at end: " + ", ".join(f"{k} {v}/{summary['total_pages'][k]}"
                                                     for k, v in summary["free_pages"].items()) + "\n"
          f"[soak]   RSS: start {rss_start:.1f} MB, at 10% {rss_at_10:.1f} MB, end {rss_end:.1f} MB, "
          f"growth after warm-up {summary['rss_growth_mb']:+.1f} MB (limit {leak_mb} MB)"
          + ("  LEAK" if summary["leak"] else ""), file=out, flush=True)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000, help="operations to run (default 100000)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    parser.add_argument("--report-every", type=int, default=0, help="progress line every N ops (default ops/20)")
    parser.add_argument("--leak-mb", type=float, default=20.0, help="allowed RSS growth after 10%% of the run")
    parser.add_argument("--kinds", default=",".join(sm.KINDS), help="caches to drive: plain,sliding,chunked")
    args = parser.parse_args(argv)
    summary = run(args.ops, args.seed, args.report_every, args.leak_mb, tuple(args.kinds.split(",")))
    return 1 if summary["mismatches"] or summary["leak"] else 0


if __name__ == "__main__":
    sys.exit(main())
