"""``relax_kvcache.frontend``: a model written with it, compiled with its kernels in one module.

The program below creates the cache inside the compiled module (``create_kv_cache``: our kernels
are TIR functions of the same IRModule, passed to ``relax_kvcache.paged_attention_kv_cache_create``)
and calls it from its attention functions. Checked:

* the fused path against the float64 ``ReferenceCache`` through prefill chunks, decode, a fork
  and a popn (RoPE NORMAL, GQA, several layers);
* every method (fused, self / cross attention, merge, query positions) against TVM's native cache
  running the same compiled program: our frontend emits the calls TVM's runtime expects.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn

import relax_kvcache as rk  # noqa: F401  (before any VirtualMachine: the VM binds vm.builtin.* when made)
from relax_kvcache import frontend
from reference_model import ReferenceCache
from native_baseline import Builtins, Shape, create_native
from support.frontend_program import create

LAYOUT = frontend.CacheLayout(num_layers=3, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                              rope_mode=rk.RopeMode.NORMAL, rope_theta=1e4, dtype="float32")
HQ, HKV, D, L = LAYOUT.num_qo_heads, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.num_layers
SCALE = D ** -0.5


class Program(nn.Module):
    def create_kv_cache(self, max_batch_size: tvm.tirx.Var, max_total_seq_len: tvm.tirx.Var,
                        prefill_chunk_size: tvm.tirx.Var):
        return frontend.PagedKVCache.create(LAYOUT, "llvm", max_batch_size=max_batch_size,
                                            max_total_seq_len=max_total_seq_len,
                                            prefill_chunk_size=prefill_chunk_size)

    def fused(self, qkv: nn.Tensor, cache: frontend.PagedKVCache):
        """Each layer's attention_with_fused_qkv on its own input (one fused tensor per layer)."""
        parts = nn.op.split(qkv, L, axis=0)
        return tuple(cache.attention_with_fused_qkv(layer, parts[layer].reshape(*qkv.shape[1:]), num_qo_heads=HQ,
                                                    sm_scale=SCALE) for layer in range(L))

    def split(self, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, cache: frontend.PagedKVCache):
        o_self, lse_self = cache.self_attention(1, q, k, v, SCALE)
        o_cross, lse_cross = cache.cross_attention(1, q, D, SCALE)
        o, lse = cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
        return o, lse, cache.get_query_positions(q.shape[1])


@pytest.fixture(scope="module")
def vm() -> relax.VirtualMachine:
    cache = nn.spec.Object(object_type=frontend.PagedKVCache)
    tensor = lambda *shape: nn.spec.Tensor(list(shape), "float32")  # noqa: E731
    mod, _ = Program().export_tvm(spec={
        "create_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int},
        "fused": {"qkv": tensor(L, 1, "n", HQ + 2 * HKV, D), "cache": cache},
        "split": {"q": tensor(1, "n", HQ, D), "k": tensor(1, "n", HKV, D), "v": tensor(1, "n", HKV, D),
                  "cache": cache},
    }, debug=False)
    assert {gv.name_hint for gv in mod.get_global_vars()} >= {"relax_kvcache_attention_decode",
                                                            "relax_kvcache_transpose_append"}
    return relax.VirtualMachine(frontend.compile(mod, "llvm"), tvm.cpu())


def test_create_kv_cache_makes_our_cache(vm):
    cache = create(vm, 4, 256, 32)
    assert isinstance(cache, rk.PagedAttentionKVCache)
    cfg = cache.config
    assert (cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (L, HQ, HKV, D, "float32")
    assert (cfg.max_num_seqs, cfg.prefill_chunk_size, cfg.page_size) == (4, 32, 16)
    # the frontend passes the prefixed prefill kernel (30th argument): prefill steps of plain
    # sequences take the cache's own path (append, then one causal paged pass)
    assert callable(cache._kernels.attention_prefill_prefixed)
    # and check_fused_qkv (31st): attention_with_fused_qkv checks its tensors in one host call
    assert callable(cache._kernels.check_fused_qkv)


def test_fused_attention_matches_float64_reference(vm):
    rng = np.random.default_rng(11)
    cache, B = create(vm, 8, 512, 64), Builtins()
    ref = ReferenceCache(L, HQ, HKV, D, rope_mode=1, rope_theta=LAYOUT.rope_theta)

    def step(batch):
        n = sum(length for _, length in batch)
        qkv = rng.standard_normal((L, 1, n, HQ + 2 * HKV, D)).astype("float32")
        B.begin(cache, [s for s, _ in batch], [length for _, length in batch])
        got = [o.numpy()[0] for o in vm["fused"](tvm.runtime.tensor(qkv), cache)]
        B.end(cache)
        want = ref.step(batch, [qkv[layer, 0] for layer in range(L)], SCALE)
        for layer in range(L):
            np.testing.assert_allclose(got[layer], want[layer], rtol=1e-4, atol=1e-4,
                                       err_msg=f"batch {batch} layer {layer}")

    for seq in (0, 1):
        B.add(cache, seq)
        ref.add(seq)
    step([(0, 21), (1, 40)])
    step([(0, 1), (1, 1)])
    step([(0, 9), (1, 14)])  # a chunked prefill step of plain sequences
    B.fork(cache, 1, 2, 17)
    ref.fork(1, 2, 17)
    step([(0, 1), (2, 6), (1, 1)])
    B.popn(cache, 0, 2)
    ref.popn(0, 2)
    step([(2, 1), (0, 3)])


def test_every_method_matches_native_cache(vm):
    shape = Shape(num_layers=L, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, rope_mode=1,
                  rope_theta=LAYOUT.rope_theta, dtype="float32", max_num_seqs=8, max_total_seq_len=512,
                  prefill_chunk_size=64)
    B = Builtins()
    caches = {"ours": create(vm, 8, 512, 64), "native": create_native(shape)}
    inputs = np.random.default_rng(5)
    fused = inputs.standard_normal((L, 1, 30, HQ + 2 * HKV, D)).astype("float32")
    split = [inputs.standard_normal((1, 7, h, D)).astype("float32") for h in (HQ, HKV, HKV)]
    results = {}
    for name, cache in caches.items():
        B.add(cache, 0)
        B.add(cache, 1)
        B.begin(cache, [0, 1], [12, 18])
        out = [o.numpy() for o in vm["fused"](tvm.runtime.tensor(fused), cache)]
        B.end(cache)
        B.begin(cache, [1, 0], [4, 3])  # the fine-grained path appends nothing: the last step
        out += [o.numpy() for o in vm["split"](*(tvm.runtime.tensor(x) for x in split), cache)]
        B.end(cache)
        results[name] = out
    assert len(results["ours"]) == L + 3
    for i, (a, b) in enumerate(zip(results["ours"], results["native"])):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"output {i}")
    np.testing.assert_array_equal(results["ours"][-1], [18, 19, 20, 21, 12, 13, 14])  # seq 1, then seq 0


def test_compile_plans_activations_for_the_upper_bounds_given(monkeypatch):
    """``upper_bounds`` reach ``tvm.compile`` as each Relax function's ``tir_var_upper_bound``
    (models compiled with them give native's logits: ``test_e2e_bench``'s smoke run)."""
    import e2e_models
    from relax_kvcache.models import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, rope_theta=1e4, dtype="float32")
    mod = e2e_models.build_module("ours", cfg, tvm.target.Target("llvm"))
    seen = {}
    real = tvm.compile

    def spy(m, **kw):
        seen.update({gv.name_hint: f.attrs["tir_var_upper_bound"] for gv, f in m.functions_items()
                     if isinstance(f, tvm.relax.Function) and f.attrs and "tir_var_upper_bound" in f.attrs})
        return real(m, **kw)

    monkeypatch.setattr(tvm, "compile", spy)
    rk.frontend.compile(mod, "llvm", upper_bounds={"n": 64, "b": 4})
    assert {"prefill", "decode"} <= set(seen)
    assert {k: int(v) for k, v in seen["decode"].items()} == {"n": 64, "b": 4}
