"""``e2e_bench.py --kv-dtype``: the same model on our cache over 8-bit pages (``ours-fp8``) beside
our cache over float16 pages (``ours``), both driven as ``e2e_bench`` drives ``ours``.

* **logits**: prompts of :data:`PROMPTS` tokens, each prefilled in one step and followed by
  ``STEPS - 1`` decode steps fed the float16 cache's greedy tokens (teacher forcing): per row,
  max |fp8 - fp16| over max |fp16|; the max and mean of that over the rows, and the fraction of
  rows whose argmax agrees. The 8-bit cache's scales are calibrated from the prefill
  (``calibrate_kv_scales``). Gate: every row finite, max relative error within :func:`tolerance`.
* **decode**: ``e2e_bench.decode_phase`` over 8-bit pages for every context and batch measured
  for ``ours``; tokens/s side by side with float16 pages and their ratio.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

PROMPTS = (100, 333, 1000, 37)  # those within the plan's prefill chunk
STEPS = 32  # rows per prompt: the prefill's last, then decode steps


def tolerance(kv_dtype: str, fp16_tolerance: float) -> float:
    """Max relative logit error of 8-bit pages against float16 pages: the 8-bit bound against
    float64 logits (``model_demo.FP8_TOLERANCE``) plus the float16 model's own error."""
    from relax_kvcache.model_demo import FP8_TOLERANCE

    return FP8_TOLERANCE[kv_dtype] + fp16_tolerance


def greedy_rows(bench, runner, device, plan, prompt: np.ndarray, feed: Sequence[int] = ()) -> np.ndarray:
    """Logit rows ``(STEPS, vocab)`` of one sequence: the prefill's last row, then decode steps fed
    ``feed`` (else each row's argmax)."""
    cache = runner.create(1, bench.round_up(len(prompt) + STEPS + bench.PAGE), plan.chunk)
    runner.add(cache, 0)
    rows = [runner.forward(cache, runner.prefill_fn, device.tokens(prompt[None]), [0], [len(prompt)]).numpy()]
    for step in range(STEPS - 1):
        token = feed[step] if len(feed) else int(rows[-1].argmax())
        rows.append(runner.forward(cache, runner.decode_fn, device.tokens(np.array([[token]])), [0], [1]).numpy())
    device.sync()
    return np.stack([r.reshape(-1) for r in rows]).astype(np.float64)


def check(bench, runners: Dict[str, object], device, cfg, plan, kv_dtype: str, prompts=PROMPTS) -> dict:
    """8-bit pages against float16 pages on the same prompts and tokens (see the module docstring)."""
    rng = np.random.default_rng(bench.SEED + 4)
    rel: List[np.ndarray] = []
    agree: List[np.ndarray] = []
    finite = True
    for length in prompts:
        prompt = rng.integers(0, cfg.vocab_size, length)
        want = greedy_rows(bench, runners["ours"], device, plan, prompt)
        tokens = want.argmax(axis=1)
        got = greedy_rows(bench, runners["ours-fp8"], device, plan, prompt, tokens[:-1])
        finite = finite and bool(np.isfinite(got).all() and np.isfinite(want).all())
        rel.append(np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1))
        agree.append(got.argmax(axis=1) == tokens)
    rel_all = np.concatenate(rel)
    limit = tolerance(kv_dtype, bench.TOLERANCE)
    max_rel = float(rel_all.max()) if finite else float("inf")
    return {"kv_dtype": kv_dtype, "prompts": list(prompts), "rows": int(rel_all.size), "max_rel": max_rel,
            "mean_rel": float(rel_all.mean()) if finite else float("inf"),
            "agreement": float(np.concatenate(agree).mean()), "tolerance": limit, "ok": max_rel <= limit}


def run(bench, result: dict, runner16, runner8, device, cfg, plan, graphs: bool, kv_dtype: str, log) -> dict:
    """The logits check and, for every (context, batch) ``result["decode"]`` holds for ``ours``,
    the same decode configuration over 8-bit pages."""
    log(f"{result['model']}: {kv_dtype} pages: logits against float16 pages ...")
    prompts = [n for n in PROMPTS if n <= plan.chunk]  # each prefilled in one step
    out = {"check": check(bench, {"ours": runner16, "ours-fp8": runner8}, device, cfg, plan, kv_dtype, prompts),
           "decode": {}}
    for context, sides in result["decode"].items():
        batches = list(sides["ours"]["rows"])
        log(f"{result['model']}: {kv_dtype} pages: decode at context {context}, batches {batches} ...")
        out["decode"][context] = bench.decode_phase(runner8, device, cfg, plan, context, batches, graphs, log)
    return out


def report(result: dict, log=print) -> None:
    """The logits line and the decode table of ``result["fp8"]`` beside ``result["decode"]``'s ``ours``."""
    fp8 = result["fp8"]
    c = fp8["check"]
    log("")
    log(f"{c['kv_dtype']} pages vs float16 pages ({len(c['prompts'])} prompts of {c['prompts']} tokens, "
        f"{c['rows']} rows: prefill + decode fed the float16 greedy tokens): relative logit error max "
        f"{c['max_rel']:.2e}, mean {c['mean_rel']:.2e}; greedy agreement {c['agreement']:.1%}; tolerance "
        f"{c['tolerance']:.2f}: {'PASS' if c['ok'] else 'FAIL'}")
    if not fp8["decode"]:
        return
    log("")
    log(f"Decode over {c['kv_dtype']} pages (tokens/s; ratio = fp8 / fp16 tokens/s, above 1: 8-bit pages faster)")
    log(f"{'batch x ctx':>12} {'fp16':>9} {'fp8':>9} {'ratio':>7} {'fp16+g':>9} {'fp8+g':>9} {'ratio':>7}")
    for context, sides in fp8["decode"].items():
        for batch, row in sides["rows"].items():
            base = result["decode"][context]["ours"]["rows"][batch]
            cells = []
            for kind in ("eager", "graph"):
                a, b = base.get(kind, {}).get("step"), row.get(kind, {}).get("step")
                cells.append((batch / a if a else None, batch / b if b else None))
            log(f"{f'{batch} x {context}':>12} " + " ".join(
                f"{_cell(a)} {_cell(b)} {(f'{b / a:7.2f}' if a and b else format('-', '>7'))}" for a, b in cells))
    log(f"{'fill':>12} fp8 {sum(s['fill'] for s in fp8['decode'].values()):.1f} s")


def _cell(rate) -> str:
    return f"{rate:9.0f}" if rate else f"{'-':>9}"
