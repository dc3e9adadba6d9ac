"""Shared pytest fixtures. Keep fixtures self-contained; prefix them by area (``kernel_*``, ...).

``benchmarks/`` goes on ``sys.path``: the tests share its float64 reference model
(``reference_model``), TVM's native cache (``native_baseline``) and the state machine
(``state_machine_model``). Benchmarks never import from ``tests/``.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCHMARKS = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)


@pytest.fixture(scope="session")
def kernel_target():
    """Compilation target of the kernel tests: the host CPU (``default_target(tvm.cpu())``)."""
    import tvm

    from relax_kvcache.runtime import default_target

    return default_target(tvm.cpu())


@pytest.fixture(scope="session")
def kernel_build(request):
    """``get(config) -> tvm.runtime.Module``: the kernel set of a config, built once per session.

    Builds go through ``build_kernels`` and its on-disk cache, so only the first session after a
    kernel source change compiles. With ``RELAX_KVCACHE_TEST_LIBS=DIR`` (a GPU host with
    runtime-only TVM) the libraries come from DIR instead, prepared on the development machine
    by ``python tests/gpu_kernel_libs.py DIR`` (see that file).
    """
    import os

    built = {}
    libs = os.environ.get("RELAX_KVCACHE_TEST_LIBS")
    if libs:
        import gpu_kernel_libs

        def build(config):
            return gpu_kernel_libs.load(config, libs)
    else:
        from relax_kvcache.build import build_kernels

        kernel_target = request.getfixturevalue("kernel_target")

        def build(config):
            return build_kernels(config, kernel_target)

    def get(config):
        if config not in built:
            built[config] = build(config)
        return built[config]

    return get


@pytest.fixture(scope="session")
def cache_factory():
    """``make(config) -> PagedAttentionKVCache`` on the CPU; kernels are built once per config
    (disk cache)."""
    import tvm

    import relax_kvcache as rk

    def make(config):
        return rk.PagedAttentionKVCache(config, tvm.cpu())

    return make


@pytest.fixture(scope="session")
def kernel_library(tmp_path_factory):
    """A kernel library exported for llvm (1 layer, 4 query / 2 KV heads of 32, float32), with its
    checksum file (``test_deploy``, ``test_cli``)."""
    import tvm

    import relax_kvcache as rk

    config = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=16,
                              max_num_seqs=4, max_total_seq_len=256, prefill_chunk_size=64, dtype="float32")
    return rk.export_kernels(config, tvm.target.Target("llvm"), tmp_path_factory.mktemp("lib") / "kernels.so")
