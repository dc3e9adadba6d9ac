"""A model written as TVM's ``optimize_llm`` tutorial writes it runs on our cache, unchanged except
for the name of the creation function.

The model (test-only use of TVM's frontend) is a small Llama-style ``nn.Module`` (2 layers, GQA)
whose ``create_tir_paged_kv_cache`` builds TVM's ``TIRPagedKVCache``: TVM's kernels enter the
IRModule and TVM's creation call ``vm.builtin.paged_attention_kv_cache_create`` is emitted with
TVM's arguments (``rope_ext_factors=PrimValue(0)``; for ``llvm`` the two tree-attention kernels
in TVM's CPU order). The exported module gets a second creation function, a copy of the first
whose extern call is renamed to ``relax_kvcache.paged_attention_kv_cache_create``; nothing else
changes. One compiled program then runs prefill and decode steps with random weights and inputs
on our cache and on TVM's native cache, and the logits must agree. For CUDA the module is only
compiled (no GPU needed).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.relax.utils import copy_with_new_vars

import relax_kvcache as rk  # noqa: F401  (before any VirtualMachine: the VM binds vm.builtin.* when made)
from relax_kvcache import frontend
from native_baseline import CREATE_NATIVE, CREATE_OURS, Builtins, Shape, create_args, tvm_kernels

HIDDEN, LAYERS, HQ, HKV, D, INTER, VOCAB = 128, 2, 4, 2, 32, 192, 96
OURS = "create_relax_kvcache"  # the renamed copy of create_tir_paged_kv_cache


class Attention(nn.Module):
    def __init__(self):
        self.qkv_proj = nn.Linear(HIDDEN, (HQ + 2 * HKV) * D, bias=False)
        self.o_proj = nn.Linear(HQ * D, HIDDEN, bias=False)

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer_id: int):
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, HQ + 2 * HKV, D))
        out = cache.attention_with_fused_qkv(layer_id, qkv, HQ, sm_scale=D ** -0.5)
        return self.o_proj(op.reshape(out, (b, s, HQ * D)))


class DecoderLayer(nn.Module):
    def __init__(self):
        self.self_attn = Attention()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.input_layernorm = nn.RMSNorm(HIDDEN, -1, 1e-5, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN, -1, 1e-5, bias=False)

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer_id: int):
        x = x + self.self_attn(self.input_layernorm(x), cache, layer_id)
        gate, up = op.split(self.gate_up_proj(self.post_attention_layernorm(x)), 2, axis=-1)
        return x + self.down_proj(op.silu(gate) * up)


class TutorialModel(nn.Module):
    """The tutorial's ``LlamaForCasualLM`` in miniature: embed, prefill, decode and the cache's
    creation through TVM's ``TIRPagedKVCache``."""

    def __init__(self, target: tvm.target.Target, dtype: str):
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(HIDDEN, -1, 1e-5, bias=False)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.target, self.dtype = target, dtype
        if dtype != "float32":
            self.to(dtype)

    def embed(self, input_ids: nn.Tensor):
        return op.reshape(self.embed_tokens(input_ids), (1, input_ids.shape[0], HIDDEN))

    def _forward(self, x: nn.Tensor, cache: PagedKVCache):
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, cache, layer_id)
        return op.astype(self.lm_head(self.norm(x)), "float32")

    def prefill(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_embed, paged_kv_cache), paged_kv_cache

    def decode(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        return self._forward(input_embed, paged_kv_cache), paged_kv_cache

    def create_tir_paged_kv_cache(self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size):
        return TIRPagedKVCache(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size, support_sliding_window=0,
            layer_partition=relax.ShapeExpr([0, LAYERS]), num_hidden_layers=LAYERS, num_attention_heads=HQ,
            num_key_value_heads=HKV, qk_head_dim=D, v_head_dim=D, mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0, rope_mode=RopeMode.NORMAL, rope_scale=1, rope_theta=10000,
            rope_scaling={}, rope_ext_factors=relax.prim_value(0), rotary_dim=D, enable_disaggregation=False,
            dtype=self.dtype, target=self.target)

    def get_default_spec(self):
        packed = {"param_mode": "packed", "effect_mode": "none"}
        cache = nn.spec.Object(object_type=PagedKVCache)
        return {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {"input_embed": nn.spec.Tensor([1, "seq_len", HIDDEN], self.dtype), "paged_kv_cache": cache,
                        "$": packed},
            "decode": {"input_embed": nn.spec.Tensor([1, 1, HIDDEN], self.dtype), "paged_kv_cache": cache,
                       "$": packed},
            "create_tir_paged_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int,
                                          "page_size": int, "$": {"param_mode": "none", "effect_mode": "none"}},
        }


@relax.expr_functor.mutator
class _RenameExtern(relax.PyExprMutator):
    """Replaces the extern function ``old`` by ``new`` (the creation call's callee)."""

    def __init__(self, mod: tvm.IRModule, old: str, new: str):
        super().__init__(mod)
        self.old, self.new, self.renamed = old, new, 0

    def visit_extern_func_(self, op: relax.ExternFunc) -> relax.Expr:
        if op.global_symbol != self.old:
            return op
        self.renamed += 1
        return relax.ExternFunc(self.new)


def export(target: str, dtype: str):
    """The tutorial model's IRModule, with ``create_relax_kvcache``: ``create_tir_paged_kv_cache``
    whose creation call names our function; and its parameters."""
    model = TutorialModel(tvm.target.Target(target), dtype)
    mod, params = model.export_tvm(spec=model.get_default_spec(), debug=False)
    rename = _RenameExtern(mod, CREATE_NATIVE, CREATE_OURS)
    ours = rename.visit_expr(copy_with_new_vars(mod["create_tir_paged_kv_cache"]))
    assert rename.renamed == 1
    mod[OURS] = ours.with_attr("global_symbol", OURS)
    return mod, params


@pytest.fixture(scope="module")
def program():
    mod, params = export("llvm", "float32")
    rng = np.random.default_rng(11)
    weights = [tvm.runtime.tensor((rng.standard_normal(p.shape) * (0.5 if "norm" in name else 0.08)
                                   + (1.0 if "norm" in name else 0.0)).astype("float32"))
               for name, p in params]
    return relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu()), weights


def _create(vm, function: str):
    shape = tvm.runtime.ShapeTuple
    return vm[function](shape([4]), shape([256]), shape([32]), shape([16]))


def test_tutorial_model_on_our_cache_matches_tvms_native_cache(program):
    vm, weights = program
    native = _create(vm, "create_tir_paged_kv_cache")
    with pytest.warns(UserWarning, match="argument 20 .* holds the ragged tree-attention kernel.*TIRPagedKVCache for "
                                         "llvm targets"):
        ours = _create(vm, OURS)
    assert isinstance(ours, rk.PagedAttentionKVCache) and not isinstance(native, rk.PagedAttentionKVCache)
    sources = dict(ours._kernels.sources)  # TVM's CPU tree kernels, each in its own role
    assert sources["attention_prefill_tree"].startswith("argument 21")
    assert sources["attention_prefill_ragged_tree"].startswith("argument 20")
    assert ours.config.rope_ext_factors is None and ours.config.rope_mode == rk.RopeMode.NORMAL

    B, rng = Builtins(), np.random.default_rng(5)
    prompts = {0: rng.integers(0, VOCAB, 21), 1: rng.integers(0, VOCAB, 9)}  # 21: over a page boundary
    steps = [(seq, "prefill", tokens) for seq, tokens in prompts.items()]
    for token in rng.integers(0, VOCAB, (3, 1)):  # each decode round feeds both sequences one token
        steps += [(seq, "decode", token) for seq in prompts]
    logits = {"ours": [], "native": []}
    for name, cache in (("ours", ours), ("native", native)):
        for seq in prompts:
            B.add(cache, seq)
        for seq, fn, tokens in steps:
            embed = vm["embed"](tvm.runtime.tensor(tokens.astype("int32")), weights)
            B.begin(cache, [seq], [len(tokens)])
            out, _ = vm[fn](embed, cache, weights)
            B.end(cache)
            logits[name].append(out.numpy())
    for step, (got, want) in enumerate(zip(logits["ours"], logits["native"])):
        assert np.isfinite(want).all() and np.abs(want).max() > 0.1, step
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"step {step}")
    for step in range(2, len(steps), 2):  # the same token after different prompts: attention reads the cache
        assert np.abs(logits["ours"][step] - logits["ours"][step + 1]).max() > 0.1
    assert ours.get_sequence_length(0) == 24 and ours.get_sequence_length(1) == 12


def test_tutorial_model_compiles_for_cuda():
    """The tutorial's CUDA build (float16): TVM's GPU kernels in its CUDA order, and both creation
    functions, compile into one program (``frontend.compile``: TVM's CUDA pipeline without the
    tensor-core matmul schedule that crashes TVM 0.27 on a model's fp16 matmuls)."""
    target = {"kind": "cuda", "arch": "sm_80"}
    mod, _ = export(target, "float16")
    executable = frontend.compile(mod, target)
    stats = executable.stats()
    for name in (OURS, CREATE_OURS, "create_tir_paged_kv_cache", CREATE_NATIVE):
        assert name in stats
    device = [m for m in executable.mod.imports[0].imports if m.kind == "cuda"]
    assert len(device) == 1
    source = device[0].inspect_source()
    assert "tree_attn_paged_kv_kernel" in source and "batch_tree_attn_kernel" in source


# ------------------------------------------------------------------ the creation arguments one by one

SHAPE = Shape(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, rope_mode=1, max_num_seqs=4,
              max_total_seq_len=256, prefill_chunk_size=32)


def _create_ours(**replaced):
    """Our cache from TVM's creation arguments with TVM's CPU kernels; ``a<i>=value`` replaces one."""
    args = create_args(SHAPE, tvm_kernels(SHAPE))
    for key, value in replaced.items():
        args[int(key[1:])] = value
    return tvm.get_global_func(CREATE_OURS)(*args)


def test_tvm_null_rope_ext_factors_mean_no_factors():
    """TVM's C++ cache reads any non-tensor argument 11 as no factors; its frontends pass
    ``PrimValue(0)``. Ours takes 0 and lists of ones as none too, and refuses other non-tensors
    (factors TVM would drop silently)."""
    for null in (0, np.int64(0), [1.0], [1.0] * D, (1, 1.0), tvm_ffi.Array([1.0, 1.0])):
        cache = _create_ours(a11=null)
        assert cache.config.rope_ext_factors is None and cache.empty()
    for value in (1, 0.0, False, [], [1.0, 2.0], [True], "0", [[1.0]]):
        with pytest.raises(rk.ArgumentError, match=r"rope_ext_factors \(argument 11\) must be None, 0"):
            _create_ours(a11=value)


def test_tree_kernels_in_tvms_llvm_order_are_swapped_back():
    """TVM 0.27's llvm path passes the ragged tree kernel as argument 20 and the paged one as 21.
    Told apart by their parameter counts (14 and 16), each serves its own role: the creation
    probe runs a two-step token tree through both and checks it against float64 attention."""
    k = tvm_kernels(SHAPE)
    with pytest.warns(UserWarning, match=r"argument 20 \(f_attention_prefill_with_tree_mask_paged_kv\) holds the "
                                         r"ragged tree-attention kernel and argument 21 .* the paged one"):
        cache = _create_ours(a20=["tirx", k["tree_attn"]], a21=["tirx", k["tree_attn_paged"]])
    assert cache._kernels.attention_prefill_tree.same_as(k["tree_attn_paged"])
    assert cache._kernels.attention_prefill_ragged_tree.same_as(k["tree_attn"])
    assert cache._kernels.source("attention_prefill_tree") == "argument 21 (f_attention_prefill_with_tree_mask)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TVM's CUDA order (the C++ cache's): no warning
        cache = _create_ours()
    assert cache._kernels.source("attention_prefill_tree") == ("argument 20 "
                                                               "(f_attention_prefill_with_tree_mask_paged_kv)")


def test_kernels_in_a_role_they_cannot_serve_are_refused_naming_the_argument():
    k = tvm_kernels(SHAPE)
    for replaced, match in [
            # parameter counts: refused before anything is built
            (dict(a17=["tirx", k["attention_prefill"]]), r"argument 17 \(f_attention_decode\) is a kernel of 15 "
                                                         r"parameters.*expected the attention_decode kernel, of 13"),
            (dict(a20=["tirx", k["tree_attn"]]), r"argument 20 \(f_attention_prefill_with_tree_mask_paged_kv\) is a "
                                                 "kernel of 14 parameters"),
            (dict(a24=k["copy_single_page"]), r"argument 24 \(f_split_rotary\) is a kernel of 4 parameters"),
            (dict(a23=[k["merge_inplace"], k["attention_decode"]]), r"argument 23 \(f_merge_inplace\[1\]\) is a kernel "
                                                                    "of 13 parameters"),
            # the right count, the wrong role: the creation probe names the argument
            (dict(a21=["tirx", k["attention_prefill_ragged"]]),
             r"creation argument 21 \(f_attention_prefill_with_tree_mask\): the attention_prefill_ragged_tree kernel "
             "fails on this cache's tensors .TypeError"),
            (dict(a13=k["compact_copy"]), r"creation argument 13 \(f_transpose_append_mha\): the transpose_append "
                                          "kernel fails")]:
        with pytest.raises(rk.ConfigError, match=match):
            _create_ours(**replaced)
