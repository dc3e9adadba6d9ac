"""Shared pytest fixtures. Keep fixtures self-contained; prefix them by area (``kernel_*``, ...)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kernel_target():
    """Compilation target of the kernel tests: the host CPU (``default_target(tvm.cpu())``)."""
    import tvm

    from relax_kvcache.runtime import default_target

    return default_target(tvm.cpu())


@pytest.fixture(scope="session")
def kernel_build(kernel_target):
    """``get(config) -> tvm.runtime.Module``: the kernel set of a config, built once per session.

    Builds go through ``build_kernels`` and its on-disk cache, so only the first session after a
    kernel source change compiles.
    """
    from relax_kvcache.build import build_kernels

    built = {}

    def get(config):
        if config not in built:
            built[config] = build_kernels(config, kernel_target)
        return built[config]

    return get
