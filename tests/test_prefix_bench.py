"""``benchmarks/prefix_bench.py --smoke``: both workloads with and without prefix caching on
llvm at tiny sizes: the same tokens either way, and the prefill tokens computed drop by exactly
the tokens found cached; the chat beyond device memory finds, with the host tier, what a cache
holding everything finds."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import prefix_bench  # noqa: E402


def test_smoke_serves_both_workloads_the_same_with_and_without_caching(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert prefix_bench.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    sizes = prefix_bench.SMOKE_SIZES
    assert result["ok"] and set(result["workloads"]) == {"shared_system_prompt", "multi_turn_chat"}
    for name, entry in result["workloads"].items():
        off, on = entry["without"], entry["with"]
        assert entry["identical"] and off["requests"] == on["requests"]
        assert off["hit_tokens"] == 0 and off["shared_fraction_computed"] == 1.0
        assert on["hit_tokens"] > 0
        assert on["prefill_tokens_computed"] + on["hit_tokens"] == off["prefill_tokens_computed"]
        assert min(on["ttft_mean_ms"], on["ttft_p50_ms"], on["output_tokens_per_s"]) > 0
    shared = result["workloads"]["shared_system_prompt"]
    assert shared["with"]["requests"] == sizes.requests
    # every request after the first finds the system prompt's whole pages (50 tokens: 3 pages)
    assert shared["with"]["hit_tokens"] == (sizes.requests - 1) * 48
    assert result["workloads"]["multi_turn_chat"]["with"]["requests"] == sizes.conversations * sizes.turns
    host = result["host_tier"]  # more conversations than the device holds: the host tier finds what a
    assert host["identical"] and host["with"]["hit_tokens"] > host["without"]["hit_tokens"]  # big cache does
    assert host["with"]["hit_tokens"] == host["all_on_device"]["hit_tokens"]
    assert host["host_stats"]["loaded_pages"] > 0 and host["host_stats"]["spilled_pages"] > 0
    assert "PASS" in capsys.readouterr().out


def test_soak_smoke_with_prefix_caching_returns_every_page(tmp_path):
    """``--soak``: random traffic (forks, rollbacks, cancellations, a cache near full) on cached
    prefixes: every page back, prefixes found, pages evicted on the way."""
    out = tmp_path / "soak.json"
    assert prefix_bench.main(["--soak", "0.1", "--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pages_back"] and result["served"] > 0
    assert result["prefix_cache"]["hit_tokens"] > 0 and result["prefix_cache"]["evicted_pages"] > 0
