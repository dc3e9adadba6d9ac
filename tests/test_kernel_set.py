"""Kernel sets: kernels are checked where a cache gets them, before anything is appended.

``PagedAttentionKVCache(kernels=...)`` compares the kernels' config with the cache's and requires
every kernel a step may call; a kernel set of unknown origin (and every kernel from TVM's
creation arguments) runs a probe at construction: each page kernel must move the exact values,
each attention kernel must return float64 attention for the given ``sm_scale``, each kernel must
fit its role. A refusal names the kernel.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
import tvm_ffi

import relax_kvcache as rk
from support.harness import layer_window_config
from support.small_cache import CFG, assert_refused, create_args, create_with, one_sequence_cache, rand


@pytest.fixture()
def cache():
    """A cache of ``CFG`` holding sequence 0 (21 tokens)."""
    return one_sequence_cache()


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

    mla = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=576, v_head_dim=512,
                           mla_original_qk_head_dim=192, mla_original_v_head_dim=128, page_size=16,
                           rope_mode=rk.RopeMode.NONE, dtype="float16", attn_kinds=[rk.AttnKind.MLA])
    chunked = layer_window_config(attn_kinds=[rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA, rk.AttnKind.MHA],
                                   attention_chunk_size=20)  # the same size as the window: other kernels
    configs = [CFG, layer_window_config(), chunked, dataclasses.replace(chunked, attention_chunk_size=32), mla]
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
    assert_refused(no_trees, lambda: no_trees.begin_forward([0], [2], [-1, 0]), rk.KVCacheError,
               "attention_prefill_tree")


def test_more_kernels_are_required(cache):
    """copy_single_page and the merges are called halfway through forks and prefix steps."""
    for role in ("copy_single_page", "merge_inplace", "merge_general"):
        with pytest.raises(rk.ConfigError, match=role):
            rk.PagedAttentionKVCache(CFG, tvm.cpu(), kernels=dataclasses.replace(cache._kernels, **{role: None}))


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


# ---------------------------------------------------------------------------- creation arguments (TVM's)


def test_creation_refuses_a_null_init_tensor(cache):
    from relax_kvcache.ffi_registry.create import paged_attention_kv_cache_create

    args = [tvm.runtime.ShapeTuple([4, 128, 32, 8, 0]), tvm.runtime.ShapeTuple([0, 2]), 4, 2, 32, 32,
            tvm.runtime.ShapeTuple([0, 0]), False, 1, 1.0, 1e4, None, tvm.runtime.Tensor.__new__(tvm.runtime.Tensor)]
    args += [None] * (28 - len(args))
    with pytest.raises(rk.ArgumentError, match="argument 12 .*null handle"):
        paged_attention_kv_cache_create(*args)


def test_creation_arguments_with_kernels_of_another_config_are_refused(cache):
    """The creation function (the frontend's path) has no record of its kernels' config: kernels
    of another page size, head count or dtype, or in the wrong role, failed at the first step
    (after begin_forward) with TVM's TypeError. A probe at creation now names the kernel. The
    RoPE of ``split_rotary`` is the kernel's own, as in TVM (Llama-3 scaling or a partial rotary
    dim are not in the config): only that it rotates is checked."""
    import relax_kvcache.ffi_registry.create as create_module

    k = cache._kernels
    for index, value, match in [(0, tvm.runtime.ShapeTuple([8, 200, 64, 16, 0]), "transpose_append kernel fails"),
                                (2, 8, "split_rotary kernel fails"),
                                (12, tvm.runtime.empty((), "float16"), "transpose_append kernel fails"),
                                (13, k.copy_single_page, "transpose_append kernel fails"),
                                (24, k.transpose_append, r"argument 24 \(f_split_rotary\) is a kernel of 4 parameters")]:
        args = create_args(k)
        args[index] = value
        with pytest.raises(rk.ConfigError, match=match):
            create_module.paged_attention_kv_cache_create(*args)
    for index, value in [(10, 5e5), (9, 0.5)]:  # other RoPE constants: the kernel's rotation is used
        args = create_args(k)
        args[index] = value
        assert create_module.paged_attention_kv_cache_create(*args).empty()


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
            create_with(k, **{f"a{index}": value})


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
            create_with(k, **{f"a{index}": value})
    # kernels wrong only in their arithmetic (sm_scale ignored) passed
    unscaled = [(15, ["tirx", tvm_ffi.convert(lambda *a: k.attention_prefill_ragged(*a[:-1], 1.0))]),
                (16, ["tirx", tvm_ffi.convert(lambda *a: k.attention_prefill(*a[:-1], 1.0))]),
                (17, ["tirx", tvm_ffi.convert(lambda *a: k.attention_decode(*a[:-1], 1.0))])]
    for index, value in unscaled:
        with pytest.raises(rk.ConfigError, match="attention_with_fused_qkv does not return float64 attention"):
            create_with(k, **{f"a{index}": value})
    fresh = create_with(k)
    assert fresh.empty() and fresh.get_num_available_pages() == CFG.num_total_pages
    assert fresh._paging._pages.free_page_ids() == tuple(range(CFG.num_total_pages - 1, -1, -1))


def test_the_prefixed_kernel_as_30th_creation_argument_is_checked(cache):
    """Our 30th creation argument (the prefixed prefill kernel, which the frontend passes): a
    kernel of another role is refused naming the argument, one ignoring its sm_scale by the probe
    (through attention_with_shared_kv); the right one is taken."""
    from relax_kvcache.ffi_registry.create import paged_attention_kv_cache_create as create

    k = cache._kernels
    unscaled = tvm_ffi.convert(lambda *a: k.attention_prefill_prefixed(*a[:-1], 1.0))
    for value, match in [(["tirx", k.attention_prefill], r"argument 29 \(f_attention_prefill_prefixed\) is a kernel "
                                                         r"of 15 parameters"),
                         (["tirx", unscaled], "attention_with_shared_kv does not return float64 attention")]:
        with pytest.raises(rk.ConfigError, match=match):
            create(*create_args(k), [], value)
    fresh = create(*create_args(k), [], ["tirx", k.attention_prefill_prefixed])
    assert fresh._kernels.attention_prefill_prefixed is not None and fresh.empty()


def test_check_fused_qkv_as_31st_creation_argument(cache):
    """Our 31st creation argument (``check_fused_qkv``, which the frontend passes): a function of
    another parameter count is refused naming the argument; the right one is taken and checks
    ``attention_with_fused_qkv``'s tensors (a wrong one still gets the error naming it)."""
    from relax_kvcache.ffi_registry.create import paged_attention_kv_cache_create as create

    k = cache._kernels
    with pytest.raises(rk.ConfigError, match=r"argument 30 \(f_check_fused_qkv\) is a kernel of 4 parameters"):
        create(*create_args(k), [], [], k.merge_inplace)
    assert create(*create_args(k)).__dict__["_fused_qkv_check"] is None
    fresh = create(*create_args(k), [], [], k.check_fused_qkv)
    assert fresh._fused_qkv_check is k.check_fused_qkv
    fresh.add_sequence(0)
    fresh.begin_forward([0], [3])
    o = tvm.runtime.tensor(np.full((3, 4, 32), np.nan, "float32"))
    fresh.attention_with_fused_qkv(0, rand((3, 8, 32)), o, 0.1)
    assert np.isfinite(o.numpy()).all()
    with pytest.raises(rk.ForwardError, match=r"qkv has shape \(3, 9, 32\)"):
        fresh.attention_with_fused_qkv(1, rand((3, 9, 32)), o, 0.1)


def test_kernels_in_the_wrong_role_are_refused_at_creation(cache):
    """The paged tree kernel (used when a tree grows over a second step) and debug_get_kv were
    not probed: kernels of another role failed later, after K/V were appended."""
    k = cache._kernels
    ragged_tree = ["tirx", k.attention_prefill_ragged_tree]
    assert create_with(k, a20=["tirx", k.attention_prefill_tree], a21=ragged_tree).empty()
    for replaced, match in [(dict(a20=["tirx", k.attention_prefill], a21=ragged_tree),
                             r"argument 20 \(f_attention_prefill_with_tree_mask_paged_kv\) is a kernel of 15 "),
                            (dict(a26=k.copy_single_page), "debug_get_kv.* fails on this cache's tensors")]:
        with pytest.raises(rk.ConfigError, match=match):
            create_with(k, **replaced)
    # a debug_get_kv that writes nothing (or another layer's rows)
    for fake in (tvm_ffi.convert(lambda *a: None),
                 tvm_ffi.convert(lambda pages, pos, kd, vd, layer: k.debug_get_kv(pages, pos, kd, vd, 1 - layer))):
        with pytest.raises(rk.ConfigError, match="debug_get_kv does not return the K/V stored"):
            create_with(k, a26=fake)
    assert create_with(k).empty()


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
        create_with(k, a26=other)
    assert create_with(k).empty()
