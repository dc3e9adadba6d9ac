"""LongRoPE on a GPU: our cache (float16) against float64 LongRoPE, across the switch position.

On the development machine: ``python tests/gpu_kernel_libs.py .gpu/klr --only-rope``. On the
GPU host (runtime-only TVM, ``PYTHONPATH=python:tests:benchmarks``)::

    python tests/gpu_longrope_check.py [--seed S] [--libs .gpu/klr]

Prefill chunks that cross ``rope_original_max_position_embeddings`` (2048), decode beyond it, a
fork before it whose prefill crosses it again, a popn back across it: every attention output and
the stored K of every sequence are compared with ``reference_model`` (float64). The kernel alone is
checked by ``tests/test_kernels.py -k longrope`` (float16 / bfloat16).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import tvm

import relax_kvcache as rk
import gpu_kernel_libs
from reference_model import CacheModel, longrope
from support.kernel_cases import LONGROPE_CONFIGS

ORIGINAL = 2048  # LONGROPE_CONFIGS' rope_original_max_position_embeddings
OUT_TOL, K_TOL = 2e-2, 3e-2  # float16 outputs / stored keys (unit-variance inputs)


class Check:
    """Our cache on the GPU and its float64 model, driven together."""

    def __init__(self, libs: str, seed: int) -> None:
        built_for = LONGROPE_CONFIGS["f16_longrope"]
        cfg = dataclasses.replace(built_for, max_total_seq_len=8192, prefill_chunk_size=2048, max_num_seqs=8)
        self.dev = tvm.cuda()
        kernels = rk.KernelSet.from_module(gpu_kernel_libs.load(built_for, libs))
        self.cache = rk.PagedAttentionKVCache(cfg, self.dev, kernels=kernels)
        self.cfg = cfg
        self.model = CacheModel(cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, 1,
                                cfg.rope_theta, cfg.rope_scale)
        self.model.rope = lambda x, p: longrope(x, p, cfg.rope_theta, cfg.rope_scale, cfg.rope_ext_factors,
                                                ORIGINAL, cfg.rope_attention_factor)
        self.rng = np.random.default_rng(seed)
        self.worst = 0.0

    def _record(self, what: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
        err = float(np.abs(got.astype(np.float64) - want).max())
        self.worst = max(self.worst, err)
        assert err < tol, f"{what}: max abs error {err:.3g} >= {tol}"

    def step(self, batch) -> None:
        cfg, n = self.cfg, sum(length for _, length in batch)
        hq, width, d = cfg.num_qo_heads, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim
        qkv = [self.rng.standard_normal((n, width, d)).astype(np.float16) for _ in range(cfg.num_layers)]
        self.cache.begin_forward([s for s, _ in batch], [length for _, length in batch])
        outs = []
        for layer in range(cfg.num_layers):
            o = tvm.runtime.tensor(np.full((n, hq, d), np.nan, np.float16), self.dev)
            self.cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer], self.dev), o, d ** -0.5)
            outs.append(o.numpy())
        self.cache.end_forward()
        for layer, want in enumerate(self.model.step(batch, qkv, d ** -0.5)):
            self._record(f"attention of layer {layer}, batch {batch}", outs[layer], want, OUT_TOL)

    def check_stored_keys(self) -> None:
        cfg = self.cfg
        for seq_id, seq in self.model.seqs.items():
            shape = (cfg.num_layers, seq.length, cfg.num_kv_heads, cfg.head_dim)
            k, v = tvm.runtime.empty(shape, "float16", self.dev), tvm.runtime.empty(shape, "float16", self.dev)
            self.cache.debug_get_kv(seq_id, 0, seq.length, k, v)
            self._record(f"stored K of sequence {seq_id}", k.numpy(), seq.k, K_TOL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--libs", default=".gpu/klr")
    args = parser.parse_args()
    c = Check(args.libs, args.seed)
    for seq in (0, 1):
        c.cache.add_sequence(seq)
        c.model.add(seq)
    c.step([(0, 2000), (1, 40)])
    c.step([(0, 100), (1, 1)])  # sequence 0 crosses the switch position
    for _ in range(4):
        c.step([(0, 1), (1, 1)])
    c.cache.fork_sequence(0, 2, 1000)
    c.model.fork(0, 2, 1000)
    c.step([(2, 1100), (0, 1)])  # the fork crosses it again
    c.cache.popn(2, 200)
    c.model.popn(2, 200)
    c.step([(2, 3), (1, 2)])
    c.check_stored_keys()
    print(f"LongRoPE cache on {c.dev}: 8 steps and the stored K of 3 sequences match float64 "
          f"(worst abs error {c.worst:.3g})")


if __name__ == "__main__":
    main()
