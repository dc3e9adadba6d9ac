"""A CI-sized run of ``benchmarks/soak.py``: the random operation mix, checked against the model."""

from __future__ import annotations

import importlib.util
import io
import pathlib

SOAK = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_soak_2000_ops_has_no_mismatch():
    out = io.StringIO()
    summary = _soak_module().run(2000, seed=1, out=out)
    assert summary["mismatches"] == 0, out.getvalue()
    assert summary["errors"].get("CacheFullError", 0) > 0, "the mix should run out of pages"
    assert sum(summary["errors"].values()) > 200, summary["errors"]
    assert "summary: 2000 ops" in out.getvalue()
