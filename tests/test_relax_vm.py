"""A Relax program written against TVM's own ``PagedKVCache`` frontend runs on our cache unchanged.

The model functions below are written with ``tvm.relax.frontend.nn`` and TVM's
``tvm.relax.frontend.nn.llm.kv_cache.PagedKVCache`` (test-only use of TVM's frontend: it emits
the ``vm.builtin.attention_kv_cache_*`` calls a model compiled by MLC-LLM makes). The compiled
program gets the cache as an argument; the same program and the same inputs run once with our
cache (created through ``relax_kvcache.paged_attention_kv_cache_create`` with our kernels) and
once with TVM's native C++ cache (TVM's kernels), through a workload of prefill chunks, decode,
a fork, a popn and a removal, driven by the ``vm.builtin.kv_state_*`` functions. Every output of
every call must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

import relax_kvcache  # noqa: F401  (before any VirtualMachine: the VM binds vm.builtin.* when made)
from native_baseline import Builtins, Shape, create_native, create_ours_packed

SHAPE = Shape(num_layers=3, num_qo_heads=8, num_kv_heads=2, head_dim=64, rope_mode=1, rope_theta=1e4,
              dtype="float32", max_num_seqs=8, max_total_seq_len=512, prefill_chunk_size=64)
HQ, HKV, D = SHAPE.num_qo_heads, SHAPE.num_kv_heads, SHAPE.head_dim
SCALE = D ** -0.5


class Attention(nn.Module):
    """Attention of every layer, as a model's decoder layers call it."""

    def fused(self, qkv: nn.Tensor, cache: PagedKVCache):
        """``attention_with_fused_qkv`` on each layer (each layer's input scaled differently)."""
        return tuple(cache.attention_with_fused_qkv(layer, qkv * (1.0 + 0.5 * layer), num_qo_heads=HQ,
                                                    sm_scale=SCALE) for layer in range(SHAPE.num_layers))

    def split(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, cache: PagedKVCache):
        """The fine-grained path: ragged self attention over the new tokens, paged cross attention
        over the cached ones, merged by LSE; plus the query positions."""
        o_self, lse_self = cache.self_attention(1, q, k, v, SCALE)
        o_cross, lse_cross = cache.cross_attention(1, q, D, SCALE)
        o, lse = cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
        return o, lse, cache.get_query_positions(q.shape[1])


@pytest.fixture(scope="module")
def vm() -> relax.VirtualMachine:
    cache_spec = nn.spec.Object(object_type=PagedKVCache)
    mod, _ = Attention().export_tvm(spec={
        "fused": {"qkv": nn.spec.Tensor([1, "n", HQ + 2 * HKV, D], "float32"), "cache": cache_spec},
        "split": {"q": nn.spec.Tensor([1, "n", HQ, D], "float32"), "k": nn.spec.Tensor([1, "n", HKV, D], "float32"),
                  "v": nn.spec.Tensor([1, "n", HKV, D], "float32"), "cache": cache_spec},
    }, debug=False)
    return relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())


def _outputs(result) -> list:
    items = [result] if isinstance(result, tvm.runtime.Tensor) else list(result)
    return [item.numpy() for item in items]


class Run:
    """One cache driven by the compiled program and the ``vm.builtin`` state functions."""

    def __init__(self, vm: relax.VirtualMachine, cache) -> None:
        self.vm, self.cache, self.B, self.results = vm, cache, Builtins(), []

    def step(self, seq_ids, lengths, inputs, fn: str = "fused") -> None:
        self.B.begin(self.cache, seq_ids, lengths)
        args = [tvm.runtime.tensor(x) for x in inputs]
        self.results.append(_outputs(self.vm[fn](*args, self.cache)))
        self.B.end(self.cache)


def test_tvm_frontend_program_gives_native_results_on_our_cache(vm):
    rng = np.random.default_rng(7)
    runs = {"ours": Run(vm, create_ours_packed(SHAPE)), "native": Run(vm, create_native(SHAPE))}

    def qkv(n):
        return [rng.standard_normal((1, n, HQ + 2 * HKV, D)).astype("float32")]

    def split(n):
        return [rng.standard_normal((1, n, h, D)).astype("float32") for h in (HQ, HKV, HKV)]

    script = []  # (operation, arguments), applied to both caches with the same inputs
    script += [("add", 0), ("add", 1), ("step", ([0, 1], [13, 30], qkv(43)))]
    script += [("step", ([0, 1], [1, 1], qkv(2))), ("fork", (0, 2, 6)), ("add", 3)]
    script += [("step", ([0, 1, 2, 3], [1, 1, 5, 17], qkv(24))), ("popn", (1, 3))]
    script += [("remove", 0), ("step", ([1, 2, 3], [1, 1, 1], qkv(3)))]
    # last: the fine-grained path appends no K/V, so the positions it reserves stay unwritten
    script += [("step", ([1, 2], [4, 1], split(5), "split"))]
    for run in runs.values():
        for op, arg in script:
            if op == "add":
                run.B.add(run.cache, arg)
            elif op == "fork":
                run.B.fork(run.cache, *arg)
            elif op == "popn":
                run.B.popn(run.cache, *arg)
            elif op == "remove":
                run.B.remove(run.cache, arg)
            else:
                run.step(*arg)
    ours, native = runs["ours"].results, runs["native"].results
    assert len(ours) == len(native) == 5
    for i, (got, want) in enumerate(zip(ours, native)):
        assert len(got) == len(want)
        for j, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"step {i} output {j}"
            assert np.isfinite(a).all(), f"step {i} output {j}: non-finite values in ours"
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"step {i} output {j}")
