"""Every cache feature's random workloads against the float64 reference model, per configuration.

Each configuration of ``gpu_prepare.CHECK_CONFIGS`` runs its workloads (``support/workloads.py``)
on a fresh ``PagedAttentionKVCache``, every output compared with the numpy float64
``ReferenceCache`` of ``reference_model.py`` (harness: ``support/harness.py``): chunked
prefill mixed with decode over several sequences, forks at arbitrary positions (mid-page
included), popn, remove, per-sequence sliding windows with attention sinks, per-layer windows
(``MHA_SLIDING``, ``MHA_CHUNKED_LOCAL``), token trees (``begin_forward`` with parent pointers,
``commit_accepted_token_tree_nodes``, decode after), ``attention_with_shared_kv``,
``self_attention`` / ``cross_attention`` / ``merge_attn_output_inplace``, checkpoints, prefix
caching with a host tier and decode replayed as CUDA graphs, with ``debug_get_kv`` after each
phase, in all three RoPE modes, over 16- and 8-bit pages. The ``tvm-kernels`` cases run our cache
on TVM's kernels of the benchmark shape, which tells cache-logic problems from kernel problems.

Inputs are unit-variance random values in the cache dtype (caches over 8-bit pages: K and V on
the 8-bit grid times power-of-two scales set with ``set_kv_scales``, which the pages store
exactly, so the float64 reference holds for them unchanged); every output is poisoned with NaN
before the kernel call that writes it and must come back free of NaN, with infinities only where
the reference has them (the log-sum-exp of rows that see nothing), and within 2e-2 (float16) /
2e-3 (float32) of the reference.

On the CPU (CI) the kernels are built here (disk cache); ``graph_decode`` (CUDA graphs) and
``long_context`` (minutes of float64 reference) are skipped. On a GPU, with the libraries
``python benchmarks/gpu_prepare.py --only ours --out .gpu/chk`` builds on the development
machine (``benchmarks/gpu_host.sh`` runs this)::

    RELAX_KVCACHE_TEST_DEVICE=cuda RELAX_KVCACHE_WORKLOAD_LIBS=.gpu/chk python -m pytest -s tests/test_workloads.py
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable, Dict, Tuple

import numpy as np
import pytest
import tvm

import gpu_prepare as gp
import relax_kvcache as rk
from support.harness import TOLERANCE, Check
from support.workloads import WORKLOADS

#: The workloads of our cache on TVM's kernels.
TVM_KERNEL_WORKLOADS = ("random", "prefix_chain", "token_tree", "self_cross_merge")
CASES = [(name, workload) for name, (_, workloads) in gp.CHECK_CONFIGS.items() for workload in workloads]
CASES += [("tvm-kernels", workload) for workload in TVM_KERNEL_WORKLOADS]
CUDA = os.environ.get("RELAX_KVCACHE_TEST_DEVICE", "cpu") == "cuda"
DEVICE = tvm.cuda(0) if CUDA else tvm.cpu(0)
#: workload -> why it does not run on the CPU
CPU_SKIPS = {"graph_decode": "CUDA graphs: CUDA only", "graph_batches": "CUDA graphs: CUDA only",
             "long_context": "its float64 reference takes minutes: run on a GPU host"}


@pytest.fixture(scope="module")
def workload_case() -> Callable[[str], Tuple[rk.KVCacheConfig, rk.KernelSet]]:
    """``get(name) -> (config, kernels)`` of a configuration (``tvm-kernels``: our cache's config
    of the benchmark shape and TVM's kernels), loaded or built once per module."""
    libs = os.environ.get("RELAX_KVCACHE_WORKLOAD_LIBS")
    if CUDA and not libs:
        pytest.fail("RELAX_KVCACHE_TEST_DEVICE=cuda needs RELAX_KVCACHE_WORKLOAD_LIBS (a folder of gpu_prepare.py)")
    manifest = gp.read_manifest(pathlib.Path(libs)) if libs else None
    modules: Dict[str, tvm.runtime.Module] = {}
    cases: Dict[str, Tuple[rk.KVCacheConfig, rk.KernelSet]] = {}

    def load(file: str) -> tvm.runtime.Module:
        if file not in modules:
            modules[file] = gp.load_library(pathlib.Path(libs) / file, DEVICE)
        return modules[file]

    def get(name: str) -> Tuple[rk.KVCacheConfig, rk.KernelSet]:
        if name not in cases:
            cases[name] = tvm_kernel_case(manifest, load) if name == "tvm-kernels" else config_case(name, manifest, load)
        return cases[name]

    return get


def config_case(name: str, manifest, load) -> Tuple[rk.KVCacheConfig, rk.KernelSet]:
    if manifest is None:
        config = gp.config_from_json(gp.CHECK_CONFIGS[name][0])
        return config, rk.KernelSet.from_module(rk.build_kernels(config, gp.make_target("llvm", "")))
    entry = manifest["check"][name]
    assert entry["library"], f"the library of {name} was not built: {entry.get('error')}"
    return gp.config_from_json(entry["config"]), rk.KernelSet.from_module(load(entry["library"]))


def tvm_kernel_case(manifest, load) -> Tuple[rk.KVCacheConfig, rk.KernelSet]:
    from native_baseline import create_args

    shape = gp.BENCH_SHAPE
    if manifest is None:
        module = gp.build_tvm(shape, gp.make_target("llvm", ""))
    else:
        bench = manifest["bench"]
        if not bench.get("tvm"):
            pytest.skip("the libraries have no TVM kernels (gpu_prepare.py --only ours)")
        shape, module = gp.shape_from_json(bench["shape"]), load(bench["tvm"])
    # 8 layers, as TVM's debug_get_kv was built
    shape = dataclasses.replace(shape, max_num_seqs=16, max_total_seq_len=2048, prefill_chunk_size=128)
    return shape.our_config(), rk.KernelSet.from_creation_args(create_args(shape, gp.tvm_kernel_dict(module)))


@pytest.mark.parametrize("name,workload", CASES, ids=[f"{name}-{workload}" for name, workload in CASES])
def test_workload(name, workload, workload_case):
    if not CUDA and workload in CPU_SKIPS:
        pytest.skip(CPU_SKIPS[workload])
    config, kernels = workload_case(name)
    rng = np.random.default_rng([0, sum(map(ord, name + workload))])
    check = Check(rk.PagedAttentionKVCache(config, DEVICE, kernels=kernels), rng, TOLERANCE[config.dtype])
    WORKLOADS[workload](check)
    print(f"{name:<20} {workload:<17} steps {check.steps:>3}  max err {check.max_error:8.2e}")
    assert check.steps > 0
    assert not check.problems, f"{len(check.problems)} problem(s): " + "; ".join(check.problems[:3])
