"""The tensor-core matmul that ``frontend.compile`` gives a model's matmuls on CUDA sm_80+.

Here: which legalized matmuls it takes, and that its CUDA source builds with nvcc. On a CUDA host
(``RELAX_KVCACHE_TEST_DEVICE=cuda`` and ``RELAX_KVCACHE_MATMUL_LIBS``, the folder
``benchmarks/matmul_bench.py --prepare`` wrote): its results against float64.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import tvm

import matmul_bench


def _tcm():
    """The module under test (imported here: the GPU test runs on hosts with TVM's runtime only)."""
    from relax_kvcache import tensor_core_matmul

    return tensor_core_matmul


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("epilogue", ["none", "add", "cast"])
def test_takes_the_model_matmuls_with_their_epilogue(epilogue, dtype):
    tcm = _tcm()
    func = matmul_bench.matmul_func(256, 128, epilogue, dtype)
    mm = tcm.match(func)
    assert mm is not None
    assert mm.out.dtype == ("float32" if epilogue == "cast" else dtype)
    assert [int(d) for d in mm.w.shape] == [256, 128]
    assert "tirx.is_scheduled" in tcm.schedule(func).attrs


@pytest.mark.parametrize("n_out, k, dtype", [(256, 96, "float16"), (192, 128, "float16"), (256, 128, "float32")],
                         ids=["k-not-a-multiple-of-64", "n-not-a-multiple-of-128", "float32"])
def test_leaves_matmuls_it_cannot_tile(n_out, k, dtype):
    assert _tcm().match(matmul_bench.matmul_func(n_out, k, "none", dtype)) is None


def _hand_written(init: float = 0.0, reversed_residual: bool = False):
    """A matmul (its sum starting at ``init``) whose epilogue adds a residual, read in reverse along
    the columns with ``reversed_residual``."""
    from tvm.script import tirx as T

    last = 255 if reversed_residual else 0
    sign = -1 if reversed_residual else 1

    @T.prim_func(private=True, s_tir=True)
    def func(var_x: T.handle, var_w: T.handle, var_res: T.handle, var_out: T.handle):
        n = T.int64()
        w = T.match_buffer(var_w, (T.int64(256), T.int64(128)), "float16")
        x = T.match_buffer(var_x, (T.int64(1), n, T.int64(128)), "float16")
        res = T.match_buffer(var_res, (T.int64(1), n, T.int64(256)), "float16")
        out = T.match_buffer(var_out, (T.int64(1), n, T.int64(256)), "float16")
        mm = T.sblock_alloc_buffer((T.int64(1), n, T.int64(256)), "float16")
        for i0, i1, i2, k in T.grid(T.int64(1), n, T.int64(256), T.int64(128)):
            with T.sblock("NT_matmul"):
                v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
                with T.init():
                    mm[v0, v1, v2] = T.float16(init)
                mm[v0, v1, v2] = mm[v0, v1, v2] + x[v0, v1, vk] * w[v2, vk]
        for i0, i1, i2 in T.grid(T.int64(1), n, T.int64(256)):
            with T.sblock("T_add"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                out[v0, v1, v2] = mm[v0, v1, v2] + res[v0, v1, T.int64(last) + T.int64(sign) * v2]

    return func


def test_leaves_sums_not_starting_at_zero():
    tcm = _tcm()
    assert tcm.match(_hand_written()) is not None
    assert tcm.match(_hand_written(init=1.0)) is None


def test_takes_a_broadcast_bias_and_leaves_reads_at_other_indices():
    """A bias added along the columns is an epilogue it takes; a residual read in reverse is not."""
    from tvm import relax as rx

    tcm = _tcm()
    assert tcm.match(_hand_written(reversed_residual=True)) is None

    bb = rx.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = rx.Var("x", rx.TensorType((1, n, 128), "float16"))
    w = rx.Var("w", rx.TensorType((256, 128), "float16"))
    bias = rx.Var("bias", rx.TensorType((256,), "float16"))
    with bb.function("main", [x, w, bias]):
        with bb.dataflow():
            y = bb.emit(rx.op.add(rx.op.matmul(x, rx.op.permute_dims(w)), bias))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential([rx.transform.FuseTransposeMatmul(), rx.transform.LegalizeOps(),
                                    rx.transform.AnnotateTIROpPattern(), rx.transform.FuseOps(),
                                    rx.transform.FuseTIR()])(bb.get())
    [func] = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert tcm.match(func) is not None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_cuda_source_uses_tensor_cores_and_builds(arch):
    from relax_kvcache import deploy, launch
    from relax_kvcache.build import _pass_config
    from relax_kvcache.targets import make_target

    try:
        deploy.find_nvcc()
    except Exception:  # noqa: BLE001
        pytest.skip("nvcc not found")
    target = make_target("cuda", arch=arch)
    func = _tcm().schedule(matmul_bench.matmul_func(256, 128, "add", "float16")).with_attr("global_symbol", "mm")
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        lib = tvm.compile(tvm.IRModule({"mm": func}), target=target, tir_pipeline=launch.register())
    [source] = [m.inspect_source() for m in lib.mod.imports if m.kind == "cuda"]
    for needle in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async.cg.shared.global"):
        assert needle in source, needle
    assert deploy.nvcc_compile(source, arch=arch, use_cache=False)


def _device_libs():
    libs = os.environ.get("RELAX_KVCACHE_MATMUL_LIBS")
    if os.environ.get("RELAX_KVCACHE_TEST_DEVICE") != "cuda" or not libs:
        pytest.skip("needs a CUDA host and RELAX_KVCACHE_MATMUL_LIBS (benchmarks/matmul_bench.py --prepare)")
    return pathlib.Path(libs)


@pytest.mark.parametrize("rows", [4, 9, 40, 100, 130, 1000])
def test_results_agree_with_float64_on_the_gpu(rows):
    """What frontend.compile builds for every prepared case of the 1b shapes (both dtypes, each
    epilogue), at row counts of each tensor-core tile (32 and 64 rows with k split, 128) that are
    not multiples of it, outputs poisoned with NaN first, against numpy in float64."""
    import ml_dtypes

    from relax_kvcache import deploy

    libs = _device_libs()
    dev = tvm.cuda(0)
    lib = deploy.load(str(libs / "matmul.so"), device=dev)
    rng = np.random.default_rng(rows)
    for case in json.loads((libs / "manifest.json").read_text())["cases"]:
        if case["model"] != "1b":
            continue
        np_dtype = np.float16 if case["dtype"] == "float16" else ml_dtypes.bfloat16
        x = rng.standard_normal((1, rows, case["k"])).astype(np_dtype)
        w = (rng.standard_normal((case["n"], case["k"])) / case["k"] ** 0.5).astype(np_dtype)
        extra = {"add": [rng.standard_normal((1, rows, case["n"])).astype(np_dtype)],
                 "bias": [rng.standard_normal(case["n"]).astype(np_dtype)]}.get(case["epilogue"], [])
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        if extra:
            ref = ref + extra[0].astype(np.float64)
        out_dtype = np.float32 if case["epilogue"] == "cast" else np_dtype
        out = tvm.runtime.tensor(np.full((1, rows, case["n"]), np.nan, dtype=out_dtype), dev)
        lib[f"ours_{case['case']}"](*[tvm.runtime.tensor(a, dev) for a in (x, w, *extra)], out)
        got = out.numpy().astype(np.float64)
        assert not np.isnan(got).any(), case["case"]
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= matmul_bench.TOLERANCE, (case["case"], rows, err)


@pytest.mark.parametrize("n_out, k", [(2048, 8192), (4096, 14336), (6144, 4096), (128256, 2048)])
def test_split_tiles_all_take_one_workspace_size(n_out, k):
    """Every k-split tile asks TVM's workspace pool for the same number of bytes, whatever the
    matmul's shape (the pool frees and reallocates a page that is too small, which would leave
    CUDA graphs captured on the old page reading freed memory), and it is large enough."""
    tcm = _tcm()
    func = matmul_bench.matmul_func(n_out, k, "add", "float16")
    mm = tcm.match(func)
    for rows in tcm.SMALL_ROWS:
        tile = tcm.small_tile(rows, mm)
        script = tcm.schedule(func, rows).script()
        allocs = [line for line in script.splitlines() if "sblock_alloc_buffer" in line and "scope=" not in line]
        if tile.splits > 1:
            assert tile.splits * rows * n_out <= tcm.WORKSPACE_FLOATS
            assert len(allocs) == 1 and f"({tcm.WORKSPACE_FLOATS},)" in allocs[0], allocs
        else:
            assert not allocs, allocs
