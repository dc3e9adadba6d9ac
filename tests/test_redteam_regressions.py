"""Regressions of faults found by adversarial testing of the public API.

Each case raised too late, raised the wrong exception, crashed, or silently accepted bad input
before; each must now raise our exception naming the problem and leave the cache unchanged
(full snapshots: paging state, raw pages, every sequence's K/V).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import tvm
import tvm_ffi

import relax_kvcache as rk
from support.snapshot import assert_same, snapshot
from relax_kvcache.kernel_set import KernelSet
from test_errors import CFG, _step, _t


@pytest.fixture()
def cache():
    c = rk.PagedAttentionKVCache(CFG, tvm.cpu())
    c.add_sequence(0)
    _step(c, np.random.default_rng(0), [0], [21])
    return c


def _unchanged(cache, call, error, match):
    before = snapshot(cache, pages=True)
    with pytest.raises(error, match=match):
        call()
    assert_same(before, snapshot(cache, pages=True))


def test_kernels_built_for_another_config_are_refused(cache):
    """Kernels of another page size used to run: fork then failed halfway (a child without its
    page copy); other RoPE constants gave silently wrong K. Now the constructor names the field."""
    for change, field in [(dict(page_size=16), "page_size"), (dict(rope_theta=500.0), "rope_theta"),
                          (dict(head_dim=64, v_head_dim=64), "head_dim"), (dict(dtype="float16"), "dtype")]:
        with pytest.raises(rk.ConfigError, match=f"{field} .* \\(kernels\\) vs"):
            rk.PagedAttentionKVCache(dataclasses.replace(CFG, **change), tvm.cpu(), kernels=cache._kernels)
    # the same spec with other sizes is fine (kernels do not depend on them)
    rk.PagedAttentionKVCache(dataclasses.replace(CFG, max_num_seqs=3, max_total_seq_len=64), tvm.cpu(),
                             kernels=cache._kernels)


def test_kernel_identity_follows_the_kernel_set_spec():
    """``build.kernel_identity`` reads the config (a runtime-only host cannot make specs); it must
    tell two configs apart exactly when their kernel set specs differ."""
    from relax_kvcache.build import kernel_identity, kernel_set_spec
    from test_windows import _layer_window_config

    mla = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=576, v_head_dim=512,
                           mla_original_qk_head_dim=192, mla_original_v_head_dim=128, page_size=16,
                           rope_mode=rk.RopeMode.NONE, dtype="float16", attn_kinds=[rk.AttnKind.MLA])
    chunked = _layer_window_config(attn_kinds=[rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA, rk.AttnKind.MHA],
                                   attention_chunk_size=20)  # the same size as the window: other kernels
    configs = [CFG, _layer_window_config(), chunked, dataclasses.replace(chunked, attention_chunk_size=32), mla]
    changes = [dict(page_size=16), dict(rope_theta=500.0), dict(rope_scale=0.5), dict(dtype="bfloat16"),
               dict(num_qo_heads=8), dict(num_kv_heads=1), dict(support_sliding_window=True),
               dict(rope_mode=rk.RopeMode.NONE), dict(max_total_seq_len=64, max_num_seqs=2, prefill_chunk_size=16)]
    configs += [dataclasses.replace(CFG, **change) for change in changes]
    configs += [dataclasses.replace(mla, **change) for change in (dict(mla_original_v_head_dim=64), dict(rope_theta=5.0),
                                                                  dict(num_qo_heads=8))]
    for a in configs:
        for b in configs:
            assert (kernel_identity(a) == kernel_identity(b)) == (kernel_set_spec(a) == kernel_set_spec(b)), (a, b)


def test_kernel_sets_without_required_kernels_are_refused(cache):
    """None in TVM's creation arguments used to fail at the first step, after appending K/V."""
    for role in ("attention_decode", "attention_prefill", "split_rotary", "transpose_append"):
        with pytest.raises(rk.ConfigError, match=role):
            rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(cache._kernels, **{role: None}))
    no_trees = rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(
        cache._kernels, attention_prefill_tree=None))
    no_trees.add_sequence(0)
    _unchanged(no_trees, lambda: no_trees.begin_forward([0], [2], [-1, 0]), rk.KVCacheError,
               "attention_prefill_tree")


def test_tensors_that_share_memory_are_refused(cache):
    n = 2
    cache.begin_forward([0], [n])
    q = _t((n, 4, 32))
    for call, what in [
        (lambda: cache.cross_attention(0, q, q, _t((n, 4)), 0.2), "o shares memory with q"),
        (lambda: cache.self_attention(0, q, _t((n, 2, 32)), _t((n, 2, 32)), q, _t((n, 4)), 0.2),
         "o shares memory with q"),
    ]:
        _unchanged(cache, call, rk.ForwardError, what)
    o = tvm.runtime.empty((n, 4, 32), "float32")
    lse_over_o = tvm.runtime._ffi_api.TVMTensorCreateView(o, (n, 4), o.dtype, 0)
    _unchanged(cache, lambda: cache.cross_attention(0, q, o, lse_over_o, 0.2), rk.ForwardError,
               "o shares memory with lse")
    cache.end_forward()
    k = tvm.runtime.empty((2, 5, 2, 32), "float32")
    _unchanged(cache, lambda: cache.debug_get_kv(0, 0, 5, k, k), rk.ForwardError, "k_data shares memory with v_data")


def test_float32_overflowing_scales(cache):
    cache.begin_forward([0], [1])
    for scale in (1e39, -1e39):
        _unchanged(cache, lambda: cache.attention_with_fused_qkv(0, _t((1, 8, 32)), _t((1, 4, 32)), scale),
                   rk.ForwardError, "float32")
    cache.end_forward()


@pytest.mark.parametrize("changes, message", [
    (dict(rope_theta=10**400), "rope_theta must be a finite float32"),
    (dict(rope_theta=1e-320), "rope_theta must be positive"),
    (dict(rope_scale=1e39), "rope_scale must be a finite float32"),
    (dict(rope_mode=1.0), "rope_mode must be"),
    (dict(rope_mode=True), "rope_mode must be"),
    (dict(dtype=np.dtype("int8")), "dtype must be one of"),
])
def test_config_values_the_kernels_cannot_hold(changes, message):
    with pytest.raises(rk.ConfigError, match=message):
        dataclasses.replace(CFG, **changes)


def test_config_accepts_numpy_and_dtype_objects():
    cfg = dataclasses.replace(CFG, num_layers=np.int64(2), dtype=np.dtype("float32"), rope_theta=np.float32(1e4),
                              rope_mode=np.int64(1))
    assert (cfg.num_layers, cfg.dtype, cfg.rope_theta, cfg.rope_mode) == (2, "float32", 1e4, rk.RopeMode.NORMAL)
    assert type(cfg.num_layers) is int and cfg == CFG


def test_negative_device_index_is_refused():
    with pytest.raises(rk.ConfigError, match="negative index"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(-1))


def test_cli_demo_and_deploy_errors_are_one_line(tmp_path):
    from relax_kvcache import deploy

    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a library")
    with pytest.raises(deploy.DeployError, match="could not load"):
        deploy.load(bogus)
    for args in (["--load", str(tmp_path / "missing.so")], ["--load", str(bogus)]):
        run = subprocess.run([sys.executable, "-m", "relax_kvcache.cli", "demo", *args], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "error:" in run.stderr, run.stderr


# ---------------------------------------------------------------------------- second round


def test_more_kernels_are_required(cache):
    """copy_single_page and the merges are called halfway through forks and prefix steps."""
    for role in ("copy_single_page", "merge_inplace", "merge_general"):
        with pytest.raises(rk.ConfigError, match=role):
            rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(cache._kernels, **{role: None}))


def test_creation_refuses_a_null_init_tensor(cache):
    from relax_kvcache.ffi_registry.create import paged_attention_kv_cache_create

    args = [tvm.runtime.ShapeTuple([4, 128, 32, 8, 0]), tvm.runtime.ShapeTuple([0, 2]), 4, 2, 32, 32,
            tvm.runtime.ShapeTuple([0, 0]), False, 1, 1.0, 1e4, None, tvm.runtime.Tensor.__new__(tvm.runtime.Tensor)]
    args += [None] * (28 - len(args))
    with pytest.raises(rk.ArgumentError, match="argument 12 .*null handle"):
        paged_attention_kv_cache_create(*args)


def test_shared_kv_needs_the_source_layer_appended_first(cache):
    """Before the source layer's attention a decode step read the stale slot of its new token."""
    cache.begin_forward([0], [1])
    args = (_t((1, 4, 32)), _t((1, 2, 32)), _t((1, 2, 32)), tvm.runtime.empty((1, 4, 32), "float32"), 0.2)
    _unchanged(cache, lambda: cache.attention_with_shared_kv(1, *args), rk.ForwardError, "not appended yet")
    cache.attention_with_fused_qkv(1, _t((1, 8, 32)), tvm.runtime.empty((1, 4, 32), "float32"), 0.2)
    cache.attention_with_shared_kv(1, *args)


def test_window_changes_and_partial_merges_are_refused_mid_step():
    win_cfg = dataclasses.replace(CFG, support_sliding_window=True, rope_mode=rk.RopeMode.INLINE)
    c = rk.PagedAttentionKVCache(win_cfg, tvm.cpu())
    c.add_sequence(0)
    c.begin_forward([0], [4])
    _unchanged(c, lambda: c.enable_sliding_window_for_seq(0, 16, 4), rk.ForwardError, "step is active")
    c.end_forward()
    o = tvm.runtime.tensor(np.random.default_rng(2).standard_normal((8, 4, 32)).astype("float32"))
    lse = tvm.runtime.tensor(np.zeros((4, 4), "float32"))
    view = tvm.runtime._ffi_api.TVMTensorCreateView
    o_self, o_cross = view(o, (4, 4, 32), o.dtype, 0), view(o, (4, 4, 32), o.dtype, 0)
    with pytest.raises(rk.ForwardError, match="shares memory"):  # lse_cross is a different tensor
        c.merge_attn_output_inplace(o_self, lse, o_cross, tvm.runtime.tensor(np.zeros((4, 4), "float32")))


def test_layer_windows_without_the_windowed_ragged_kernel_limit_the_chunk():
    """TVM's creation arguments have no windowed ragged kernel: the new tokens of a chunk longer
    than the window would see each other unwindowed. Such steps are refused; the frontend passes
    ours as a 29th creation argument."""
    from test_windows import _layer_window_config

    cfg = _layer_window_config()
    full = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    c = rk.PagedAttentionKVCache(cfg, tvm.cpu(), kernels=dataclasses.replace(
        full._kernels, attention_prefill_ragged_sliding_window=None))
    c.add_sequence(0)
    window = cfg.layer_sliding_window_size
    _unchanged(c, lambda: c.begin_forward([0], [window + 1]), rk.ForwardError, "windowed ragged kernel")
    c.begin_forward([0], [window])
    c.end_forward()
    full.add_sequence(0)
    full.begin_forward([0], [min(window + 1, cfg.prefill_chunk_size)])


# ---------------------------------------------------------------------------- third round


def test_commit_minus_one_after_a_popn_into_a_shared_prefix(cache):
    """popn into tokens a fork shares re-forks the sequence; the count of its last step's tokens
    that a commit with leaf -1 pops must survive that (it was reset to 0: nothing popped)."""
    rng = np.random.default_rng(7)
    _step(cache, rng, [0], [5])  # length 26, last step 5
    cache.fork_sequence(0, 1)
    cache.popn(0, 2)  # into the shared tokens: a re-fork
    cache.commit_accepted_token_tree_nodes([0], [-1])
    assert cache.get_sequence_length(0) == 21 and cache.get_sequence_length(1) == 26


def test_merge_with_itself_still_checks_o_against_lse(cache):
    o = tvm.runtime.tensor(np.random.default_rng(2).standard_normal((8, 4, 32)).astype("float32"))
    lse = tvm.runtime._ffi_api.TVMTensorCreateView(o, (8, 4), o.dtype, 0)
    with pytest.raises(rk.ForwardError, match="o_self_attn shares memory with lse_self_attn"):
        cache.merge_attn_output_inplace(o, lse, o, lse)


# ---------------------------------------------------------------------------- fourth round


def test_shared_kv_is_refused_when_slid_out_pages_hold_new_tokens():
    """Steps where windows slide attend before appending. When a page slides out of one sequence's
    window and takes another sequence's new tokens in the same step, the source layer's append
    overwrites what attention_with_shared_kv (and a second call of the same layer) would read:
    they returned wrong attention silently. Now they raise; steps without such pages still work
    and match the layer's own attention."""
    from reference_model import ReferenceCache

    cfg = rk.KVCacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=16, page_size=4, max_num_seqs=4,
                           max_total_seq_len=84, prefill_chunk_size=32, rope_mode=rk.RopeMode.NONE,
                           dtype="float32", support_sliding_window=True)
    c = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    ref = ReferenceCache(2, 2, 1, 16, 0)
    rng = np.random.default_rng(0)
    for s in (0, 1):
        c.add_sequence(s)
        ref.add(s)
    c.enable_sliding_window_for_seq(0, 8, 0)
    ref.enable_window(0, 8, 0)
    T = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a))  # noqa: E731
    out = lambda n: tvm.runtime.tensor(np.full((n, 2, 16), np.nan, np.float32))  # noqa: E731
    for ids, lens, reused in [([0, 1], [8, 4], False), ([0, 1], [4, 1], True)]:
        n = sum(lens)
        qkv = rng.standard_normal((n, 4, 16)).astype(np.float32)
        c.begin_forward(ids, lens)
        assert bool(c._step.meta.reused_pages) == reused
        own = out(n)
        c.attention_with_fused_qkv(0, T(qkv), own, 0.3)
        shared_args = (T(qkv[:, :2].copy()), T(qkv[:, 2:3].copy()), T(qkv[:, 3:4].copy()), out(n), 0.3)
        if reused:
            _unchanged(c, lambda: c.attention_with_shared_kv(0, *shared_args), rk.ForwardError, "overwrote page")
            _unchanged(c, lambda: c.attention_with_fused_qkv(0, T(qkv), out(n), 0.3), rk.ForwardError,
                       "a second time")
        else:
            c.attention_with_shared_kv(0, *shared_args)
            np.testing.assert_allclose(shared_args[3].numpy(), own.numpy(), atol=1e-5)
        c.attention_with_fused_qkv(1, T(qkv), out(n), 0.3)
        c.end_forward()
        expected = ref.step(list(zip(ids, lens)), [qkv, qkv], 0.3)[0]
        np.testing.assert_allclose(own.numpy(), expected, atol=1e-4)


def test_reserve_append_reports_slid_out_pages_handed_to_new_tokens():
    from relax_kvcache.paging import PagingState

    state = PagingState(4, 4, slide_windows=True)
    state.add_sequence(0)
    state.add_sequence(1)
    state.enable_sliding_window(0, 8, 0)
    assert state.reserve_append([0, 1], [8, 4]) == ()  # pages 0, 1 | 2
    assert state.reserve_append([0], [4]) == ()  # page 3 allocated, page 0 slides out: nobody takes it
    assert state.num_free_pages == 1
    # seq 0 needs a page (none free but page 0): it takes page 0, then page 1 slides out and is
    # handed to seq 1's new token
    assert state.reserve_append([0, 1], [4, 1]) == (1,)


def test_sequence_ids_beyond_int64_raise_sequence_error(cache):
    for bad in (2**63, -(2**63) - 1):
        _unchanged(cache, lambda: cache.add_sequence(bad), rk.SequenceError, "outside the int64 range")


def test_creation_arguments_with_kernels_of_another_config_are_refused(cache):
    """The creation function (the frontend's path) has no record of its kernels' config: kernels
    of another page size, head count or dtype, or in the wrong role, failed at the first step
    (after begin_forward) with TVM's TypeError. A probe at creation now names the kernel. The
    RoPE of ``split_rotary`` is the kernel's own, as in TVM (Llama-3 scaling or a partial rotary
    dim are not in the config): only that it rotates is checked."""
    import relax_kvcache.ffi_registry.create as create_module
    from test_hostile_input import _create_args

    k = cache._kernels
    for index, value, match in [(0, tvm.runtime.ShapeTuple([8, 200, 64, 16, 0]), "transpose_append kernel fails"),
                                (2, 8, "split_rotary kernel fails"),
                                (12, tvm.runtime.empty((), "float16"), "transpose_append kernel fails"),
                                (13, k.copy_single_page, "transpose_append kernel fails"),
                                (24, k.transpose_append, r"argument 24 \(f_split_rotary\) is a kernel of 4 parameters")]:
        args = _create_args(k)
        args[index] = value
        with pytest.raises(rk.ConfigError, match=match):
            create_module.paged_attention_kv_cache_create(*args)
    for index, value in [(10, 5e5), (9, 0.5)]:  # other RoPE constants: the kernel's rotation is used
        args = _create_args(k)
        args[index] = value
        assert create_module.paged_attention_kv_cache_create(*args).empty()


# ---------------------------------------------------------------------------- seventh round


def _create_with(kernels: KernelSet, **replaced):
    """The creation function with some of the mha config's arguments replaced (index: value)."""
    import relax_kvcache.ffi_registry.create as create_module
    from test_hostile_input import _create_args

    args = _create_args(kernels)
    for index, value in replaced.items():
        args[int(index.lstrip("a"))] = value
    return create_module.paged_attention_kv_cache_create(*args)


def test_creation_page_kernels_that_move_nothing_or_the_wrong_values_are_refused(cache):
    """A do-nothing ``copy_single_page`` passed the probe (it copied page 0 onto itself) and a
    later fork inside a page left the child's K/V garbage. The probe now fills two pages with
    random values and requires each page kernel's exact result."""
    k = cache._kernels
    nothing = tvm_ffi.convert(lambda *args: None)
    for index, value, match in [
            (25, nothing, "copy_single_page kernel does not copy page 0 to page 1"),
            (13, nothing, "transpose_append kernel does not write one token"),
            (27, nothing, "compact_copy kernel does not move position 15 to position 0"),
            # a copy of one slot less: page 1's last slot keeps its own values
            (25, tvm_ffi.convert(lambda p, s, t, n: k.copy_single_page(p, s, t, n - 1)), "values of page 1 differ")]:
        with pytest.raises(rk.ConfigError, match=match):
            _create_with(k, **{f"a{index}": value})


def test_creation_attention_kernels_in_the_wrong_role_or_writing_nothing_are_refused(cache):
    """Attention kernels from the creation arguments ran unchecked until the first step; in a
    decode step the append precedes the attention, so one that raised left K/V appended. The
    cache now runs a probe sequence through each attention kernel at construction (outputs
    poisoned with NaN) and clears itself."""
    k = cache._kernels
    nothing = tvm_ffi.convert(lambda *args: None)
    for index, value, match in [(16, ["tirx", k.attention_decode], r"argument 16 \(f_attention_prefill\) is a kernel of 13 "),
                                (15, ["tirx", nothing], "attention_with_fused_qkv writes non-finite values"),
                                (16, ["tirx", nothing], "attention_with_fused_qkv writes non-finite values"),
                                (17, ["tirx", nothing], "attention_with_fused_qkv writes non-finite values"),
                                (23, [nothing], "attention_with_fused_qkv does not return float64 attention")]:
        with pytest.raises(rk.ConfigError, match=match):
            _create_with(k, **{f"a{index}": value})
    # eighth round: kernels wrong only in their arithmetic (sm_scale ignored) passed
    unscaled = [(15, ["tirx", tvm_ffi.convert(lambda *a: k.attention_prefill_ragged(*a[:-1], 1.0))]),
                (16, ["tirx", tvm_ffi.convert(lambda *a: k.attention_prefill(*a[:-1], 1.0))]),
                (17, ["tirx", tvm_ffi.convert(lambda *a: k.attention_decode(*a[:-1], 1.0))])]
    for index, value in unscaled:
        with pytest.raises(rk.ConfigError, match="attention_with_fused_qkv does not return float64 attention"):
            _create_with(k, **{f"a{index}": value})
    fresh = _create_with(k)
    assert fresh.empty() and fresh.get_num_available_pages() == CFG.num_total_pages
    assert fresh._paging._pages.free_page_ids() == tuple(range(CFG.num_total_pages - 1, -1, -1))


def test_huge_ranges_are_refused_before_they_are_expanded(cache):
    """``range`` is an accepted id / length container; a huge one was expanded first (MemoryError
    or OverflowError, not a KVCacheError; gigabytes for range(10**8))."""
    _unchanged(cache, lambda: cache.begin_forward(range(10**15), [1]), rk.SequenceError,
               r"seq_ids has 1000000000000000 entries, more than 1 \(the number of sequences")
    _unchanged(cache, lambda: cache.begin_forward([0], range(2**70)), rk.SequenceError, "append_lengths has")
    _unchanged(cache, lambda: cache.commit_accepted_token_tree_nodes(range(10**15), [0]), rk.SequenceError,
               "seq_ids has")
    begin = tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")
    _unchanged(cache, lambda: begin(cache, range(10**15), [1]), rk.SequenceError, "seq_ids has")
    with pytest.raises(rk.ConfigError, match="attn_kinds .argument 6. has 1000000000000000 entries"):
        _create_with(cache._kernels, a6=range(10**15))
    cache.begin_forward(range(1), range(4, 5))  # small ranges still work
    cache.end_forward()


# ------------------------------------------------------------------ tenth round

def test_cross_attention_after_an_append_that_reused_a_slid_page_is_refused():
    """A page that slid out of a window took new tokens in the step; cross_attention after the
    layer's fused append read them as the window's old tokens (wrong output, no error)."""
    cfg = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4, max_num_seqs=8,
                           max_total_seq_len=128, prefill_chunk_size=32, support_sliding_window=True,
                           dtype="float32")
    c = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    for seq in (0, 1, 2):
        c.add_sequence(seq)
    c.enable_sliding_window_for_seq(0, 10, 0)
    rng = np.random.default_rng(3)
    refused = 0
    for lens in ([4, 3, 2], [2, 5, 2], [1, 2, 4], [2, 5, 4], [2, 2, 2], [5, 4, 5], [5, 1, 1], [4, 3, 3], [4, 1, 4]):
        n = sum(lens)
        c.begin_forward([0, 1, 2], lens)
        q = tvm.runtime.tensor(rng.standard_normal((n, 4, 16)).astype("float32"))
        o, lse = tvm.runtime.empty((n, 4, 16), "float32"), tvm.runtime.empty((n, 4), "float32")
        c.cross_attention(0, q, o, lse, 0.3)  # before the append: allowed
        qkv = tvm.runtime.tensor(rng.standard_normal((n, 8, 16)).astype("float32"))
        c.attention_with_fused_qkv(0, qkv, tvm.runtime.empty((n, 4, 16), "float32"), 0.3)
        if c._step.meta.reused_pages:
            _unchanged(c, lambda: c.cross_attention(0, q, o, lse, 0.3), rk.ForwardError,
                       r"cross_attention\(0\) would read layer 0's KV after its append overwrote page")
            refused += 1
        else:
            c.cross_attention(0, q, o, lse, 0.3)
        c.end_forward()
    assert refused


def test_kernels_in_the_wrong_role_are_refused_at_creation(cache):
    """The paged tree kernel (used when a tree grows over a second step) and debug_get_kv were
    not probed: kernels of another role failed later, after K/V were appended."""
    k = cache._kernels
    ragged_tree = ["tirx", k.attention_prefill_ragged_tree]
    assert _create_with(k, a20=["tirx", k.attention_prefill_tree], a21=ragged_tree).empty()
    for replaced, match in [(dict(a20=["tirx", k.attention_prefill], a21=ragged_tree),
                             r"argument 20 \(f_attention_prefill_with_tree_mask_paged_kv\) is a kernel of 15 "),
                            (dict(a26=k.copy_single_page), "debug_get_kv.* fails on this cache's tensors")]:
        with pytest.raises(rk.ConfigError, match=match):
            _create_with(k, **replaced)
    # a debug_get_kv that writes nothing (or another layer's rows)
    for fake in (tvm_ffi.convert(lambda *a: None),
                 tvm_ffi.convert(lambda pages, pos, kd, vd, layer: k.debug_get_kv(pages, pos, kd, vd, 1 - layer))):
        with pytest.raises(rk.ConfigError, match="debug_get_kv does not return the K/V stored"):
            _create_with(k, a26=fake)
    assert _create_with(k).empty()


def test_debug_get_kv_of_another_layer_is_refused_when_that_layer_holds_the_same_bytes(cache, monkeypatch):
    """The probe attends in layer 0 only and fresh pages hold any bits: when layer 1's memory
    held the probe's own rows (freed pages of an earlier probe, reused by the allocator), a
    ``debug_get_kv`` reading layer 1 passed (a CI run failed this way). The unprobed layers'
    pages are now poisoned first; here layer 1 is made to hold layer 0's bytes on purpose."""
    from relax_kvcache import kernel_probe

    original = kernel_probe._probe_debug_get_kv

    def with_layer_one_a_copy(probed, layers):
        probed.pages[1].copyfrom(probed.pages[0])
        original(probed, layers)

    monkeypatch.setattr(kernel_probe, "_probe_debug_get_kv", with_layer_one_a_copy)
    k = cache._kernels
    other = tvm_ffi.convert(lambda pages, pos, kd, vd, layer: k.debug_get_kv(pages, pos, kd, vd, 1 - layer))
    with pytest.raises(rk.ConfigError, match="debug_get_kv does not return the K/V stored"):
        _create_with(k, a26=other)
    assert _create_with(k).empty()


def test_a_changed_kernel_set_loses_its_identity_and_is_probed(cache):
    """``dataclasses.replace`` kept the identity of our library, so a swapped kernel skipped the
    probe and failed mid-step after appending."""
    k = cache._kernels
    assert k.identity is not None and dataclasses.replace(k).identity is None
    with pytest.raises(rk.ConfigError, match="fails on this cache's tensors"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(k, attention_decode=k.attention_prefill))
    with pytest.raises(ValueError, match="init=False"):
        dataclasses.replace(k, identity=k.identity)  # not settable
    assert rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(k)).empty()


def test_constructor_arguments_of_the_wrong_type_or_device_kind():
    for config in (None, "cfg", CFG.__dict__):
        with pytest.raises(rk.ArgumentError, match="config must be a KVCacheConfig"):
            rk.PagedAttentionKVCache(config)
    with pytest.raises(rk.ArgumentError, match="target must be a tvm.target.Target or None, got 'cuda'"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(), target="cuda")
    with pytest.raises(rk.ConfigError, match="target cuda compiles for another kind of device than cpu"):
        rk.PagedAttentionKVCache(CFG, tvm.cpu(), target=tvm.target.Target("cuda"))
    # a device this process cannot use: refused before kernels are compiled for it (a bare
    # RuntimeError from TVM's allocator after compiling, before)
    absent = tvm.metal(0) if not tvm.metal(0).exist else tvm.vulkan(0)
    for target in (None, tvm.target.Target("metal" if absent == tvm.metal(0) else "vulkan")):
        with pytest.raises(rk.ConfigError, match=f"device {absent} does not exist in this process"):
            rk.PagedAttentionKVCache(CFG, absent, target=target)


def test_builtins_refuse_ffi_objects_that_are_not_caches(cache):
    """Any tvm_ffi.Object went to TVM's function (TypeError / InternalError from TVM)."""
    for obj in (tvm_ffi.Array([1]), tvm_ffi.Map({"a": 1}), tvm_ffi.convert(lambda: 1), tvm_ffi.Shape([1])):
        for name, args in (("vm.builtin.kv_state_clear", ()), ("vm.builtin.kv_state_begin_forward", ([0], [1])),
                           ("vm.builtin.attention_kv_cache_get_num_available_pages", ())):
            with pytest.raises(rk.ArgumentError, match="expected a relax_kvcache.PagedAttentionKVCache or a TVM KV"):
                tvm_ffi.get_global_func(name)(obj, *args)


# ------------------------------------------------------------------ eleventh round

def test_kernels_that_ignore_sm_scale_are_refused(cache):
    """The probe used head_dim ** -0.5, so a kernel that used that value instead of its
    ``sm_scale`` argument passed and was wrong for any other scale."""
    k = cache._kernels
    fixed = CFG.head_dim ** -0.5
    for role in ("attention_decode", "attention_prefill", "attention_prefill_ragged", "attention_prefill_prefixed"):
        original = getattr(k, role)
        ignoring = (lambda f: lambda *a: f(*a[:-1], fixed))(original)
        with pytest.raises(rk.ConfigError, match="does not return float64 attention"):
            rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(k, **{role: ignoring}))


def test_config_mla_dims_become_python_ints():
    """numpy MLA dims stayed numpy (their size check wrapped around int64)."""
    mla = dict(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=576, v_head_dim=512, attn_kinds=[1],
               rope_mode=0, dtype="float16")
    cfg = rk.KVCacheConfig(**mla, mla_original_qk_head_dim=np.int64(192), mla_original_v_head_dim=np.int32(128))
    assert (type(cfg.mla_original_qk_head_dim), type(cfg.mla_original_v_head_dim)) == (int, int)
    huge = dict(mla, num_qo_heads=2**31 - 1, max_total_seq_len=2**25, context_chunk_size=2**25, prefill_chunk_size=1)
    for dims in ((192, 128), (np.int64(192), np.int64(128))):
        with pytest.raises(rk.ConfigError, match="MLA context workspace would take"):
            rk.KVCacheConfig(**huge, mla_original_qk_head_dim=dims[0], mla_original_v_head_dim=dims[1])


def test_valid_inputs_of_numpy_and_container_types(cache):
    """Twelfth round (valid inputs): numpy scalar types as dtypes, list / tuple subclasses and
    memmaps as attn_kinds, 0-d arrays as scales were refused after the exact-type checks came
    in. (A rope_ext_factors that is not a tensor is refused unless it carries no factors: TVM's
    null value ``0`` and lists of ones are read as none, as TVM reads them.)"""
    import collections

    import ml_dtypes

    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16)
    for dtype, name in ((np.float16, "float16"), (np.float32, "float32"), (ml_dtypes.bfloat16, "bfloat16"),
                        (np.str_("float16"), "float16")):
        assert rk.KVCacheConfig(**base, dtype=dtype).dtype == name
    pair = collections.namedtuple("Pair", "a b")
    for kinds in (pair(0, 3), np.array([0, 3], dtype=object), tvm_ffi.Array([0, 3])):
        cfg = rk.KVCacheConfig(**base, attn_kinds=kinds, layer_sliding_window_size=8)
        assert cfg.attn_kinds == (rk.AttnKind.MHA, rk.AttnKind.MHA_SLIDING)
    assert rk.KVCacheConfig(**base, rope_theta=np.array(5e5)).rope_theta == 5e5
    cache.begin_forward([0], [1])
    cache.attention_with_fused_qkv(0, _t((1, 8, 32)), _t((1, 4, 32)), np.array(0.2))
    cache.end_forward()
    for factors in (0, [1.0]):
        assert _create_with(cache._kernels, a11=factors).config.rope_ext_factors is None
    for factors in ([], [2.0], 1):
        with pytest.raises(rk.ArgumentError, match="rope_ext_factors .argument 11. must be None, 0 .TVM's null value."):
            _create_with(cache._kernels, a11=factors)


# ---------------------------------------------------------------------------- nineteenth round
# (checkpoints, LongRoPE, partial rotary dims)


def _ckpt_cache(**fields):
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4, max_num_seqs=4,
                max_total_seq_len=64, prefill_chunk_size=32, dtype="float32", rope_mode=rk.RopeMode.NORMAL)
    base.update(fields)
    return rk.PagedAttentionKVCache(rk.KVCacheConfig(**base), tvm.cpu())


def _filled(cache, n=6):
    cfg, rng = cache.config, np.random.default_rng(19)
    cache.add_sequence(0)
    cache.begin_forward([0], [n])
    for layer in range(cfg.num_layers):
        qkv = rng.standard_normal((n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)).astype("float32")
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv), tvm.runtime.empty((n, 4, cfg.head_dim)), 0.3)
    cache.end_forward()
    return cache


def _edited(meta, **fields):
    import json

    data = json.loads(meta)
    data.update(fields)
    return json.dumps(data)


def test_checkpoint_metadata_sizes_are_bounded_before_anything_is_built():
    """Round 19: a huge seq_length made prepare_import build its expected page lists first
    (seconds and gigabytes, a hang at 2**40); it is now refused at once."""
    import time

    cache = _filled(_ckpt_cache())
    meta = cache.get_checkpoint_metadata(0)
    target = _ckpt_cache()
    start = time.perf_counter()
    for length, error, match in ((2**40, rk.ArgumentError, r"seq_length must be in \[0, 2147483647\]"),
                                 (10**7, rk.ArgumentError, "more than its num_total_pages"),
                                 (4 * 17 + 1, rk.CacheFullError, "this cache holds 17 in all")):
        pages = -(-length // 4)
        edited = _edited(meta, seq_length=length, num_total_pages=max(pages, 17) if length == 69 else 17)
        _unchanged(target, lambda: target.prepare_import(1, edited), error, match)
    assert time.perf_counter() - start < 5


def test_checkpoint_groups_name_global_layers():
    """Round 19: a cache whose layers start past 0 named its groups' layers from 0 (TVM: the
    global ids); each side then refused the other's checkpoint."""
    import json

    config = rk.KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                              max_total_seq_len=64, prefill_chunk_size=32, dtype="float32")
    src = rk.PagedAttentionKVCache(config, tvm.cpu(), layer_offset=1)
    src.add_sequence(0)
    meta = json.loads(src.get_checkpoint_metadata(0))
    assert [(g["layer_begin"], g["layer_end"]) for g in meta["groups"]] == [(1, 2), (2, 3)]
    dst = rk.PagedAttentionKVCache(config, tvm.cpu(), layer_offset=1)
    dst.prepare_import(0, json.dumps(meta))
    for group in range(2):
        dst.import_page_group(0, group, tvm.runtime.empty((1, 0, 2, 2, 4, 16), "float32"))
    dst.finish_import(0)


def test_longrope_with_a_partial_rotary_dim_works():
    """Round 19: the factors tensor was allocated at head_dim, so a LongRoPE cache with a partial
    rotary dim (factors of the rotary dim, TVM's layout) could not be created; through TVM's
    creation arguments the probe then refused the right kernels (only the rotated features
    carry the attention factor)."""
    from reference_model import longrope

    factors = tuple(float(x) for x in np.r_[np.linspace(1, 9, 4), np.linspace(1, 1.5, 4)])
    cache = _ckpt_cache(rope_rotary_dim=8, rope_ext_factors=factors, rope_original_max_position_embeddings=3,
                        rope_attention_factor=1.2)
    cache.add_sequence(0)
    rng = np.random.default_rng(5)
    qkv = [rng.standard_normal((6, 8, 16)).astype("float32") for _ in range(2)]
    cache.begin_forward([0], [6])
    for layer in range(2):
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer]), tvm.runtime.empty((6, 4, 16)), 0.25)
    cache.end_forward()
    k, v = tvm.runtime.empty((2, 6, 2, 16)), tvm.runtime.empty((2, 6, 2, 16))
    cache.debug_get_kv(0, 0, 6, k, v)
    want = longrope(qkv[1][:, 4:6], np.arange(6), 1e4, 1.0, factors, 3, 1.2)
    np.testing.assert_allclose(k.numpy()[1], want, atol=1e-5)
    import relax_kvcache.ffi_registry.create as create_module  # creation through TVM's arguments

    kernels = cache._kernels
    args = [tvm.runtime.ShapeTuple([4, 64, 32, 4, 0]), tvm.runtime.ShapeTuple([0, 2]), 4, 2, 16, 16,
            tvm.runtime.ShapeTuple([0, 0]), False, 1, 1.0, 1e4, tvm.runtime.tensor(np.array(factors, np.float32)),
            tvm.runtime.empty((), "float32"), kernels.transpose_append, None, ["tirx", kernels.attention_prefill_ragged],
            ["tirx", kernels.attention_prefill], ["tirx", kernels.attention_decode], [], [], [], [], [],
            [kernels.merge_inplace], kernels.split_rotary, kernels.copy_single_page, kernels.debug_get_kv,
            kernels.compact_copy]
    created = create_module.paged_attention_kv_cache_create(*args)
    assert created.config.rotary_dim == 8


def test_checkpoint_json_edge_cases_are_refused_as_argument_errors():
    """Round 19: deeply nested JSON raised RecursionError; floats where TVM requires ints or
    bools were accepted (Python's 1.0 == 1)."""
    cache = _filled(_ckpt_cache())
    meta = cache.get_checkpoint_metadata(0)
    target = _ckpt_cache()
    deep = meta[:-1] + ',"x":' + "[" * 100000 + "]" * 100000 + "}"
    _unchanged(target, lambda: target.prepare_import(1, deep), rk.ArgumentError, "not valid JSON: RecursionError")
    import json

    data = json.loads(meta)
    for field, value, error in (("page_size", 4.0, rk.ConfigError), ("support_sliding_window", 0.0, rk.ConfigError),
                                ("num_layers", 2.0, rk.ConfigError)):
        _unchanged(target, lambda: target.prepare_import(1, _edited(meta, **{field: value})), error, field)
    pages = [dict(p) for p in data["logical_pages"]]
    pages[0]["length"] = 4.0
    _unchanged(target, lambda: target.prepare_import(1, _edited(meta, logical_pages=pages)), rk.ArgumentError,
               "logical_pages")
    target.prepare_import(1, _edited(meta, has_rope_ext_factors=False))  # the values TVM writes pass


def test_caches_without_checkpoints_refuse_every_checkpoint_call():
    """Round 19: get_layout_hash answered on LongRoPE and MLA caches (TVM refuses), and
    import_page_group / finish_import raised SequenceError there."""
    cache = _ckpt_cache(rope_ext_factors=(1.0,) * 16, rope_original_max_position_embeddings=8)
    cache.add_sequence(0)
    group = tvm.runtime.empty((1, 0, 2, 2, 4, 16), "float32")
    for call in (cache.get_layout_hash, lambda: cache.import_page_group(0, 0, group), lambda: cache.finish_import(0),
                 lambda: cache.get_checkpoint_metadata(0), lambda: cache.prepare_import(0, "{}")):
        with pytest.raises(NotImplementedError, match="RoPE extension factors"):
            call()


@pytest.mark.tvm_native
def test_checkpoint_float_format_is_tvms_for_large_whole_numbers():
    """Round 19: a whole theta in [2**53, 1e17) was written with a trailing .0 (TVM: none)."""
    import native_baseline as tb

    shape = tb.Shape(rope_mode=1, rope_theta=1.2345678901234568e16, rope_scale=2.0 ** 60)
    caches = [tb.create_native(shape), tb.create_ours_direct(shape)]
    for c in caches:
        tb.Builtins().add(c, 0)
    metadata = tvm.get_global_func("vm.builtin.attention_kv_cache_get_checkpoint_metadata")
    assert metadata(caches[0], 0) == metadata(caches[1], 0)


def test_checkpoints_of_another_rotary_dim_are_refused():
    """Round 19: the layout hash (TVM's) has no rotary dim, so a partial-rotary checkpoint moved
    silently into a full-rotary cache (keys stored rotated differently); partial-rotary
    checkpoints now carry the dim in an extra field (TVM ignores unknown fields)."""
    import json

    src = _filled(_ckpt_cache(rope_rotary_dim=8))
    meta = src.get_checkpoint_metadata(0)
    assert json.loads(meta)["rope_rotary_dim"] == 8
    target = _ckpt_cache()
    _unchanged(target, lambda: target.prepare_import(0, meta), rk.ConfigError, "rope_rotary_dim is 8, this cache's 16")
    partial = _ckpt_cache(rope_rotary_dim=8)
    _unchanged(partial, lambda: partial.prepare_import(0, _filled(_ckpt_cache()).get_checkpoint_metadata(0)),
               rk.ConfigError, "rope_rotary_dim is 16, this cache's 8")
    partial.prepare_import(0, meta)
    gptj = _filled(_ckpt_cache(rope_interleaved=True)).get_checkpoint_metadata(0)
    assert json.loads(gptj)["rope_interleaved"] is True
    _unchanged(target, lambda: target.prepare_import(0, gptj), rk.ConfigError, "rope_interleaved is true")
    _ckpt_cache(rope_interleaved=True).prepare_import(0, gptj)


@pytest.mark.parametrize("factors", [("2.0",) * 16, (True,) * 16, (b"1.5",) * 16, np.ones(16, bool)])
def test_factor_values_must_be_numbers(factors):
    """Round 19: numpy converted strings, bools and bytes into factors."""
    with pytest.raises(rk.ConfigError, match="must hold numbers"):
        rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16, rope_ext_factors=factors,
                         rope_original_max_position_embeddings=8)
