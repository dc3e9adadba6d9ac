"""MLA caches (``attn_kinds`` all ``AttnKind.MLA``) against the float64 MLA model (``reference_model.MLAModel``).

DeepSeek-V3's dimensions (kv_lora_rank 512, rope 64, nope 128, v 128) with 4 query heads. Every
step checks both ways of computing MLA against direct attention over decompressed K/V:

* absorbed (data-movement friendly): ``append_mla_kv``, ``cross_attention`` with ``q_nope @ W_UK``
  over the latent pages, ``@ W_UV``; in prefill steps merged with ``self_attention`` over the
  new tokens' decompressed K/V by ``merge_attn_output_inplace`` (TVM's MLA protocol);
* compute friendly: ``self_attention`` merged with ``mla_context_attention``, the cached
  context decompressed chunk by chunk (``context_chunk_size`` 40, so contexts span chunks).

Steps cover prefill, decode, prefix-shared forks (several depths), popn and remove; the latent
rows are read back with ``debug_get_kv_mla``. Outputs are poisoned with NaN before each call.
``RELAX_KVCACHE_TEST_DEVICE=cuda`` runs the same tests in float16 on a GPU with the libraries
``tests/gpu_kernel_libs.py`` prepared.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi

from reference_model import MLAModel, MLAWeights
from relax_kvcache import AttnKind, KVCacheConfig, PagedAttentionKVCache, RopeMode
from relax_kvcache.errors import ConfigError, ForwardError, KVCacheError
from relax_kvcache.kernel_set import KernelSet
from support.snapshot import assert_same, snapshot
from support.mla_kernel_cases import cache_config

ON_GPU = os.environ.get("RELAX_KVCACHE_TEST_DEVICE") == "cuda"
DEV = tvm.cuda() if ON_GPU else tvm.cpu()
DTYPE = "float16" if ON_GPU else "float32"
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[DTYPE]
TOL = {"float32": 2e-3, "float16": 2e-2}[DTYPE]
CONFIG = cache_config(DTYPE)
LORA, ROPE = CONFIG.v_head_dim, CONFIG.head_dim - CONFIG.v_head_dim
NOPE, VDIM = CONFIG.mla_original_qk_head_dim - ROPE, CONFIG.mla_original_v_head_dim
HEADS, LAYERS = CONFIG.num_qo_heads, CONFIG.num_layers
SM_SCALE = (NOPE + ROPE) ** -0.5


@pytest.fixture(scope="module")
def mla_kernels(kernel_build):
    return KernelSet.from_module(kernel_build(CONFIG))


@pytest.fixture
def mla_cache(mla_kernels):
    return PagedAttentionKVCache(CONFIG, DEV, kernels=mla_kernels)


def _t(x):
    return tvm.runtime.tensor(np.ascontiguousarray(x).astype(NP_DTYPE), DEV)


def _poisoned(shape, dtype=DTYPE):
    return tvm.runtime.tensor(np.full(shape, np.nan, dtype=np.float32).astype(
        NP_DTYPE if dtype == DTYPE else np.float32), DEV)


def _as64(t):
    return t.numpy().astype(np.float64)


class Harness:
    """Drives a cache and the float64 model with the same random inputs."""

    def __init__(self, cache: PagedAttentionKVCache, seed: int, latent_values=None) -> None:
        self.cache, self.rng = cache, np.random.default_rng(seed)
        self.weights = MLAWeights.draw(self.rng, HEADS, LORA, NOPE, VDIM)
        self.model = MLAModel(LAYERS, LORA + ROPE)
        # latent rows of a layer's step: latent_values(rng, layer, shape) -> float64 values the
        # cache stores exactly (default: random values of the cache dtype)
        self.latent_values = latent_values or (lambda rng, layer, shape: self._rounded(shape))

    def _rounded(self, shape):
        return self.rng.standard_normal(shape).astype(NP_DTYPE).astype(np.float64)

    def add(self, seq_id):
        self.cache.add_sequence(seq_id)
        self.model.add(seq_id)

    def fork(self, parent, child, pos):
        self.cache.fork_sequence(parent, child, pos)
        self.model.fork(parent, child, pos)

    def popn(self, seq_id, n):
        self.cache.popn(seq_id, n)
        self.model.popn(seq_id, n)

    def remove(self, seq_id):
        self.cache.remove_sequence(seq_id)
        del self.model.seqs[seq_id]

    def decompress(self, latent, k, v):
        """The ``decompress`` callback of ``mla_context_attention``: latent rows -> K, V."""
        keys, values = self.weights.keys_values(_as64(latent))
        k.copyfrom(keys.astype(NP_DTYPE))
        v.copyfrom(values.astype(NP_DTYPE))

    def step(self, batch):
        """One forward step over ``batch = [(seq_id, n), ...]``; checks every layer both ways."""
        cache, w = self.cache, self.weights
        seq_ids, lengths = [s for s, _ in batch], [n for _, n in batch]
        total = sum(lengths)
        cache.begin_forward(seq_ids, lengths)
        for layer in range(LAYERS):
            latent = self.latent_values(self.rng, layer, (total, LORA + ROPE))
            q = self._rounded((total, HEADS, NOPE + ROPE))
            offset = 0
            for seq_id, n in batch:
                self.model.append(seq_id, layer, latent[offset:offset + n])
                offset += n
            expected = [self.model.expected(w, s, layer, q[o:o + n], SM_SCALE)
                        for (s, n), o in zip(batch, np.cumsum([0] + lengths[:-1]))]
            o_ref = np.concatenate([e[0] for e in expected])
            lse_ref = np.concatenate([e[1] for e in expected])
            cache.append_mla_kv(layer, _t(latent))
            k_new, v_new = w.keys_values(latent)
            decode = all(n == 1 for n in lengths)
            self._check_absorbed(layer, q, k_new, v_new, decode, o_ref, lse_ref)
            self._check_compute(layer, q, k_new, v_new, o_ref, lse_ref)
        cache.end_forward()
        self.check_rows(seq_ids)

    def _self_attention(self, layer, q, k_new, v_new):
        n = q.shape[0]
        o, lse = _poisoned((n, HEADS, VDIM)), _poisoned((n, HEADS), "float32")
        self.cache.self_attention(layer, _t(q), _t(k_new), _t(v_new), o, lse, SM_SCALE)
        return o, lse

    def _check_absorbed(self, layer, q, k_new, v_new, decode, o_ref, lse_ref):
        n = q.shape[0]
        o_lat, lse = _poisoned((n, HEADS, LORA)), _poisoned((n, HEADS), "float32")
        self.cache.cross_attention(layer, _t(self.weights.absorb(q)), o_lat, lse, SM_SCALE)
        o_cross = _t(self.weights.up_v(_as64(o_lat)))
        if decode:  # the pages already hold the new tokens
            o = o_cross
        else:
            o, lse_self = self._self_attention(layer, q, k_new, v_new)
            _, lse = self.cache.merge_attn_output_inplace(o, lse_self, o_cross, lse)
        _assert_state("absorbed", o, lse, o_ref, lse_ref)

    def _check_compute(self, layer, q, k_new, v_new, o_ref, lse_ref):
        n = q.shape[0]
        o, lse = self._self_attention(layer, q, k_new, v_new)
        o_ctx, lse_ctx = _poisoned((n, HEADS, VDIM)), _poisoned((n, HEADS), "float32")
        self.cache.mla_context_attention(layer, _t(q), o_ctx, lse_ctx, SM_SCALE, self.decompress)
        self.cache.merge_attn_output_inplace(o, lse, o_ctx, lse_ctx)
        _assert_state("chunked context", o, lse, o_ref, lse_ref)

    def check_rows(self, seq_ids):
        for seq_id in seq_ids:
            rows = self.model.seqs[seq_id]
            out = _poisoned(rows.shape)
            self.cache.debug_get_kv_mla(seq_id, 0, rows.shape[1], out)
            np.testing.assert_array_equal(_as64(out), rows, err_msg=f"latent rows of sequence {seq_id}")


def _assert_state(what, o, lse, o_ref, lse_ref):
    np.testing.assert_allclose(_as64(o), o_ref, rtol=TOL, atol=TOL, err_msg=f"{what}: o")
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=0, atol=max(TOL, 1e-3), err_msg=f"{what}: lse")


def test_prefill_then_decode(mla_cache):
    h = Harness(mla_cache, seed=1)
    for s in range(3):
        h.add(s)
    h.step([(0, 23), (1, 7), (2, 1)])  # nothing cached: the context is empty
    h.step([(0, 1), (1, 1), (2, 1)])  # decode
    h.step([(1, 50), (2, 33)])  # prefill over a context
    for _ in range(3):
        h.step([(0, 1), (1, 1), (2, 1)])
    h.add(3)
    h.step([(3, 12), (0, 1), (1, 5)])  # a new sequence beside cached ones


def test_chunked_context_spans_chunks(mla_cache):
    """Contexts of 45-150 tokens walked in chunks of 40 rows; sequences straddle chunks."""
    h = Harness(mla_cache, seed=2)
    for s in range(3):
        h.add(s)
    h.step([(0, 150), (1, 45)])
    h.step([(2, 83), (1, 2)])
    h.step([(0, 17), (1, 9), (2, 30)])
    h.step([(2, 1), (0, 1)])


def test_forks_share_prefixes(mla_cache):
    """Children forked at several positions (inside and at page ends) attend over shared pages."""
    h = Harness(mla_cache, seed=3)
    h.add(0)
    h.step([(0, 70)])
    h.fork(0, 1, 32)
    h.fork(0, 2, 45)
    h.fork(0, 3, -1)
    h.step([(1, 9), (2, 4), (3, 1), (0, 1)])
    h.fork(2, 4, 40)
    h.fork(1, 5, -1)
    h.step([(4, 6), (5, 1), (2, 2)])
    h.step([(s, 1) for s in range(6)])
    h.popn(3, 5)
    h.popn(2, 20)
    h.remove(1)
    h.step([(3, 3), (2, 1), (5, 1)])
    h.check_rows([0, 2, 3, 4, 5])


def test_bad_input_leaves_the_cache_unchanged(mla_cache):
    h = Harness(mla_cache, seed=4)
    h.add(0)
    h.step([(0, 20)])
    cache = mla_cache
    before = _poisoned((LAYERS, 20, LORA + ROPE))
    cache.debug_get_kv_mla(0, 0, 20, before)
    cache.begin_forward([0], [3])
    with pytest.raises(ForwardError, match=r"kv has shape \(3, 512\), expected \(\*, 576\)"):
        cache.append_mla_kv(0, _t(np.ones((3, LORA))))
    with pytest.raises(ForwardError, match="fewer than the 3 tokens"):
        cache.append_mla_kv(0, _t(np.ones((2, LORA + ROPE))))
    with pytest.raises(ForwardError, match="layer_id 5 is out of range"):
        cache.append_mla_kv(5, _t(np.ones((3, LORA + ROPE))))
    with pytest.raises(KVCacheError, match="attention_with_fused_qkv needs MHA layers"):
        cache.attention_with_fused_qkv(0, _t(np.ones((3, HEADS + 2, LORA + ROPE))), _poisoned((3, HEADS, LORA + ROPE)), 1.0)
    with pytest.raises(ForwardError, match="decompress must be callable"):
        cache.mla_context_attention(0, _t(np.ones((3, HEADS, NOPE + ROPE))), _poisoned((3, HEADS, VDIM)),
                                    _poisoned((3, HEADS), "float32"), 1.0, None)
    with pytest.raises(ForwardError, match=r"q has shape \(3, 4, 576\), expected \(3, 4, 192\)"):
        cache.self_attention(0, _t(np.ones((3, HEADS, LORA + ROPE))), _t(np.ones((3, HEADS, 192))),
                             _t(np.ones((3, HEADS, VDIM))), _poisoned((3, HEADS, VDIM)), _poisoned((3, HEADS), "float32"), 1.0)
    cache.end_forward()
    with pytest.raises(KVCacheError, match="debug_get_kv needs MHA layers"):
        cache.debug_get_kv(0, 0, 1, before, before)
    with pytest.raises(ForwardError, match="token-tree attention is not supported for MLA"):
        cache.begin_forward([0], [2], [-1, 0])
    assert cache.get_sequence_length(0) == 20 + 3  # the aborted step's reservation stays (as for MHA)
    after = _poisoned((LAYERS, 20, LORA + ROPE))
    cache.debug_get_kv_mla(0, 0, 20, after)
    np.testing.assert_array_equal(after.numpy(), before.numpy())


def test_decompress_callback_cannot_reenter_the_cache(mla_cache):
    """Regression: a ``decompress`` callback that ends the step and begins another, or
    calls ``mla_context_attention`` again, made the outer call run kernels over the new step's
    metadata (a crash) or clobber its workspace (wrong results). Calls from inside the callback
    raise; the outer call then raises that error and the cache is as before; after it the same
    step works normally and matches the float64 model."""
    h = Harness(mla_cache, seed=6)
    h.add(0)
    h.step([(0, 50)])  # 50 cached rows: two chunks of 40
    cache = mla_cache
    cache.begin_forward([0], [2])
    q, o, lse = _t(np.ones((2, HEADS, NOPE + ROPE))), _poisoned((2, HEADS, VDIM)), _poisoned((2, HEADS), "float32")
    reentries = {
        "end_forward": lambda: cache.end_forward(),
        "begin_forward": lambda: cache.begin_forward([0], [1]),
        "clear": lambda: cache.clear(),
        "mla_context_attention": lambda: cache.mla_context_attention(0, q, _poisoned((2, HEADS, VDIM)),
                                                                     _poisoned((2, HEADS), "float32"), 1.0,
                                                                     h.decompress),
        "append_mla_kv": lambda: cache.append_mla_kv(0, _t(np.ones((2, LORA + ROPE)))),
        "popn": lambda: cache.popn(0, 1),
        "add_sequence": lambda: cache.add_sequence(77),  # was accepted
        "fork_sequence": lambda: cache.fork_sequence(0, 78, 10),
        "remove_sequence": lambda: cache.remove_sequence(0),
        "commit_accepted_token_tree_nodes": lambda: cache.commit_accepted_token_tree_nodes([0], [-1]),
    }
    before = _poisoned((LAYERS, 50, LORA + ROPE))
    cache.debug_get_kv_mla(0, 0, 50, before)
    for what, call in reentries.items():
        def reenter(latent, k, v, call=call):
            h.decompress(latent, k, v)
            call()

        with pytest.raises(ForwardError, match=f"{what} called from inside mla_context_attention's decompress"):
            cache.mla_context_attention(0, q, o, lse, SM_SCALE, reenter)
    assert cache.get_sequence_length(0) == 52 and cache._paging.seq_ids() == [0]
    after = _poisoned((LAYERS, 50, LORA + ROPE))
    cache.debug_get_kv_mla(0, 0, 50, after)
    np.testing.assert_array_equal(after.numpy(), before.numpy())
    cache.end_forward()
    cache.popn(0, 2)  # the step the model did not see
    h.step([(0, 3)])  # the cache still works and agrees with the model


def test_outputs_aliasing_the_context_workspace_are_refused(mla_cache):
    """An ``o`` or ``q`` aliasing the context workspace (a view kept from a callback) raises, the
    cache unchanged; a correct call afterwards matches the float64 model."""
    h = Harness(mla_cache, seed=8)
    h.add(0)
    h.step([(0, 50)])  # two chunks of 40 rows
    cache = mla_cache
    cache.begin_forward([0], [2])
    q, lse = _t(np.random.default_rng(1).standard_normal((2, HEADS, NOPE + ROPE))), _poisoned((2, HEADS), "float32")
    kept = {}

    def keeps_k(latent, k, v):  # a correct callback that keeps a view of the workspace
        h.decompress(latent, k, v)
        kept["k"] = k

    before = snapshot(cache, pages=True)
    cache.mla_context_attention(0, q, _poisoned((2, HEADS, VDIM)), lse, SM_SCALE, keeps_k)
    from relax_kvcache.tensors import view

    o_alias = view(kept["k"], (2, HEADS, VDIM), 0)
    with pytest.raises(ForwardError, match="o shares memory with the context workspace's k"):
        cache.mla_context_attention(0, q, o_alias, lse, SM_SCALE, h.decompress)
    q_alias = view(kept["k"], (2, HEADS, NOPE + ROPE), 0)
    with pytest.raises(ForwardError, match="q shares memory with the context workspace's k"):
        cache.mla_context_attention(0, q_alias, _poisoned((2, HEADS, VDIM)), lse, SM_SCALE, h.decompress)
    assert_same(before, snapshot(cache, pages=True))
    cache.end_forward()
    cache.popn(0, 2)
    h.step([(0, 3)])


def test_latent_rows_holding_nan_are_used_as_given(mla_cache):
    """Latent rows holding NaN are stored and decompressed as given: NaN in, NaN out."""
    h = Harness(mla_cache, seed=9)
    cache = mla_cache
    rows = np.full((3, LORA + ROPE), np.nan, dtype=NP_DTYPE)
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    for layer in range(LAYERS):
        cache.append_mla_kv(layer, tvm.runtime.tensor(rows, DEV))
    cache.end_forward()
    cache.begin_forward([0], [2])
    q, o = _t(np.random.default_rng(2).standard_normal((2, HEADS, NOPE + ROPE))), _poisoned((2, HEADS, VDIM))
    o.copyfrom(np.zeros((2, HEADS, VDIM), NP_DTYPE))  # NaN below comes from the rows, not the poison
    cache.mla_context_attention(0, q, o, _poisoned((2, HEADS), "float32"), SM_SCALE, h.decompress)
    assert np.isnan(o.numpy()).all()  # NaN in, NaN out
    cache.end_forward()


def test_context_workspace_is_allocated_with_the_cache(mla_kernels):
    """Regression: the workspace was allocated at the first mla_context_attention;
    an absurd context_chunk_size then raised TVM's bad_alloc mid-step. It is sized at
    construction (never beyond the pages' rows) and checked with the config."""
    import dataclasses

    fields = {f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG)}
    with pytest.raises(ConfigError, match="MLA context workspace would take"):
        KVCacheConfig(**{**fields, "context_chunk_size": 10**9, "max_total_seq_len": 2**31 - 1, "num_qo_heads": 512})
    huge_chunk = KVCacheConfig(**{**fields, "context_chunk_size": 10**9})  # capped by the 2048-token pool
    cache = PagedAttentionKVCache(huge_chunk, DEV, kernels=mla_kernels)
    assert cache._attention.workspace.k.shape[0] == huge_chunk.num_total_pages * huge_chunk.page_size


def test_context_longer_than_the_pages_is_chunked_by_the_workspace(mla_kernels):
    """Regression: a step's context counts a shared prefix once per sequence, so it
    can be longer than the pool's rows, which cap the workspace; the step was chunked by the
    uncapped context_chunk_size and viewed rows beyond the workspace (TVM's ValueError)."""
    import dataclasses

    config = dataclasses.replace(CONFIG, max_total_seq_len=128, context_chunk_size=10**9)
    assert config.context_workspace_rows == 144
    h = Harness(PagedAttentionKVCache(config, DEV, kernels=mla_kernels), seed=9)
    h.add(0)
    h.step([(0, 64)])
    h.fork(0, 1, -1)
    h.fork(0, 2, -1)
    h.step([(0, 1), (1, 1), (2, 1)])  # 3 x 64 cached rows: two chunks of the 144-row workspace
    h.step([(2, 5), (1, 1)])


def _creation_args(f, *, ragged="attention_prefill_ragged", merges=("merge_inplace", "merge_general")):
    """TVM's positional creation arguments of ``CONFIG`` with the kernels of module function ``f``."""
    return [
        tvm.runtime.ShapeTuple([16, 2048, 256, 16, 0]), tvm.runtime.ShapeTuple([0, LAYERS]), HEADS, 1,
        LORA + ROPE, LORA, tvm.runtime.ShapeTuple([int(AttnKind.MLA)] * LAYERS), False, int(RopeMode.NONE), 1.0,
        10000.0, None, tvm.runtime.empty((), DTYPE, DEV),
        None, f("transpose_append_mla"), ["tirx", f(ragged)], [], [], [], [], [], [],
        ["tirx", f("attention_prefill_mla")], [f(name) for name in merges], None, f("copy_single_page"),
        f("debug_get_kv"), None,
    ]


def test_created_caches_read_the_decompressed_head_dims_off_their_kernels(kernel_build):
    """Regression: TVM's creation arguments carry no decompressed head dims, so a
    created cache accepted any in self_attention, merge_attn_output_inplace and
    mla_context_attention (its callback ran), and the kernel raised TVM's ValueError. It reads
    them off the ragged and merge kernels, and refuses other dims before anything runs."""
    create = tvm_ffi.get_global_func("relax_kvcache.paged_attention_kv_cache_create")
    cache = create(*_creation_args(kernel_build(CONFIG).get_function))
    assert (cache.config.mla_original_qk_head_dim, cache.config.mla_original_v_head_dim) == (NOPE + ROPE, VDIM)
    rng = np.random.default_rng(11)
    t = lambda *shape: _t(rng.standard_normal(shape))  # noqa: E731
    cache.add_sequence(0)
    cache.begin_forward([0], [9])
    cache.append_mla_kv(0, t(9, LORA + ROPE))
    cache.end_forward()
    cache.begin_forward([0], [3])
    calls = []
    before = snapshot(cache, pages=True)
    with pytest.raises(ForwardError, match=r"q has shape \(3, 4, 64\), expected \(3, 4, 192\)"):
        cache.self_attention(0, t(3, HEADS, 64), t(3, HEADS, 64), t(3, HEADS, 32), _poisoned((3, HEADS, 32)),
                             _poisoned((3, HEADS), "float32"), SM_SCALE)
    with pytest.raises(ForwardError, match=r"o_self_attn has shape \(3, 4, 8\)"):
        cache.merge_attn_output_inplace(t(3, HEADS, 8), t(3, HEADS), t(3, HEADS, 8), t(3, HEADS))
    with pytest.raises(ForwardError, match=r"q has shape \(3, 4, 64\)"):
        cache.mla_context_attention(0, t(3, HEADS, 64), _poisoned((3, HEADS, 32)), _poisoned((3, HEADS), "float32"),
                                    SM_SCALE, lambda *a: calls.append(a))
    assert not calls
    q, o, lse = t(3, HEADS, NOPE + ROPE), _poisoned((3, HEADS, VDIM)), _poisoned((3, HEADS), "float32")
    with pytest.raises(ForwardError, match="decompress must be callable"):
        cache.mla_context_attention(0, q, o, lse, SM_SCALE, None)
    with pytest.raises(KVCacheError, match="sm_scale"):
        cache.mla_context_attention(0, q, o, lse, None, lambda *a: calls.append(a))
    assert not calls and cache._attention.workspace is None  # made at the first call that runs (code audit)
    assert_same(before, snapshot(cache, pages=True))
    cache.end_forward()


@pytest.mark.parametrize("swap", ["ragged", "merges"])
def test_created_caches_refuse_kernels_in_the_wrong_role(kernel_build, swap):
    """Regression: the ragged and merge kernels of created MLA caches were not
    probed, so the absorbed kernel passed as the ragged one, or the two merges swapped, were
    accepted and failed in a later step."""
    f = kernel_build(CONFIG).get_function
    args = (_creation_args(f, ragged="attention_prefill_mla") if swap == "ragged"
            else _creation_args(f, merges=("merge_general", "merge_inplace")))
    match = (r"argument 15 \(f_attention_prefill_ragged\) is a kernel of 10 parameters" if swap == "ragged"
             else "accepts no")  # the absorbed kernel's parameter count is not the ragged one's
    with pytest.raises(ConfigError, match=match):
        tvm_ffi.get_global_func("relax_kvcache.paged_attention_kv_cache_create")(*args)


@pytest.mark.parametrize("changes, message", [
    (dict(attn_kinds=[AttnKind.MLA, AttnKind.MHA]), "mixes MLA with other kinds"),
    (dict(num_kv_heads=2, num_qo_heads=4), "num_kv_heads must be 1 for MLA"),
    (dict(v_head_dim=LORA + ROPE), r"v_head_dim \(kv_lora_rank\) < head_dim"),
    (dict(head_dim=2048), "at most 1024"),
    (dict(support_sliding_window=True), "support_sliding_window is not supported for MLA"),
    (dict(mla_original_v_head_dim=None), "must be given together"),
])
def test_bad_configs(changes, message):
    import dataclasses

    fields = {f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG)}
    fields.update(changes)
    with pytest.raises(ConfigError, match=message):
        KVCacheConfig(**fields)


def test_builtins_and_creation_match_the_python_api(mla_kernels, kernel_build):
    """``relax_kvcache.paged_attention_kv_cache_create`` with TVM's MLA arguments, driven through
    the ``vm.builtin`` functions, gives bit-identical results to the Python API."""
    args = _creation_args(kernel_build(CONFIG).get_function)
    created = tvm_ffi.get_global_func("relax_kvcache.paged_attention_kv_cache_create")(*args)
    assert isinstance(created, PagedAttentionKVCache) and created.config.is_mla
    direct = PagedAttentionKVCache(CONFIG, DEV, kernels=mla_kernels)
    g = {name: tvm_ffi.get_global_func(f"vm.builtin.{name}") for name in (
        "kv_state_add_sequence", "kv_state_begin_forward", "kv_state_end_forward",
        "attention_kv_cache_append_mla_kv", "attention_kv_cache_cross_attention",
        "attention_kv_cache_debug_get_kv_mla")}
    outputs = {}
    for name, cache in (("created", created), ("direct", direct)):
        rng = np.random.default_rng(5)
        results = []
        for seq_id, n in ((0, 30), (0, 1)):
            if n == 30:
                g["kv_state_add_sequence"](cache, seq_id)
            g["kv_state_begin_forward"](cache, tvm.runtime.ShapeTuple([seq_id]), tvm.runtime.ShapeTuple([n]), None)
            latent = _t(rng.standard_normal((n, LORA + ROPE)))
            q = _t(rng.standard_normal((n, HEADS, LORA + ROPE)))
            assert g["attention_kv_cache_append_mla_kv"](cache, 0, latent) is cache
            o, lse = _poisoned((n, HEADS, LORA)), _poisoned((n, HEADS), "float32")
            g["attention_kv_cache_cross_attention"](cache, 0, SM_SCALE, q, o, lse)
            results += [o.numpy(), lse.numpy()]
            g["kv_state_end_forward"](cache)
        rows = _poisoned((LAYERS, 31, LORA + ROPE))
        g["attention_kv_cache_debug_get_kv_mla"](cache, 0, 0, 31, rows)
        outputs[name] = results + [rows.numpy()[0]]
    for a, b in zip(outputs["created"], outputs["direct"]):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(outputs["direct"][2]).any()



@pytest.mark.skipif(ON_GPU, reason="compiles a Relax model (needs the full TVM)")
def test_relax_model_path():
    """A Relax program written with ``relax_kvcache.frontend`` (MLA layout): prefill through
    ``append_mla_kv`` + ``self_attention`` + ``cross_attention`` + merge, then absorbed decode,
    both against the float64 model."""
    from tvm import relax
    from tvm.relax.frontend import nn

    from relax_kvcache import frontend

    layout = frontend.CacheLayout(num_layers=1, num_qo_heads=HEADS, num_kv_heads=1, head_dim=LORA + ROPE,
                                  v_head_dim=LORA, rope_mode=RopeMode.NONE, dtype="float32",
                                  attn_kinds=[AttnKind.MLA], mla_original_qk_head_dim=NOPE + ROPE,
                                  mla_original_v_head_dim=VDIM)

    def up_v(o_latent, w_uv):  # (1, n, H, L) @ (H, L, V) per head -> (1, n, H, V)
        return nn.op.permute_dims(nn.op.matmul(nn.op.permute_dims(o_latent, [0, 2, 1, 3]), w_uv), [0, 2, 1, 3])

    class Program(nn.Module):
        def create_kv_cache(self, max_batch_size: tvm.tirx.Var, max_total_seq_len: tvm.tirx.Var,
                            prefill_chunk_size: tvm.tirx.Var):
            return frontend.PagedKVCache.create(layout, "llvm", max_batch_size=max_batch_size,
                                                max_total_seq_len=max_total_seq_len,
                                                prefill_chunk_size=prefill_chunk_size)

        def prefill(self, latent, q_abs, q, k, v, w_uv, cache: frontend.PagedKVCache):
            cache = cache.append_mla_kv(0, latent)
            o, lse = cache.self_attention(0, q, k, v, SM_SCALE)
            o_latent, lse_cross = cache.cross_attention(0, q_abs, LORA, SM_SCALE)
            return cache.merge_attn_output_inplace(o, lse, up_v(o_latent, w_uv), lse_cross)[0]

        def decode(self, latent, q_abs, w_uv, cache: frontend.PagedKVCache):
            cache = cache.append_mla_kv(0, latent)
            return up_v(cache.cross_attention(0, q_abs, LORA, SM_SCALE)[0], w_uv)

    tensor = lambda *shape: nn.spec.Tensor(list(shape), "float32")  # noqa: E731
    obj = nn.spec.Object(object_type=frontend.PagedKVCache)
    mod, _ = Program().export_tvm(spec={
        "create_kv_cache": {"max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int},
        "prefill": {"latent": tensor(1, "n", 1, LORA + ROPE), "q_abs": tensor(1, "n", HEADS, LORA + ROPE),
                    "q": tensor(1, "n", HEADS, NOPE + ROPE), "k": tensor(1, "n", HEADS, NOPE + ROPE),
                    "v": tensor(1, "n", HEADS, VDIM), "w_uv": tensor(HEADS, LORA, VDIM), "cache": obj},
        "decode": {"latent": tensor("b", 1, 1, LORA + ROPE), "q_abs": tensor("b", 1, HEADS, LORA + ROPE),
                   "w_uv": tensor(HEADS, LORA, VDIM), "cache": obj},
    }, debug=False)
    vm = relax.VirtualMachine(frontend.compile(mod, "llvm"), tvm.cpu())
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_kv_cache"](shape([4]), shape([512]), shape([64]))
    assert isinstance(cache, PagedAttentionKVCache) and cache.config.is_mla

    rng = np.random.default_rng(6)
    w = MLAWeights.draw(rng, HEADS, LORA, NOPE, VDIM)
    model = MLAModel(1, LORA + ROPE)
    cpu = lambda x: tvm.runtime.tensor(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
    w_uv = cpu(w.w_uv)
    begin = tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")
    end = tvm_ffi.get_global_func("vm.builtin.kv_state_end_forward")
    for s in (0, 1):
        tvm_ffi.get_global_func("vm.builtin.kv_state_add_sequence")(cache, s)
        model.add(s)
    for batch in ([(0, 21)], [(1, 9)], [(0, 1), (1, 1)], [(1, 12)], [(1, 1), (0, 1)]):
        n = sum(length for _, length in batch)
        latent = rng.standard_normal((n, LORA + ROPE)).astype(np.float32).astype(np.float64)
        q = rng.standard_normal((n, HEADS, NOPE + ROPE)).astype(np.float32).astype(np.float64)
        offset, expected = 0, []
        for s, length in batch:
            model.append(s, 0, latent[offset:offset + length])
            expected.append(model.expected(w, s, 0, q[offset:offset + length], SM_SCALE)[0])
            offset += length
        begin(cache, shape([s for s, _ in batch]), shape([length for _, length in batch]), None)
        if n == len(batch):  # decode: one token per sequence
            got = vm["decode"](cpu(latent[:, None, None]), cpu(w.absorb(q)[:, None]), w_uv, cache)
        else:
            k, v = w.keys_values(latent)
            got = vm["prefill"](cpu(latent[None, :, None]), cpu(w.absorb(q)[None]), cpu(q[None]), cpu(k[None]),
                                cpu(v[None]), w_uv, cache)
        end(cache)
        np.testing.assert_allclose(got.numpy().reshape(n, HEADS, VDIM), np.concatenate(expected), rtol=TOL, atol=TOL)
