"""The cache under test in the state machine (``state_machine_model``): its small configs, how it is
built, read (``debug_get_kv``) and snapshotted, and the structural invariants of its paging state.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Optional, Tuple

import numpy as np
import tvm

import relax_kvcache as rk
from relax_kvcache.build import build_kernels
from relax_kvcache.kernel_set import KernelSet
from relax_kvcache.runtime import default_target

PAGE_SIZE = 4
NUM_LAYERS = 2
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 16
CHUNK = 32  # prefill_chunk_size: the most tokens one step may append
SM_SCALE = HEAD_DIM ** -0.5
ATTENTION_CHUNK = 6  # the chunked cache's layer 0: not a multiple of PAGE_SIZE
KINDS = ("plain", "sliding", "chunked", "fp8", "prefix")
#: the fp8 cache's K and V scales (powers of two: values on the 8-bit grid times them are stored
#: exactly, so the model's exact checks hold)
FP8_SCALES = (0.5, 2.0)


class Mismatch(AssertionError):
    """The cache did something the model says it must not."""


# ----------------------------------------------------------------------------------- the cache

def make_config(kind: str) -> rk.KVCacheConfig:
    """A tiny config: 13 pages of 4 tokens (``plain``, ``chunked``: layer 0 attends within chunks
    of ``ATTENTION_CHUNK`` tokens; ``fp8``: pages of ``float8_e4m3fn``), 21 with per-sequence
    sliding windows (``sliding``); ``prefix``: prefix caching with a host tier of 6 pages."""
    chunked = dict(attn_kinds=(rk.AttnKind.MHA_CHUNKED_LOCAL,) + (rk.AttnKind.MHA,) * (NUM_LAYERS - 1),
                   attention_chunk_size=ATTENTION_CHUNK) if kind == "chunked" else {}
    return rk.KVCacheConfig(
        num_layers=NUM_LAYERS, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        page_size=PAGE_SIZE, max_num_seqs=4, max_total_seq_len=48, prefill_chunk_size=CHUNK,
        rope_mode=rk.RopeMode.NONE, dtype="float32", support_sliding_window=kind == "sliding",
        kv_dtype="float8_e4m3fn" if kind == "fp8" else None, prefix_caching=kind == "prefix",
        host_cache_pages=6 if kind == "prefix" else 0, **chunked)


_KERNELS: Dict[str, KernelSet] = {}


def make_cache(kind: str) -> rk.PagedAttentionKVCache:
    """A fresh cache of ``kind`` (kernels built once per process, then from the on-disk cache)."""
    cfg = make_config(kind)
    if kind not in _KERNELS:
        _KERNELS[kind] = KernelSet.from_module(build_kernels(cfg, default_target(tvm.cpu())))
    cache = rk.PagedAttentionKVCache(cfg, tvm.cpu(), kernels=_KERNELS[kind])
    if cfg.kv_dtype is not None:
        for layer in range(NUM_LAYERS):
            cache.set_kv_scales(layer, *FP8_SCALES)
    return cache


#: the prefix cache's prompts start with a prefix of one of these (system prompts)
STEMS = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3, 4, 9, 9, 9, 9, 5), (7,) * 10)


def token_kv(token: int, position: int) -> np.ndarray:
    """The prefix cache's K and V rows ``(layers, 2 * Hkv, D)`` of a token: a function of its id and
    position only, as in a model, so a sequence on cached pages holds what it would compute."""
    return np.random.default_rng([token, position]).standard_normal(
        (NUM_LAYERS, 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)


def read_kv(cache: rk.PagedAttentionKVCache, seq_id: int, length: int) -> Tuple[np.ndarray, np.ndarray]:
    """K and V ``(layers, length, Hkv, D)`` of a sequence, read with ``debug_get_kv``."""
    shape = (NUM_LAYERS, length, NUM_KV_HEADS, HEAD_DIM)
    k, v = tvm.runtime.empty(shape, "float32"), tvm.runtime.empty(shape, "float32")
    cache.debug_get_kv(seq_id, 0, length, k, v)
    return k.numpy(), v.numpy()


def read_all_kv(cache: rk.PagedAttentionKVCache) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    paging = cache._paging
    return {s: read_kv(cache, s, paging.sequence_length(s)) for s in paging.seq_ids()
            if paging.sequence_length(s)}


def snapshot(cache: rk.PagedAttentionKVCache, kv: Optional[dict] = None) -> Dict[str, Any]:
    """Everything an operation could change. ``kv``: the sequences' ``debug_get_kv`` contents when
    already read from this very state (the harness reuses the last check's read)."""
    return {
        "paging": cache._paging.debug_snapshot(),
        "paging_version": cache._paging.version,  # bumped by every change of the paging state
        "step_active": cache._step is not None,
        "free_pages": cache.get_num_available_pages(),
        "total_length": cache.get_total_sequence_length(),
        "page_bytes": [p.numpy().tobytes() for p in cache._pages],
        "kv": read_all_kv(cache) if kv is None else kv,
    }


def assert_unchanged(before: Dict[str, Any], after: Dict[str, Any], what: str) -> None:
    for key in ("paging", "paging_version", "step_active", "free_pages", "total_length"):
        if before[key] != after[key]:
            raise Mismatch(f"{what} raised but changed {key}: {before[key]!r} -> {after[key]!r}")
    if before["page_bytes"] != after["page_bytes"]:
        raise Mismatch(f"{what} raised but changed page contents")
    if before["kv"].keys() != after["kv"].keys():
        raise Mismatch(f"{what} raised but changed the sequences read by debug_get_kv")
    for seq, (k, v) in before["kv"].items():
        k2, v2 = after["kv"][seq]
        if k.tobytes() != k2.tobytes() or v.tobytes() != v2.tobytes():
            raise Mismatch(f"{what} raised but changed the K/V of sequence {seq}")


# ----------------------------------------------------------------------------------- invariants

def check_paging_invariants(cache: rk.PagedAttentionKVCache) -> None:
    """Structural invariants of the paging state (see ``test_property``'s docstring).

    Ownership rule (``paging/block_pool.py``, TVM's ``external_ref_cnt``): a live block's
    ``ref_count`` is the number of live blocks whose parent it is plus the number of sequences whose
    last block it is; only `BlockPool` changes it, and a block is freed when its count would drop to 0.
    Pages are owned by blocks: a page is free or in exactly one live block's ``page_ids``.
    """
    paging, ps = cache._paging, PAGE_SIZE
    num_pages = paging.num_pages
    free = list(paging.free_page_ids()) + list(paging._pages.cached_page_ids())  # cached: available
    live = paging._blocks.live_indices()
    blocks = {i: paging.block(i) for i in live}
    ensure(len(set(free)) == len(free), f"free list has duplicates: {free}")
    owned = [p for b in blocks.values() for p in b.page_ids]
    registered = {page for page, _ in paging.registered_pages()}
    counts = collections.Counter(owned)
    for page, n in counts.items():  # only registered (full, never written) pages are shared
        ensure(n == paging._pages.refs(page), f"page {page} is held by {n} blocks, refs {paging._pages.refs(page)}")
        ensure(n == 1 or page in registered, f"a page is owned by two blocks (or twice): {sorted(owned)}")
    ensure(set(paging._pages.cached_page_ids()) <= registered, "a cached page is not registered")
    owned = sorted(counts)
    ensure(not set(owned) & set(free), f"pages both free and used: {sorted(set(owned) & set(free))}")
    ensure(sorted(owned + free) == list(range(num_pages)),
            f"pages lost or out of range: owned {sorted(owned)}, free {sorted(free)}")
    ensure(len(owned) + len(free) == num_pages == cache.config.num_total_pages, "page count")
    ensure(cache.get_num_available_pages() == len(free), "get_num_available_pages != free list length")
    free_blocks = list(paging._blocks.free_block_indices())
    ensure(sorted(free_blocks + live) == list(range(len(paging._blocks))), "block indices lost or reused twice")
    refs = collections.Counter(b.parent for b in blocks.values() if b.parent != -1)
    seqs = [paging.sequence(s) for s in paging.seq_ids()]
    refs.update(s.last_block for s in seqs)
    for i, b in blocks.items():
        ensure(b.ref_count == refs[i], f"block {i} has ref_count {b.ref_count}, expected {refs[i]} "
                                        "(child blocks + sequences ending there)")
    reachable = set()
    for seq in seqs:
        _check_path(paging, seq, blocks, ps)
        idx = seq.last_block
        while idx != -1 and idx not in reachable:
            reachable.add(idx)
            idx = blocks[idx].parent
    ensure(reachable == set(live), f"live blocks unreachable from any sequence: {set(live) - reachable}")
    ensure(paging.total_sequence_length() == sum(s.seq_length for s in seqs), "total sequence length")
    ensure(cache.empty() == (not seqs), f"empty() is {cache.empty()} with {len(seqs)} sequence(s)")


def _check_path(paging, seq, blocks, ps: int) -> None:
    trace = paging.block_trace(seq.seq_id)
    ensure(all(i in blocks for i in trace), f"sequence {seq.seq_id} reaches a freed block")
    ensure(blocks[seq.last_block].ref_count == 1,
            f"last block of sequence {seq.seq_id} is shared (ref_count {blocks[seq.last_block].ref_count})")
    start = 0
    for depth, idx in enumerate(trace):
        b = blocks[idx]
        ensure(b.start_pos == start, f"block {idx} starts at {b.start_pos}, its ancestors hold {start}")
        used = b.seq_length - b.sink_length + b.sliding_window_offset
        ensure(b.sliding_window_offset >= b.sink_length >= 0, f"block {idx} window offset < sink")
        ensure(len(b.page_ids) == -(-used // ps), f"block {idx} holds {len(b.page_ids)} pages for {used} slots")
        if depth < len(trace) - 1:
            ensure(b.seq_length > 0 and b.seq_length % ps == 0 and not b.sink_length
                    and not b.sliding_window_offset, f"prefix block {idx} is not whole unslid pages")
        start += b.seq_length
    ensure(start == seq.seq_length, f"sequence {seq.seq_id} has length {seq.seq_length}, blocks {start}")


def ensure(cond: bool, message: str) -> None:
    """Raise `Mismatch` with ``message`` unless ``cond``."""
    if not cond:
        raise Mismatch(message)
