"""Plots of a ``gpu_bench.py --sweep --json FILE`` run, for ``docs/benchmarks.md``.

Three PNGs, ours against TVM's native cache and the roofline measured in the same run:

* ``decode_bandwidth.png``: decode KV read rate (GB/s) at batch 32 against context length, with
  the device-to-device copy bandwidth;
* ``prefill_tflops.png``: causal prefill TFLOP/s of one sequence against its length, with the
  measured fp16 matrix rate when the run had one;
* ``step_latency.png``: a whole 8-layer decode step against batch size: ours, ours replaying a
  CUDA graph, native.

From ``e2e_bench.py --json FILE`` runs (``--e2e``; the contexts of one model from several runs are
merged): ``e2e_tokens_<model>.png``, decode tokens/s of the whole model against batch size, per
context: ours eager, ours with CUDA graphs, native.

Usage: ``python benchmarks/plot_bench.py RESULTS.json [--out docs/img]`` or
``python benchmarks/plot_bench.py --e2e E2E.json [E2E.json ...] [--out docs/img]`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import List, Optional

COLORS = {"ours": "tab:blue", "ours+graph": "tab:green", "native": "tab:red"}
LABELS = {"ours": "relax_kvcache", "ours+graph": "relax_kvcache, CUDA graph", "native": "TVM native"}


def _series(rows: List[dict], x_key: str, value) -> dict:
    """{cache name: (xs, ys)} over rows sorted by ``x_key``; ``value(row, seconds)``."""
    out: dict = {}
    for row in sorted(rows, key=lambda r: r[x_key]):
        for name, seconds in row["times"].items():
            xs, ys = out.setdefault(name, ([], []))
            xs.append(row[x_key])
            ys.append(value(row, seconds))
    return out


def _plot(path: pathlib.Path, series: dict, *, title: str, xlabel: str, ylabel: str,
          roof: Optional[float] = None, roof_label: str = "", logy: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, (xs, ys) in series.items():
        base, _, context = name.partition(", ")  # e2e series: "<side>, <context>"
        ax.plot(xs, ys, marker="o", color=COLORS.get(base), linestyle=":" if context == "4096" else "-",
                label=LABELS.get(base, base) + (f", context {context}" if context else ""))
    if roof:
        ax.axhline(roof, color="gray", linestyle="--", label=roof_label)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def e2e_series(result: dict) -> dict:
    """{label: (batches, tokens/s)} of one model of an ``e2e_bench.py`` run: per context, ours
    eager, ours with graphs and native (configurations without a time are left out)."""
    out: dict = {}
    for context, sides in result["decode"].items():
        for side, key, label in (("ours", "eager", "ours"), ("ours", "graph", "ours+graph"),
                                 ("native", "eager", "native")):
            for batch, row in sorted(sides[side]["rows"].items(), key=lambda kv: int(kv[0])):
                step = (row.get(key) or {}).get("step")
                if step:
                    xs, ys = out.setdefault(f"{label}, {context}", ([], []))
                    xs.append(int(batch))
                    ys.append(int(batch) / step)
    return out


def merged_e2e(runs: List[List[dict]]) -> List[dict]:
    """The models of several ``e2e_bench.py --json`` runs, one result per model with the decode
    contexts of all its runs."""
    models: dict = {}
    for results in runs:
        for result in results:
            models.setdefault(result["model"], {**result, "decode": {}})["decode"].update(result["decode"])
    return list(models.values())


def plot_e2e(results: List[dict], out: pathlib.Path) -> None:
    for result in results:
        series = e2e_series(result)
        cfg = result["config"]
        synced = ", steps synced" if result.get("sync_steps") else ""
        _plot(out / f"e2e_tokens_{result['model']}.png", series,
              title=f"Decode through the Relax VM, {result['model']} shape ({cfg['num_layers']} layers, "
                    f"hidden {cfg['hidden_size']}{synced})\n{result['device']}", xlabel="batch size",
              ylabel="tokens/s (higher is better)", logy=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=pathlib.Path, nargs="+", help="JSON written by gpu_bench.py --json "
                        "(one file) or by e2e_bench.py --json (--e2e)")
    parser.add_argument("--e2e", action="store_true", help="RESULTS are e2e_bench.py --json files")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/img"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.e2e:
        plot_e2e(merged_e2e([json.loads(path.read_text()) for path in args.results]), args.out)
        return
    if len(args.results) != 1:
        parser.error("one gpu_bench.py --json file (several only with --e2e)")
    data = json.loads(args.results[0].read_text())
    shape = data["shape"]
    where = f"{data['device']}\n{shape['dtype']}, {shape['num_qo_heads']}/{shape['num_kv_heads']} heads, " \
            f"head_dim {shape['head_dim']}, page {shape['page_size']}"

    decode = [r for r in data["decode"] if r["batch"] == 32]
    _plot(args.out / "decode_bandwidth.png",
          _series(decode, "context", lambda r, t: r["kv_bytes"] / t / 1e9),
          title=f"Decode, batch 32, one layer\n{where}", xlabel="context length (tokens)",
          ylabel="KV read (GB/s)", roof=data["copy_bandwidth"] / 1e9, roof_label="copy bandwidth (roofline)")

    prefill = [r for r in data["prefill"] if r["batch"] == 1]
    matmul = data.get("matmul_rate")
    _plot(args.out / "prefill_tflops.png",
          _series(prefill, "length", lambda r, t: r["flops"] / t / 1e12),
          title=f"Causal prefill, one sequence, one layer\n{where}", xlabel="sequence length (tokens)",
          ylabel="TFLOP/s", roof=matmul / 1e12 if matmul else None, roof_label="fp16 matmul rate (measured)",
          logy=True)

    steps = data["step"]
    layers = steps[0]["layers"] if steps else 0
    context = steps[0]["context"] if steps else 0
    _plot(args.out / "step_latency.png",
          _series(steps, "batch", lambda r, t: t * 1e6),
          title=f"Decode step, {layers} layers, context {context} (lower is better)\n{where}",
          xlabel="batch size", ylabel="step latency (us)", logy=True)


if __name__ == "__main__":
    main()
