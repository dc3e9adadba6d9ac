"""Unit tests of the TIR kernels (``relax_kvcache.tir_kernels``) as built by ``build_kernels``.

Every kernel is called through the compiled module with random inputs and compared against
numpy (float64 math on the inputs as rounded to the kernel dtype; ``relax_kvcache.reference``
for RoPE, attention and state merging, plain numpy indexing for the page operations).
Outputs are poisoned with NaN before a kernel runs so that a row the kernel forgets to write
fails the test, and in-place kernels are checked bit for bit on everything they must not touch.
Index arrays are passed both as whole tensors and as views with a byte offset (the kernels
declare an ``elem_offset``); the padding in front of a view holds wrong-but-valid values, so a
kernel that ignores the offset reads the wrong indices and fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from relax_kvcache import reference as ref
from support.kernel_cases import (CONFIGS, LONGROPE_CONFIGS, O_TOL, ROTARY_CONFIGS, VIEW_PAD, Indices, PagedBatch,
                                  assert_bitwise_equal, assert_close, assert_lse_close, check_attention_outputs, f64,
                                  nan_like, plain_layout, pool_pages, randn, reference_attention, rope_args, seed_of,
                                  tensor)

CFG_NAMES = list(CONFIGS)
SW_NAMES = [n for n, c in CONFIGS.items() if c.support_sliding_window]


@pytest.fixture(params=CFG_NAMES)
def cfg_name(request):
    return request.param


def kernels(kernel_build, name):
    return kernel_build(CONFIGS[name])


# ----------------------------------------------------------------------------- module


@pytest.mark.parametrize("name", CFG_NAMES)
def test_module_has_all_roles(kernel_build, name):
    mod = kernels(kernel_build, name)
    roles = ["transpose_append", "split_rotary", "copy_single_page", "compact_copy", "debug_get_kv",
             "merge_inplace", "attention_prefill_ragged", "attention_prefill", "attention_decode"]
    sw = ["attention_prefill_sliding_window", "attention_decode_sliding_window"]
    for role in roles:
        assert mod.implements_function(role), role
    for role in sw:
        assert mod.implements_function(role) == CONFIGS[name].support_sliding_window, role


# ----------------------------------------------------------------------------- page ops


@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_transpose_append(kernel_build, cfg_name, pad):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("append", cfg_name, pad))
    ps, P, n = cfg.page_size, 13, 41
    pages = pool_pages(rng, cfg, P)
    k = randn(rng, (n, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    v = randn(rng, (n, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    # Distinct pool positions in random pages and slots (incl. the last slot of the last page).
    pos = rng.choice(P * ps, size=n, replace=False).astype(np.int32)
    pos[3] = P * ps - 1
    pos[rng.choice(n, size=7, replace=False)] = -1
    assert (pos == -1).sum() >= 6 and (pos >= 0).sum() > 30

    expected = pages.copy()
    for i, p in enumerate(pos):
        if p >= 0:
            expected[p // ps, 0, :, p % ps, :] = k[i]
            expected[p // ps, 1, :, p % ps, :] = v[i]
    assert not np.array_equal(expected, pages)

    t_pages = tensor(pages)
    ix = Indices(pad, pad_value=0)
    mod["transpose_append"](t_pages, tensor(k), tensor(v), ix(pos))
    assert_bitwise_equal(t_pages.numpy(), expected, "pages")


@pytest.mark.parametrize("frac", ["zero", "one", "partial", "almost", "full"])
def test_copy_single_page(kernel_build, cfg_name, frac):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    ps = cfg.page_size
    length = {"zero": 0, "one": 1, "partial": ps // 2 + 1, "almost": ps - 1, "full": ps}[frac]
    rng = np.random.default_rng(seed_of("copy_page", cfg_name, frac))
    P = 9
    pages = pool_pages(rng, cfg, P)
    src, tgt = (int(x) for x in rng.choice(P, size=2, replace=False))
    expected = pages.copy()
    expected[tgt, :, :, :length, :] = pages[src, :, :, :length, :]

    t_pages = tensor(pages)
    mod["copy_single_page"](t_pages, src, tgt, length)
    assert_bitwise_equal(t_pages.numpy(), expected, f"pages (src={src}, tgt={tgt}, len={length})")


@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_compact_copy(kernel_build, cfg_name, pad):
    """Per sequence: kept rows move down to close gaps (ascending, dst <= src), in order."""
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("compact", cfg_name, pad))
    ps, B, pages_per_seq = cfg.page_size, 5, 3
    P = B * pages_per_seq + 4
    pages = pool_pages(rng, cfg, P)
    owned = rng.permutation(P)[: B * pages_per_seq].reshape(B, pages_per_seq)

    src_all, dst_all, counts = [], [], []
    for b in range(B):
        length = int(rng.integers(ps + 1, pages_per_seq * ps + 1))
        pool_pos = owned[b][np.arange(length) // ps] * ps + np.arange(length) % ps
        if b == 2:  # a sequence with nothing to copy
            m, start = 0, 0
        else:
            start = int(rng.integers(0, length // 2))
            m = int(rng.integers(1, length - start + 1))
        src_logical = np.sort(rng.choice(np.arange(start, length), size=m, replace=False))
        dst_logical = start + np.arange(m)
        assert (dst_logical <= src_logical).all()
        src_all.append(pool_pos[src_logical])
        dst_all.append(pool_pos[dst_logical])
        counts.append(m)
    # Make sure the data actually moves somewhere and overlapping ranges occur.
    assert sum(int((s != d).sum()) for s, d in zip(src_all, dst_all)) > 5
    indptr = np.cumsum([0] + counts).astype(np.int32)
    src_dst = np.stack([np.concatenate(src_all), np.concatenate(dst_all)]).astype(np.int32)

    expected = pages.copy()
    for s, d in zip(src_dst[0], src_dst[1]):  # sequential semantics
        expected[d // ps, :, :, d % ps, :] = expected[s // ps, :, :, s % ps, :]
    assert not np.array_equal(expected, pages)

    t_pages = tensor(pages)
    ix = Indices(pad, pad_value=0)
    mod["compact_copy"](t_pages, ix(indptr), ix(src_dst), B)
    assert_bitwise_equal(t_pages.numpy(), expected, "pages")


@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_debug_get_kv(kernel_build, cfg_name, pad):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("debug_get_kv", cfg_name, pad))
    ps, P, n, L = cfg.page_size, 11, 37, cfg.num_layers
    layer = L // 2 if L > 2 else 1
    pages = pool_pages(rng, cfg, P)
    pos = rng.integers(0, P * ps, size=n).astype(np.int32)
    pos[0], pos[-1] = P * ps - 1, 1
    shape = (L, n, cfg.num_kv_heads, cfg.head_dim)
    t_k, t_v = tensor(nan_like(shape, cfg.dtype)), tensor(nan_like(shape, cfg.dtype))

    ix = Indices(pad, pad_value=0)
    mod["debug_get_kv"](tensor(pages), ix(pos), t_k, t_v, layer)
    got_k, got_v = t_k.numpy(), t_v.numpy()
    assert_bitwise_equal(got_k[layer], pages[pos // ps, 0, :, pos % ps, :], f"k_out[{layer}]")
    assert_bitwise_equal(got_v[layer], pages[pos // ps, 1, :, pos % ps, :], f"v_out[{layer}]")
    others = [i for i in range(L) if i != layer]
    assert np.isnan(f64(got_k[others])).all() and np.isnan(f64(got_v[others])).all(), \
        "debug_get_kv wrote outside layer_id"


# ----------------------------------------------------------------------------- split_rotary


@pytest.mark.parametrize("apply_rope", [0, 1])
@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_split_rotary(kernel_build, cfg_name, apply_rope, pad):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("split_rotary", cfg_name, apply_rope, pad))
    Hq, Hkv, D, n = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, 29
    qkv = randn(rng, (n, Hq + 2 * Hkv, D), cfg.dtype)
    pos = rng.integers(0, 4096, size=n).astype(np.int32)
    pos[0], pos[1] = 0, 4095
    t_q = tensor(nan_like((n, Hq, D), cfg.dtype))
    t_k = tensor(nan_like((n, Hkv, D), cfg.dtype))
    t_v = tensor(nan_like((n, Hkv, D), cfg.dtype))

    ix = Indices(pad, pad_value=1)
    mod["split_rotary"](tensor(qkv), ix(pos), t_q, t_k, t_v, apply_rope)
    q_in, k_in, v_in = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    assert_bitwise_equal(t_v.numpy(), v_in, "v")
    if apply_rope == 0:
        assert_bitwise_equal(t_q.numpy(), q_in, "q")
        assert_bitwise_equal(t_k.numpy(), k_in, "k")
    else:
        tol = O_TOL[cfg.dtype]
        exp_q = ref.rope(f64(q_in), pos, cfg.rope_theta, cfg.rope_scale)
        exp_k = ref.rope(f64(k_in), pos, cfg.rope_theta, cfg.rope_scale)
        assert_close(t_q.numpy(), exp_q, tol, "q")
        assert_close(t_k.numpy(), exp_k, tol, "k")
        # The rotation is not a no-op at these positions (guards against a test that cannot fail).
        assert np.abs(exp_q - f64(q_in)).max() > 10 * tol


@pytest.mark.parametrize("name", [*LONGROPE_CONFIGS, *ROTARY_CONFIGS])
@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_split_rotary_variants(kernel_build, name, pad):
    """RoPE variants of split_rotary. LongRoPE: the factors tensor replaces the apply flag;
    tokens at positions before and from ``original`` (2048) use the short and the long factors;
    cos / sin scaled. A partial rotary dim: the first ``rope_rotary_dim`` features rotate (at
    their own frequencies; GPT-J style pairs with ``rope_interleaved``), the others are copied
    bit for bit. v is copied."""
    from reference_model import longrope, rope

    cfg = {**LONGROPE_CONFIGS, **ROTARY_CONFIGS}[name]
    mod = kernel_build(cfg)
    rng = np.random.default_rng(seed_of("rope variant", name, pad))
    Hq, Hkv, D, R, n = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, 33
    qkv = randn(rng, (n, Hq + 2 * Hkv, D), cfg.dtype)
    pos = rng.integers(0, 8192, size=n).astype(np.int32)
    pos[:4] = 0, 2047, 2048, 8191
    outs = [tensor(nan_like((n, h, D), cfg.dtype)) for h in (Hq, Hkv, Hkv)]
    ix = Indices(pad, pad_value=1)
    last = 1 if cfg.rope_ext_factors is None else tensor(np.array(cfg.rope_ext_factors, np.float32))
    mod["split_rotary"](tensor(qkv), ix(pos), *outs, last)
    assert_bitwise_equal(outs[2].numpy(), qkv[:, Hq + Hkv:], "v")
    for what, got, given in (("q", outs[0], qkv[:, :Hq]), ("k", outs[1], qkv[:, Hq:Hq + Hkv])):
        plain = rope(f64(given), pos, cfg.rope_theta, cfg.rope_scale, rotary_dim=R, interleaved=cfg.rope_interleaved)
        if cfg.rope_ext_factors is None:
            expected = plain
        else:
            expected = longrope(f64(given), pos, cfg.rope_theta, cfg.rope_scale, cfg.rope_ext_factors, 2048,
                                cfg.rope_attention_factor)
            # the factors change the result
            assert np.abs(expected[..., :R] - cfg.rope_attention_factor * plain[..., :R]).max() > 0.5
        assert_close(got.numpy()[..., :R], expected[..., :R], 2 * O_TOL[cfg.dtype], what)
        if R < D:
            assert_bitwise_equal(got.numpy()[..., R:], given[..., R:], f"{what} beyond the rotary dim")
        assert np.abs(expected[..., :R] - f64(given)[..., :R]).max() > 0.5  # the rotation is not a no-op


def test_split_rotary_position_zero_is_identity(kernel_build, cfg_name):
    """At position 0 RoPE is the identity: q and k come out bit-identical to the input."""
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("rope0", cfg_name))
    n, Hq, Hkv, D = 5, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = randn(rng, (n, Hq + 2 * Hkv, D), cfg.dtype)
    t_q, t_k, t_v = (tensor(nan_like((n, h, D), cfg.dtype)) for h in (Hq, Hkv, Hkv))
    mod["split_rotary"](tensor(qkv), tensor(np.zeros(n, np.int32)), t_q, t_k, t_v, 1)
    assert_bitwise_equal(t_q.numpy(), qkv[:, :Hq], "q")
    assert_bitwise_equal(t_k.numpy(), qkv[:, Hq:Hq + Hkv], "k")
    assert_bitwise_equal(t_v.numpy(), qkv[:, Hq + Hkv:], "v")


# ----------------------------------------------------------------------------- merge_inplace


def test_merge_inplace(kernel_build, cfg_name):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("merge", cfg_name))
    n, H, D = 40, cfg.num_qo_heads, cfg.v_head_dim
    o1, o2 = randn(rng, (n, H, D), cfg.dtype), randn(rng, (n, H, D), cfg.dtype)
    lse1 = rng.uniform(-12, 12, (n, H)).astype(np.float32)
    lse2 = rng.uniform(-12, 12, (n, H)).astype(np.float32)
    ninf = np.float32(-np.inf)
    lse1[0], lse2[1] = ninf, ninf               # one side empty
    lse1[2], lse2[2] = ninf, ninf               # both empty
    lse1[3, ::2], lse2[3, 1::2] = ninf, ninf    # mixed per head
    lse1[4], lse2[4] = 150.0, 149.0             # 2**lse overflows float32: needs max subtraction
    lse1[5], lse2[5] = -160.0, -161.5           # 2**lse underflows float32
    lse1[6], lse2[6] = 3.0, -90.0               # one side negligible
    lse1[7], lse2[7] = 1.25, 1.25               # equal weights

    exp_o, exp_lse = ref.merge_states(f64(o1), lse1, f64(o2), lse2)
    t_o, t_lse = tensor(o1), tensor(lse1)
    t_o2, t_lse2 = tensor(o2), tensor(lse2)
    mod["merge_inplace"](t_o, t_lse, t_o2, t_lse2)
    got_o, got_lse = t_o.numpy(), t_lse.numpy()
    assert_close(got_o, exp_o, O_TOL[cfg.dtype], "o")
    assert_lse_close(got_lse, exp_lse, "lse")
    # Row 2 (both empty) stays empty with o = 0.
    assert np.isneginf(got_lse[2]).all() and (f64(got_o[2]) == 0).all()
    # The other state is input only.
    assert_bitwise_equal(t_o2.numpy(), o2, "o_other")
    assert_bitwise_equal(t_lse2.numpy(), lse2, "lse_other")


# ----------------------------------------------------------------------------- attention


def sliding_layouts(rng, ps: int, n_random: int):
    """Window layouts: hand-picked edge cases plus random ones."""
    layouts = [
        (0, 0, 0, 0),                     # empty sequence
        (3, 5, 0, 0),                     # no eviction, no sink
        (4, ps, ps // 2, 0),              # window starts mid first page
        (5, 3, ps + 2, 4),                # sink of 4, window starts in the second page
        (2, 1, 3, 3),                     # sink followed directly by the window
        (3, ps - 1, 2 * ps + ps - 1, 2),  # window offset at the end: only the sink is left
        (2, 4, ps + 4, 0),                # every row evicted: 0 rows despite 2 pages
        (1, ps, ps, ps),                  # the whole (single) page is sink
    ]
    for _ in range(n_random):
        npg = int(rng.integers(1, 7))
        last = int(rng.integers(1, ps + 1))
        total = (npg - 1) * ps + last
        sink = int(rng.integers(0, min(total, 2 * ps) + 1))
        off = int(rng.integers(sink, min(total, sink + 2 * ps) + 1))
        layouts.append((npg, last, off, sink))
    return layouts


SM_SCALES = {"mild": 1.3, "sharp": 6.0}  # times 1/sqrt(head_dim)


def prefill_shapes(rng, ps: int, causal: int):
    """(q_len, kv_len) pairs; with causal kv_len >= q_len as in the cache."""
    shapes = [(0, 2 * ps + 3), (1, ps), (ps + 3, 5 * ps + 1), (2, 2), (19, 19), (0, 0),
              (9, 9 + 3 * ps - 1), (1, 1)]
    if not causal:
        shapes += [(5, 0), (12, 3)]
    for _ in range(3):
        kv = int(rng.integers(1, 9 * ps))
        shapes.append((int(rng.integers(0, min(kv, 24) + 1)), kv))
    rng.shuffle(shapes)
    return shapes


#: (causal, rotary_mode, sm_scale kind). A sharp softmax (large scores) checks the online-softmax
#: rescaling; it is not combined with inline RoPE, whose float32 angles (see LSE_ATOL_ROPE) would
#: be amplified by the large scale beyond the output tolerance.
ATTN_CASES = [(c, r, "mild") for c in (0, 1) for r in (0, 1)] + [(c, 0, "sharp") for c in (0, 1)]
DECODE_CASES = [(0, "mild"), (1, "mild"), (0, "sharp")]


@pytest.mark.parametrize("causal,rotary,sm", ATTN_CASES)
@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_attention_prefill_ragged(kernel_build, cfg_name, causal, rotary, sm, pad):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("ragged", cfg_name, causal, rotary, sm, pad))
    Hq, Hkv, D = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = prefill_shapes(rng, 16, causal)  # 16 = the ragged kernel's kv chunk
    shapes += [(3, 33), (1, 64)] if causal else [(40, 7)]
    q_lens, kv_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    kv_indptr = np.cumsum([0] + kv_lens).astype(np.int32)
    nq, nkv, B = int(qo_indptr[-1]), int(kv_indptr[-1]), len(shapes)
    q = randn(rng, (nq, Hq, D), cfg.dtype)
    k = randn(rng, (nkv, Hkv, D), cfg.dtype)
    v = randn(rng, (nkv, Hkv, D), cfg.dtype)
    q_pos = rng.integers(0, 3000, nq).astype(np.int32)
    k_pos0 = rng.integers(0, 3000, B).astype(np.int32)
    theta, scale = rope_args(rng)
    sm_scale = SM_SCALES[sm] / math.sqrt(D)

    t_o, t_lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like((nq, Hq), np.float32))
    ix = Indices(pad, pad_value=0)
    mod["attention_prefill_ragged"](tensor(q), ix(qo_indptr), tensor(k), tensor(v), ix(kv_indptr),
                                    ix(q_pos), ix(k_pos0), t_o, t_lse, causal, rotary,
                                    scale, theta, sm_scale)
    got_o, got_lse = t_o.numpy(), t_lse.numpy()
    for b in range(B):
        qs, ks = slice(qo_indptr[b], qo_indptr[b + 1]), slice(kv_indptr[b], kv_indptr[b + 1])
        exp_o, exp_lse = reference_attention(q[qs], k[ks], v[ks], causal=causal, rotary=rotary,
                                             q_pos=q_pos[qs], k_pos0=k_pos0[b], theta=theta,
                                             scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[qs], got_lse[qs], exp_o, exp_lse, cfg.dtype,
                                f"seq {b} (q_len={q_lens[b]}, kv_len={kv_lens[b]})", rotary)


def _paged_variant_params():
    return [(n, False) for n in CFG_NAMES] + [(n, True) for n in SW_NAMES]


def _paged_batch(rng, cfg, sliding, causal):
    """Layouts and per-sequence q_len for a paged prefill batch."""
    ps = cfg.page_size
    if sliding:
        layouts = sliding_layouts(rng, ps, 4)
        q_lens = []
        for npg, last, off, sink in layouts:
            rows = (npg - 1) * ps + last - off + sink if npg else 0
            hi = min(rows, 20) if causal else 20
            q_lens.append(int(rng.integers(0, hi + 1)))
        q_lens[1] = 0  # always a sequence without queries
        return layouts, q_lens
    shapes = prefill_shapes(rng, ps, causal)
    return [plain_layout(kv, ps) for _, kv in shapes], [q for q, _ in shapes]


@pytest.mark.parametrize("name,sliding", _paged_variant_params())
@pytest.mark.parametrize("causal,rotary,sm", ATTN_CASES)
@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_attention_prefill_paged(kernel_build, name, sliding, causal, rotary, sm, pad):
    cfg = CONFIGS[name]
    mod = kernels(kernel_build, name)
    rng = np.random.default_rng(seed_of("paged_prefill", name, sliding, causal, rotary, sm, pad))
    Hq, D = cfg.num_qo_heads, cfg.head_dim
    layouts, q_lens = _paged_batch(rng, cfg, sliding, causal)
    batch = PagedBatch(rng, cfg, layouts, sliding)
    B = len(layouts)
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    nq = int(qo_indptr[-1])
    q = randn(rng, (nq, Hq, D), cfg.dtype)
    q_pos = rng.integers(0, 3000, nq).astype(np.int32)
    k_pos0 = rng.integers(0, 3000, B).astype(np.int32)
    theta, scale = rope_args(rng)
    sm_scale = SM_SCALES[sm] / math.sqrt(D)

    t_o, t_lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like((nq, Hq), np.float32))
    ix = Indices(pad, pad_value=0)
    role = "attention_prefill_sliding_window" if sliding else "attention_prefill"
    mod[role](tensor(q), ix(qo_indptr), tensor(batch.pages), ix(batch.page_indptr),
              ix(batch.page_indices), ix(batch.length_info), ix(k_pos0), ix(q_pos), t_o, t_lse,
              causal, rotary, scale, theta, sm_scale)
    got_o, got_lse = t_o.numpy(), t_lse.numpy()
    for b in range(B):
        qs = slice(qo_indptr[b], qo_indptr[b + 1])
        K, V = batch.kv(b)
        exp_o, exp_lse = reference_attention(q[qs], K, V, causal=causal, rotary=rotary,
                                             q_pos=q_pos[qs], k_pos0=k_pos0[b], theta=theta,
                                             scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[qs], got_lse[qs], exp_o, exp_lse, cfg.dtype,
                                f"seq {b} (q_len={q_lens[b]}, layout={layouts[b]})", rotary)


@pytest.mark.parametrize("name,sliding", _paged_variant_params())
@pytest.mark.parametrize("rotary,sm", DECODE_CASES)
@pytest.mark.parametrize("pad", [0, VIEW_PAD])
def test_attention_decode(kernel_build, name, sliding, rotary, sm, pad):
    cfg = CONFIGS[name]
    mod = kernels(kernel_build, name)
    rng = np.random.default_rng(seed_of("decode", name, sliding, rotary, sm, pad))
    Hq, D, ps = cfg.num_qo_heads, cfg.head_dim, cfg.page_size
    if sliding:
        layouts = sliding_layouts(rng, ps, 5)
    else:
        kv_lens = [0, 1, ps, ps + 1, 7 * ps + 3, 2 * ps - 1] + [int(x) for x in rng.integers(1, 10 * ps, 4)]
        layouts = [plain_layout(kv, ps) for kv in kv_lens]
    order = rng.permutation(len(layouts))
    layouts = [layouts[i] for i in order]
    batch = PagedBatch(rng, cfg, layouts, sliding)
    B = len(layouts)
    q = randn(rng, (B, Hq, D), cfg.dtype)
    q_pos = rng.integers(0, 3000, B).astype(np.int32)
    k_pos0 = rng.integers(0, 3000, B).astype(np.int32)
    theta, scale = rope_args(rng)
    sm_scale = SM_SCALES[sm] / math.sqrt(D)

    t_o, t_lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like((B, Hq), np.float32))
    ix = Indices(pad, pad_value=0)
    role = "attention_decode_sliding_window" if sliding else "attention_decode"
    mod[role](tensor(q), tensor(batch.pages), ix(batch.page_indptr), ix(batch.page_indices),
              ix(batch.length_info), ix(k_pos0), ix(q_pos), t_o, t_lse, rotary, scale, theta,
              sm_scale)
    got_o, got_lse = t_o.numpy(), t_lse.numpy()
    for b in range(B):
        K, V = batch.kv(b)
        exp_o, exp_lse = reference_attention(q[b:b + 1], K, V, causal=False, rotary=rotary,
                                             q_pos=q_pos[b:b + 1], k_pos0=k_pos0[b], theta=theta,
                                             scale=scale, sm_scale=sm_scale)
        check_attention_outputs(got_o[b:b + 1], got_lse[b:b + 1], exp_o, exp_lse, cfg.dtype,
                                f"seq {b} (layout={layouts[b]})", rotary)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_attention_causal_more_queries_than_keys(kernel_build, kind):
    """Documented semantics beyond what the cache uses: with causal, q_len > kv_len leaves the
    first q_len - kv_len queries without visible keys (o = 0, lse = -inf)."""
    name = "f32_gqa"
    cfg = CONFIGS[name]
    mod = kernels(kernel_build, name)
    rng = np.random.default_rng(seed_of("causal_q_gt_kv", kind))
    Hq, Hkv, D, ps = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size
    shapes = [(12, 3), (20, 0), (5, 5), (30, 17)]
    q_lens, kv_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    qo_indptr = np.cumsum([0] + q_lens).astype(np.int32)
    nq, B = int(qo_indptr[-1]), len(shapes)
    q = randn(rng, (nq, Hq, D), cfg.dtype)
    q_pos = rng.integers(0, 100, nq).astype(np.int32)
    k_pos0 = rng.integers(0, 100, B).astype(np.int32)
    sm_scale = 1.3 / math.sqrt(D)
    t_o, t_lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like((nq, Hq), np.float32))
    if kind == "ragged":
        kv_indptr = np.cumsum([0] + kv_lens).astype(np.int32)
        k = randn(rng, (int(kv_indptr[-1]), Hkv, D), cfg.dtype)
        v = randn(rng, (int(kv_indptr[-1]), Hkv, D), cfg.dtype)
        mod["attention_prefill_ragged"](tensor(q), tensor(qo_indptr), tensor(k), tensor(v),
                                        tensor(kv_indptr), tensor(q_pos), tensor(k_pos0), t_o,
                                        t_lse, 1, 0, 1.0, 1e4, sm_scale)
        kvs = [(k[kv_indptr[b]:kv_indptr[b + 1]], v[kv_indptr[b]:kv_indptr[b + 1]]) for b in range(B)]
    else:
        batch = PagedBatch(rng, cfg, [plain_layout(kv, ps) for kv in kv_lens], False)
        mod["attention_prefill"](tensor(q), tensor(qo_indptr), tensor(batch.pages),
                                 tensor(batch.page_indptr), tensor(batch.page_indices),
                                 tensor(batch.length_info), tensor(k_pos0), tensor(q_pos), t_o,
                                 t_lse, 1, 0, 1.0, 1e4, sm_scale)
        kvs = [batch.kv(b) for b in range(B)]
    got_o, got_lse = t_o.numpy(), t_lse.numpy()
    for b in range(B):
        qs = slice(qo_indptr[b], qo_indptr[b + 1])
        exp_o, exp_lse = ref.attention(f64(q[qs]), f64(kvs[b][0]), f64(kvs[b][1]), sm_scale, causal=True)
        check_attention_outputs(got_o[qs], got_lse[qs], exp_o, exp_lse, cfg.dtype,
                                f"seq {b} (q_len={q_lens[b]}, kv_len={kv_lens[b]})")


# ----------------------------------------------------------------------------- token trees


def _random_parents(rng, size: int):
    shape = rng.choice(["chain", "star", "random", "forest"])
    if shape == "chain":
        return [i - 1 for i in range(size)]
    if shape == "star":
        return [-1] + [0] * (size - 1)
    if shape == "forest":
        return [-1 if i % 5 == 0 else int(rng.integers(i - i % 5, i)) for i in range(size)]
    return [-1] + [int(rng.integers(0, i)) for i in range(1, size)]


def _ancestor_mask(parents) -> np.ndarray:
    """visible[i, j]: node j is node i or one of its ancestors (from parent pointers)."""
    visible = np.zeros((len(parents), len(parents)), dtype=bool)
    for i in range(len(parents)):
        j = i
        while j != -1:
            visible[i, j] = True
            j = parents[j]
    return visible


def _tree_masks(trees):
    from relax_kvcache.token_tree import TokenTree

    intervals = [iv for t in trees for iv in TokenTree.build(t, seq_id=0).intervals]
    mn = np.cumsum([0] + [len(t) for t in trees]).astype(np.int32)
    return mn, np.array(intervals, np.int32).reshape(-1, 2)


def test_attention_prefill_ragged_tree(kernel_build, cfg_name):
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("ragged_tree", cfg_name))
    trees = [_random_parents(rng, int(n)) for n in (1, 7, 23, 12)]
    mn, mask = _tree_masks(trees)
    n = int(mn[-1])
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = randn(rng, (n, hq, d), cfg.dtype), randn(rng, (n, hkv, d), cfg.dtype), randn(rng, (n, hkv, d), cfg.dtype)
    o, lse = tensor(nan_like((n, hq, d), cfg.dtype)), tensor(nan_like((n, hq), "float32"))
    sm = 1.3 / np.sqrt(d)
    mod["attention_prefill_ragged_tree"](tensor(q), tensor(mn), tensor(k), tensor(v), tensor(mn),
                                         tensor(np.zeros(n, np.int32)), tensor(mn), tensor(mask), o, lse, 0,
                                         1.0, 1e4, sm)
    for b, parents in enumerate(trees):
        rows = slice(mn[b], mn[b + 1])
        exp_o, exp_lse = ref.attention(f64(q[rows]), f64(k[rows]), f64(v[rows]), sm, causal=False,
                                       mask=_ancestor_mask(parents))
        check_attention_outputs(o.numpy()[rows], lse.numpy()[rows], exp_o, exp_lse, cfg.dtype, f"tree {b}")


def test_attention_prefill_paged_tree(kernel_build, cfg_name):
    """Prefix rows followed by the tree's nodes in the pages; queries are the last nodes."""
    cfg = CONFIGS[cfg_name]
    mod = kernels(kernel_build, cfg_name)
    rng = np.random.default_rng(seed_of("paged_tree", cfg_name))
    ps = cfg.page_size
    trees = [_random_parents(rng, int(n)) for n in (5, 14, 1, 9)]
    prefix = [0, 3 * ps + 2, 7, ps]
    queries = [5, 6, 1, 9]  # the last nodes of each tree (the step's new nodes)
    layouts = [plain_layout(p + len(t), ps) for p, t in zip(prefix, trees)]
    batch = PagedBatch(rng, cfg, layouts, sliding=False)  # trees never run with windows: [B] length info
    mn, mask = _tree_masks(trees)
    qo = np.cumsum([0] + queries).astype(np.int32)
    hq, d = cfg.num_qo_heads, cfg.head_dim
    q = randn(rng, (int(qo[-1]), hq, d), cfg.dtype)
    o, lse = tensor(nan_like(q.shape, cfg.dtype)), tensor(nan_like(q.shape[:2], "float32"))
    sm = 1.3 / np.sqrt(d)
    mod["attention_prefill_tree"](tensor(q), tensor(qo), tensor(batch.pages), tensor(batch.page_indptr),
                                  tensor(batch.page_indices), tensor(batch.length_info),
                                  tensor(np.zeros(4, np.int32)), tensor(np.zeros(int(qo[-1]), np.int32)), o, lse, 0,
                                  1.0, 1e4, sm, tensor(mn), tensor(mask))
    for b, parents in enumerate(trees):
        K, V = batch.kv(b)
        tree_rows = _ancestor_mask(parents)[len(parents) - queries[b]:]
        visible = np.concatenate([np.ones((queries[b], prefix[b]), bool), tree_rows], axis=1)
        rows = slice(qo[b], qo[b + 1])
        exp_o, exp_lse = ref.attention(f64(q[rows]), f64(K), f64(V), sm, causal=False, mask=visible)
        check_attention_outputs(o.numpy()[rows], lse.numpy()[rows], exp_o, exp_lse, cfg.dtype, f"tree {b}")
