"""The tables ``e2e_bench.py`` prints from one model's results (see its docstring)."""

from __future__ import annotations

from typing import Optional

SIDES = ("ours", "native")


def _num(value: Optional[float], scale: float = 1.0, width: int = 9, digits: int = 1) -> str:
    return f"{value * scale:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def _speed(ours: Optional[float], native: Optional[float]) -> str:
    """Speed of ours over native from two times (above 1: ours faster)."""
    return f"{native / ours:9.2f}" if ours and native else f"{'-':>9}"


def _graph_cell(row: dict) -> Optional[float]:
    graph = row.get("graph")
    return graph["step"] if graph and "step" in graph else None


def report(result: dict, log=print) -> None:
    cfg = result["config"]
    log("")
    log(f"== {result['model']}: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_heads']}/"
        f"{cfg['num_kv_heads']} heads, head_dim {cfg['head_dim']}, MLP {cfg['intermediate_size']}, vocab "
        f"{cfg['vocab_size']}, {cfg['dtype']}; {result['device']}")
    check = result["check"]
    parts = [f"{name} {check[name]['err']:.2e} ({check[name]['err'] / check['scale']:.1e} of max |native| "
             f"{check['scale']:.2f}) {'ok' if check[name]['ok'] else 'FAIL'}" for name in ("ours", "graph")
             if "err" in check.get(name, {})]
    log("logits vs native (1 prefill + decode steps), max abs error: " + "; ".join(parts)
        + (f"; graph steps {check['graph_runs']}" if "graph_runs" in check else "")
        + f"; tolerance {check['tolerance']:.0e} of max |native|: {'PASS' if check['ok'] else 'FAIL'}")
    if result["ttft"]["ours"]:
        log("")
        log("TTFT (ms, prefill of the whole prompt to the first token's logits; speed = native / ours, above 1: "
            "ours faster)")
        log(f"{'prompt':>12} {'ours':>9} {'native':>9} {'speed':>9}")
        for n, ours in result["ttft"]["ours"].items():
            native = result["ttft"]["native"].get(n)
            log(f"{'1 x ' + str(n):>12} {_num(ours, 1e3)} {_num(native, 1e3)} {_speed(ours, native)}")
    for line in result["skipped"]:
        log(f"skipped {line}")
    if not result["decode"]:
        return
    graph_na = "" if result["graphs"] else f" (graph: n/a, {result.get('graph_error', 'needs CUDA')})"
    log("")
    queued = "one at a time after a sync" if result.get("sync_steps") else "queued back to back"
    log(f"Decode (tokens/s, steps {queued}; speed = ours / native tokens/s)" + graph_na)
    log(f"{'batch x ctx':>12} {'ours':>9} {'graph':>9} {'native':>9} {'ours/nat':>9} {'graph/nat':>9}")
    for context, sides in result["decode"].items():
        for batch, row in sides["ours"]["rows"].items():
            native = sides["native"]["rows"].get(batch, {}).get("eager", {}).get("step")
            ours, graph = row["eager"].get("step"), _graph_cell(row)
            rate = lambda s: batch / s if s else None  # noqa: E731
            log(f"{f'{batch} x {context}':>12} {_num(rate(ours), 1, 9, 0)} "
                f"{_num(rate(graph), 1, 9, 0) if graph else format('n/a', '>9')} {_num(rate(native), 1, 9, 0)} "
                f"{_speed(ours, native)} {_speed(graph, native)}")
    log("")
    log(f"Where a decode step's time goes (ms): step = {queued}; host = begin_forward + VM call issue + "
        "end_forward, issued after a sync and not waited for (GPU work excluded"
        + ("; on the CPU the call computes: host = step)" if result["device"].startswith("CPU") else ")"))
    log(f"{'batch x ctx':>12} {'side':>7} {'step':>8} {'host':>8} {'begin':>8} {'call':>8} {'end':>8}")
    for context, sides in result["decode"].items():
        for batch in sides["ours"]["rows"]:
            cells = [("ours", sides["ours"]["rows"][batch]["eager"]),
                     ("graph", sides["ours"]["rows"][batch].get("graph")),
                     ("native", sides["native"]["rows"].get(batch, {}).get("eager"))]
            for side, m in cells:
                if m is None:
                    continue
                if "error" in m:
                    log(f"{f'{batch} x {context}':>12} {side:>7}  n/a: {m['error']}")
                    continue
                log(f"{f'{batch} x {context}':>12} {side:>7} " + " ".join(
                    _num(m[k], 1e3, 8, 3) for k in ("step", "host", "begin", "call", "end"))
                    + (f"  ({m['note']})" if "note" in m else ""))
        log(f"{'fill':>12} " + ", ".join(f"{side} {sides[side]['fill']:.1f} s" for side in SIDES)
            + f" ({'attention calls on random q/k/v' if result.get('fill') == 'attention' else 'prefill'} of the "
            f"contexts {context} tokens each, chunks of up to {result.get('chunk', '?')} tokens)")
