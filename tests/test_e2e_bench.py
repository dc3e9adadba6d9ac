"""``benchmarks/e2e_bench.py --cpu-smoke``: the end-to-end benchmark's whole path (both builds
compiled, logits check, TTFT, context fill, decode timing and host split, report) on llvm with a
tiny model; and the logits comparison it gates its exit status on."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
import tvm_ffi

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import e2e_bench  # noqa: E402
from relax_kvcache.ffi_registry.builtins import BUILTINS, ORIGINAL_PREFIX  # noqa: E402


def test_cpu_smoke_runs_every_phase_and_ours_agrees_with_native(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert e2e_bench.main(["--cpu-smoke", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    plan = e2e_bench.SMOKE_PLAN
    check = result["check"]
    assert check["ok"] and check["scale"] > 0.5  # logits of unit scale, not a model that outputs ~0
    assert check["ours"]["err"] <= e2e_bench.TOLERANCE * check["scale"]
    for side in e2e_bench.SIDES:
        ttft = result["ttft"][side]
        assert sorted(map(int, ttft)) == sorted(plan.ttft) and all(t > 0 for t in ttft.values())
    assert sorted(map(int, result["decode"])) == sorted(plan.contexts) and not result["skipped"]
    for context, sides in result["decode"].items():
        for side in e2e_bench.SIDES:
            assert sides[side]["fill"] > 0
            rows = sides[side]["rows"]
            assert sorted(map(int, rows)) == sorted(plan.batches)
            for row in rows.values():
                m = row["eager"]
                assert m["step"] > 0 and m["host"] > 0 and min(m["begin"], m["call"], m["end"]) >= 0
                assert "graph" not in row  # CUDA only
    report = capsys.readouterr().out
    assert "PASS" in report and "graph: n/a" in report and "ours/nat" in report


def test_native_vm_is_bound_to_tvms_functions_and_our_dispatchers_come_back(monkeypatch):
    """A VM binds the builtins when made: ``make_vm('native')`` makes it while TVM's own functions
    are registered, then puts our dispatchers back (ours' VM, made the plain way, keeps them)."""
    names = [n for n in BUILTINS if tvm_ffi.get_global_func(ORIGINAL_PREFIX + n, allow_missing=True) is not None]
    assert "vm.builtin.attention_kv_cache_attention_with_fused_qkv" in names

    def tvms(name):
        return tvm_ffi.get_global_func(name).same_as(tvm_ffi.get_global_func(ORIGINAL_PREFIX + name))

    seen = {}

    class FakeVM:
        def __init__(self, executable, device):
            seen[executable] = {name: tvms(name) for name in names}

    monkeypatch.setattr(e2e_bench, "VirtualMachine", FakeVM)
    device = e2e_bench.Device(cuda=False)
    e2e_bench.make_vm("native", "native-exe", device)
    e2e_bench.make_vm("ours", "ours-exe", device)
    assert all(seen["native-exe"].values())
    assert not any(seen["ours-exe"].values())
    assert not any(tvms(name) for name in names)


def _runs(native, **others):
    runs = {"native": {"rows": native, "runs": {}}}
    for name, rows in others.items():
        runs[name] = {"rows": rows, "runs": {"eager": 3, "captured": 1, "replayed": 3} if name == "graph" else {}}
    return runs


def test_compare_flags_differences_beyond_tolerance_nans_and_graphs_that_never_replayed():
    rng = np.random.default_rng(3)
    native = [rng.standard_normal(50) * 3 for _ in range(4)]
    scale = max(np.abs(r).max() for r in native)
    close = [r + 0.5 * e2e_bench.TOLERANCE * scale for r in native]
    far = [r.copy() for r in native]
    far[2][7] += 2 * e2e_bench.TOLERANCE * scale  # one logit of one decode step
    nan = [r.copy() for r in native]
    nan[0][0] = np.nan

    good = e2e_bench.compare(_runs(native, ours=close, graph=close))
    assert good["ok"] and good["ours"]["ok"] and good["graph"]["ok"]
    assert abs(good["ours"]["err"] - 0.5 * e2e_bench.TOLERANCE * scale) < 1e-9
    bad = e2e_bench.compare(_runs(native, ours=far))
    assert not bad["ok"] and not bad["ours"]["ok"]
    assert not e2e_bench.compare(_runs(native, ours=nan))["ok"]
    assert not e2e_bench.compare(_runs(nan, ours=native))["ok"]  # a NaN in the baseline proves nothing
    no_replay = _runs(native, ours=close, graph=close)
    no_replay["graph"]["runs"] = {"eager": 7}
    assert not e2e_bench.compare(no_replay)["ok"]


def test_cuda_pipeline_reads_weights_in_place_and_dispatches_decode_matmuls_on_rows():
    """The CUDA pipeline of ``frontend.compile`` on the smoke model's build for sm_90a (no GPU needed):
    no weight transposes left (``x @ W.T`` is one matmul reading ``W``), every matmul with a dynamic
    row count chooses at run time between the GEMV kernels of each row bucket and the tiled matmul,
    the tiled matmul runs on tensor cores where its shape allows, and the module generates CUDA."""
    import re

    import tvm

    import e2e_models
    from relax_kvcache import frontend, tensor_core_matmul
    from relax_kvcache.build import _pass_config
    from relax_kvcache.targets import make_target

    target = make_target("cuda", arch="sm_90a")
    mod = e2e_models.build_module("ours", e2e_bench.SMOKE_MODEL, target)
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        lowered = frontend._cuda_relax_pipeline(target)(mod)
    model = {gv.name_hint: f for gv, f in lowered.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and not gv.name_hint.startswith("relax_kvcache")}
    assert not [name for name in model if "transpose" in name]
    def dynamic(f):
        return any(isinstance(d, tvm.tirx.Var) for p in f.params if isinstance(p.ty, tvm.tirx.BufferType)
                   for d in p.shape)

    matmuls = {name: f for name, f in model.items() if "matmul" in name}
    rows = sorted(name for name, f in matmuls.items() if dynamic(f))
    # decode: 4 per layer + vocab; prefill: 4 per layer; prefill_rows (the soak's): its vocab projection
    assert len(rows) == 10, sorted(matmuls)
    for name in rows:
        limits = re.findall(r"tvm_thread_invariant\([bnk] <= T\.int64\((\d+)\)\)", matmuls[name].script())
        assert tuple(map(int, limits)) in (frontend.LOW_BATCH_BUCKETS,
                                           frontend.LOW_BATCH_BUCKETS[:1] + tensor_core_matmul.SMALL_ROWS), (name, limits)
    [source] = e2e_models.cuda_sources(frontend.compile(mod, target).mod)
    kernels = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', source)
    assert not [k for k in kernels if "transpose" in k and not k.startswith("relax_kvcache_")]
    assert {"NT_matmul_kernel", "fused_NT_matmul1_add_kernel"} <= set(kernels), kernels
    bodies = dict(zip(kernels, re.split(r'extern "C" __global__', source)[1:]))
    tensor_core = sorted(k for k, body in bodies.items() if "NT_matmul" in k and "mma.sync" in body)
    # qkv (N 128, K 64), gate_up (256, 64) and the vocabulary (256, 64) take the 128 x 128 tile;
    # o_proj and down (N 64) do not
    assert len(tensor_core) >= 3, tensor_core


@pytest.mark.parametrize("pages", [[], ["--kv-dtype", "float8_e4m3fn"]], ids=["model-dtype", "8-bit"])
def test_cpu_smoke_soak_serves_requests_and_gives_every_page_back(tmp_path, pages):
    """``--soak``: generate.Engine under random arrivals, forks, speculative rollbacks,
    cancellations and preemption on a cache sized to run full (also over 8-bit pages); every
    page back at the end."""
    out = tmp_path / "soak.json"
    assert e2e_bench.main(["--cpu-smoke", "--soak", "0.15", "--json", str(out), *pages]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and result["pages_back"] and result["free_pages"][0] == result["free_pages"][1]
    assert result["served"] >= 1 and result["arrived"] >= result["served"]
    assert result["steps"] > 0 and result["tokens_per_s"] > 0 and result["latency_s"]["p50"] > 0
    assert len(result["samples"]) >= 4


def test_plot_series_of_an_e2e_run_are_tokens_per_second_per_side_and_context():
    import plot_bench

    row = lambda step, graph=None: {"eager": {"step": step}, **({"graph": {"step": graph}} if graph else {})}  # noqa: E731
    result = {"decode": {"1024": {"ours": {"rows": {"8": row(0.01, 0.005), "1": row(0.002, 0.001)}},
                                  "native": {"rows": {"1": row(0.004), "8": {"eager": {"error": "crash"}}}}}}}
    series = plot_bench.e2e_series(result)
    assert series == {"ours, 1024": ([1, 8], [500.0, 800.0]), "ours+graph, 1024": ([1, 8], [1000.0, 1600.0]),
                      "native, 1024": ([1], [250.0])}


def test_plot_merges_the_contexts_of_one_model_from_several_runs():
    import plot_bench

    def run(model, context):
        return [{"model": model, "config": {}, "decode": {context: {"ours": {"rows": {}}}}}]

    merged = plot_bench.merged_e2e([run("8b", "1024"), run("1b", "1024") + run("8b", "4096")])
    assert [(r["model"], sorted(r["decode"])) for r in merged] == [("8b", ["1024", "4096"]), ("1b", ["1024"])]


def test_cpu_smoke_over_8_bit_pages_checks_logits_against_float16_pages_and_times_decode(tmp_path, capsys):
    """``--kv-dtype``: ours over e4m3 pages beside ours over float16 pages: logits on the same
    prompts and tokens within the 8-bit bound (yet quantized: not equal), decode timed per batch."""
    import e2e_fp8

    out = tmp_path / "e2e.json"
    assert e2e_bench.main(["--cpu-smoke", "--kv-dtype", "float8_e4m3fn", "--ttft", "--contexts", "40",
                           "--batches", "1", "3", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    check = result["fp8"]["check"]
    assert check["ok"] and check["rows"] == 2 * e2e_fp8.STEPS  # the prompts within the smoke chunk: 100, 37
    assert 1e-3 < check["max_rel"] <= check["tolerance"] and check["mean_rel"] > 1e-4, check
    assert check["agreement"] >= 0.75
    rows = result["fp8"]["decode"]["40"]["rows"]
    assert sorted(map(int, rows)) == [1, 3] and all(row["eager"]["step"] > 0 for row in rows.values())
    report = capsys.readouterr().out
    assert "float8_e4m3fn pages vs float16 pages" in report and "PASS" in report and "ratio" in report


@pytest.mark.parametrize("sync_steps", [False, True])
def test_measure_waits_for_the_gpu_before_every_timed_step_only_with_sync_steps(sync_steps):
    """``--sync-steps`` (TVM's native cache races when its steps queue up): a sync before every
    warm-up and timed step; without it, the timed steps run back to back."""
    import dataclasses

    import e2e_phases
    from e2e_runtime import SMOKE_PLAN

    events = []

    class FakeDevice:
        def sync(self):
            events.append("sync")

    def step(marks):
        events.append("step")
        marks.extend([0.0, 1.0, 2.0, 3.0])

    plan = dataclasses.replace(SMOKE_PLAN, warmup=2, steps=3, sync_steps=sync_steps)
    result = e2e_phases.measure(step, FakeDevice(), plan)
    each = ["sync", "step"] if sync_steps else ["step"]
    warm_up, timed = each * 2 + ["sync"], each * 3 + ["sync"]
    host_split = ["sync", "step"] * 3 + ["sync"]  # steps one at a time either way
    assert events == warm_up + timed + host_split
    assert result["host"] == pytest.approx(3.0)


def test_attention_fill_gives_ours_and_native_the_same_contexts():
    """``--fill attention``: both caches filled by their attention calls on the same random q/k/v
    hold the same KV: the next decode step's logits agree within the benchmark's tolerance (and
    depend on the fill: native's logits after another fill do not)."""
    import dataclasses

    import e2e_phases
    from e2e_runtime import SEED, SMOKE_MODEL, SMOKE_PLAN, Device, Runner

    device, cfg = Device(cuda=False), SMOKE_MODEL
    plan = dataclasses.replace(SMOKE_PLAN, fill="attention")
    weights = device.weights(cfg, SEED)
    token = device.tokens(np.array([[7]]))
    logits = {}
    for side, fill_seed in (("ours", 3), ("native", 3), ("other", 4)):
        build = "native" if side == "other" else side
        runner = Runner(build, e2e_bench.make_vm(build, e2e_bench._smoke_executable(build), device), weights)
        cache = runner.create(1, 256, plan.chunk)
        runner.add(cache, 0)
        assert e2e_phases.fill(runner, cache, device, cfg, plan, [0], 150, np.random.default_rng(fill_seed)) > 0
        logits[side] = runner.forward(cache, runner.decode_fn, token, [0], [1]).numpy().astype(np.float64)
    scale = np.abs(logits["native"]).max()
    assert scale > 0.1 and not np.isnan(logits["ours"]).any()
    assert np.abs(logits["ours"] - logits["native"]).max() <= e2e_bench.TOLERANCE * scale
    assert np.abs(logits["other"] - logits["native"]).max() > 4 * e2e_bench.TOLERANCE * scale


def test_host_profile_times_each_part_of_a_step_on_both_sides(capsys):
    """``e2e_host_profile.py --cpu-smoke``: every host-time figure of both sides, positive."""
    import e2e_host_profile

    assert e2e_host_profile.main(["--cpu-smoke", "--calls", "5"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(figures["native"]) == {"step", "begin_end", "begin_end_new_batch", "attention_builtin"}
    assert set(figures["ours"]) >= set(figures["native"]) | {"attention_method", "split_rotary", "transpose_append",
                                                             "ffi_floor"}
    assert all(v > 0 for side in figures.values() for v in side.values())
