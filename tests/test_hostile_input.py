"""Randomised hostile-input campaign against every entry point of the cache.

Entry points: every ``vm.builtin.*`` function the cache serves (enumerated from
``ffi_registry.BUILTINS``; :func:`test_campaign_covers_every_builtin` keeps the table below in
step with it) and the corresponding ``PagedAttentionKVCache`` methods. Each case starts from a
valid call on a cache with live sequences (and an active step where the call needs one) and
replaces one argument by a value drawn at random from a catalogue of hostile values:

* scalars: None, floats (also integral ones), NaN, inf, strings, bools, complex, objects, lists,
  ShapeTuples and tensors where an int is expected; negative, huge (2**62, 2**63 - 1, -2**63)
  and overflowing (2**63, -2**63 - 1, 2**64) integers; ids and positions out of range;
* integer lists: wrong containers (str, bytes, dict, set, generator, tensor), bad elements,
  unknown or duplicate ids, empty batches, mismatched lengths, malformed token trees;
* tensors: not a tensor (None, numbers, lists, ShapeTuple, numpy arrays), wrong rank, dtype,
  shape, zero-size, wrong device (``cpu(1)``), non-contiguous (DLPack of numpy slices),
  views with a byte offset (``_create_view``) and data pointers off TVM's 64-byte alignment;
* builtins only: a missing or an extra argument.

Every case must raise a ``relax_kvcache.errors.KVCacheError`` (``NotImplementedError`` for
the builtins the cache does not support) whose message names the argument or the bad value,
and leave the cache exactly as it was (paging state, forward step, K/V of every sequence and
the raw page tensors, see ``support.snapshot``). A call that succeeds is a failure (silent
acceptance): the catalogue holds no valid value. Through ``vm.builtin.*`` the exception crosses
tvm_ffi and arrives with its class (``ffi_registry.register`` registers our classes) and message.

Deliberately accepted (not hostile, see :func:`test_accepted_inputs`): numpy integers for ints,
any int within int64 for a new sequence id (TVM's ids are int64), finite floats of any size for
``sm_scale``, tuples / ShapeTuples / tvm_ffi Arrays / 1-D integer numpy arrays for id lists,
an empty commit batch, consistent zero-row tensors for ``merge_attn_output_inplace``.

Creation is attacked the same way: ``relax_kvcache.paged_attention_kv_cache_create`` (TVM's
positional convention, one hostile argument of 28 per case, or a wrong count), ``KVCacheConfig``
fields and ``PagedAttentionKVCache``'s device / kernels / layer_offset.

Scale with ``RELAX_KVCACHE_HOSTILE_CASES`` (cases per entry point and surface, default 60) and
``RELAX_KVCACHE_HOSTILE_SEED``; ``RELAX_KVCACHE_HOSTILE_REPORT=1`` prints the coverage.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import math
import os
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.runtime import ShapeTuple

import relax_kvcache as rk
from support.small_cache import create_args
from support.snapshot import assert_same, snapshot
from relax_kvcache.args import describe
from relax_kvcache.ffi_registry import BUILTINS
from relax_kvcache.ffi_registry.builtins import _arity
from relax_kvcache.kernel_set import KernelSet
from relax_kvcache.tensors import view

CASES = int(os.environ.get("RELAX_KVCACHE_HOSTILE_CASES", "60"))
SEED = int(os.environ.get("RELAX_KVCACHE_HOSTILE_SEED", "20250"))
REPORT = os.environ.get("RELAX_KVCACHE_HOSTILE_REPORT") == "1"
STATS: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

_BASE = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=8, max_num_seqs=8,
             max_total_seq_len=200, prefill_chunk_size=64, rope_mode=rk.RopeMode.NORMAL, dtype="float32")
CONFIGS = {
    "mha": rk.KVCacheConfig(**_BASE),  # support.small_cache.CFG: the kernel build is shared
    "window": rk.KVCacheConfig(**_BASE, support_sliding_window=True),
    "mla": rk.KVCacheConfig(**dict(_BASE, num_qo_heads=2, num_kv_heads=1, head_dim=48, v_head_dim=32,
                                   rope_mode=rk.RopeMode.NONE),
                            mla_original_qk_head_dim=24, mla_original_v_head_dim=16,
                            attn_kinds=[rk.AttnKind.MLA] * 2, context_chunk_size=16),
}
TREE = (-1, 0, 0, 1)


# ---------------------------------------------------------------------------- caches


def _data(rng: np.random.Generator, shape, dtype="float32") -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype))


def _run_step(cache, rng, seq_ids, lengths, tree=None) -> None:
    """One complete forward step that appends random K/V."""
    cfg, n = cache.config, sum(lengths)
    cache.begin_forward(seq_ids, lengths, tree)
    for layer in range(cfg.num_layers):
        if cfg.is_mla:
            cache.append_mla_kv(layer, _data(rng, (n, cfg.head_dim)))
        else:
            qkv = _data(rng, (n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim))
            cache.attention_with_fused_qkv(layer, qkv, tvm.runtime.empty((n, cfg.num_qo_heads, cfg.head_dim)), 0.2)
    cache.end_forward()


def _checkpoint_group(ctx: "Ctx", seq_id: int) -> tvm.runtime.Tensor:
    """A page group of sequence ``seq_id``'s length, random contents."""
    length = ctx.cache._paging.sequence_length(seq_id)
    cfg = ctx.cfg
    return _data(ctx.rng, (1, -(-length // cfg.page_size), 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim))


class Ctx:
    """A cache of one variant with sequences 0 (length 21), 1 (forked from 0 at 13, then 4 more
    tokens) and 2 (3 tokens; in ``mha`` plus a 4-node token tree appended by its last step);
    half the time sequences 0 and 1 then take a decode step (lengths 22 and 18)."""

    def __init__(self, variant: str, kernels: KernelSet, rng: np.random.Generator) -> None:
        self.variant, self.cfg, self.rng = variant, CONFIGS[variant], rng
        self.cache = rk.PagedAttentionKVCache(self.cfg, tvm.cpu(), kernels=kernels)
        c = self.cache
        c.add_sequence(0)
        _run_step(c, rng, [0], [21])
        c.fork_sequence(0, 1, 13)
        _run_step(c, rng, [1], [4])
        c.add_sequence(2)
        _run_step(c, rng, [2], [3])
        if variant == "mha":
            _run_step(c, rng, [2], [len(TREE)], list(TREE))
        if rng.random() < 0.5:  # a decode step: a repeat of it takes begin_forward's incremental path
            _run_step(c, rng, [0, 1], [1, 1])
        self.n = 0

    def enter(self, phase: str) -> None:
        """Put the cache in ``phase``: "idle" (no step), "step" (a decode or prefill step of
        sequences 0 and 1) or "any" (either)."""
        if phase == "any":
            phase = "step" if self.rng.random() < 0.5 else "idle"
        if phase in ("importing", "imported"):  # a checkpoint of sequence 0 importing into 5
            self.cache.prepare_import(5, self.cache.get_checkpoint_metadata(0))
            if phase == "imported":
                for group in range(self.cfg.num_layers):
                    self.cache.import_page_group(5, group, _checkpoint_group(self, 0))
        if phase == "step":
            lengths = [1, 1] if self.rng.random() < 0.5 else [3, 2]
            self.cache.begin_forward([0, 1], lengths)
            self.n = sum(lengths)
            cfg = self.cache.config
            if not cfg.is_mla:  # the layers' K/V appended (what attention_with_shared_kv reads)
                for layer in range(cfg.num_layers):
                    qkv = _data(self.rng, (self.n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim))
                    self.cache.attention_with_fused_qkv(layer, qkv, tvm.runtime.empty(
                        (self.n, cfg.num_qo_heads, cfg.head_dim), cfg.dtype), 0.2)

    def usable(self) -> None:
        """The cache still serves a complete step (after all the errors)."""
        self.cache.end_forward()
        _run_step(self.cache, self.rng, [0, 1], [2, 1])


# ---------------------------------------------------------------------------- entry points


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: Tuple[int, ...]
    dtype: str
    free_rows: bool = False  # dim 0 may be larger than the step's tokens


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    kind: str  # catalogue key, see HOSTILE
    valid: Callable[[Ctx], Any]
    names: Tuple[str, ...] = ()  # other words a message may use for this argument


@dataclasses.dataclass(frozen=True)
class Entry:
    method: Optional[str]  # PagedAttentionKVCache method (None: builtin only)
    builtin: Optional[str]  # "vm.builtin." name without the prefix (None: Python only)
    variants: Tuple[str, ...]
    phase: str  # "idle", "step" or "any"
    args: Tuple[Arg, ...] = ()
    builtin_order: Optional[Tuple[str, ...]] = None  # builtin argument order, by name
    coupled: bool = False  # a bad argument may be reported under another argument's name
    unsupported: bool = False  # the builtin raises NotImplementedError whatever it gets
    label: Optional[str] = None  # test id (default: the method or builtin name)

    @property
    def id(self) -> str:
        return self.label or self.method or self.builtin


def _tensor(shape_of: Callable[[Ctx], Tuple[int, ...]], dtype: Optional[str] = None, free_rows=False):
    """A valid tensor argument: random data of shape ``shape_of(ctx)``."""
    def make(ctx: Ctx) -> tvm.runtime.Tensor:
        spec = TensorSpec(tuple(shape_of(ctx)), dtype or ctx.cfg.dtype, free_rows)
        t = _data(ctx.rng, spec.shape, spec.dtype)
        SPECS[id(t)] = spec
        return t
    return make


SPECS: Dict[int, TensorSpec] = {}  # id(valid tensor) -> its spec (hostile tensors are derived from it)


def _const(value):
    return lambda ctx: value


def _heads(ctx):
    c = ctx.cfg
    return (c.num_qo_heads, c.mla_original_qk_head_dim, c.num_qo_heads, c.mla_original_v_head_dim) if c.is_mla \
        else (c.num_qo_heads, c.head_dim, c.num_kv_heads, c.v_head_dim)


LAYER = Arg("layer_id", "layer", _const(1), ("layer",))
GROUP = Arg("group_id", "layer", _const(1), ("group",))
SCALE = Arg("sm_scale", "scale", _const(0.25))
SEQ = ("sequence", "seq_id")
Q = Arg("q", "tensor", _tensor(lambda x: (x.n, _heads(x)[0], _heads(x)[1])))
K = Arg("k", "tensor", _tensor(lambda x: (x.n, _heads(x)[2] if not x.cfg.is_mla else x.cfg.num_qo_heads,
                                           _heads(x)[1])))
V = Arg("v", "tensor", _tensor(lambda x: (x.n, _heads(x)[2] if not x.cfg.is_mla else x.cfg.num_qo_heads,
                                           _heads(x)[3])))
O = Arg("o", "tensor", _tensor(lambda x: (x.n, _heads(x)[0], _heads(x)[3])))
LSE = Arg("lse", "tensor", _tensor(lambda x: (x.n, x.cfg.num_qo_heads), "float32"))
CROSS_Q = Arg("q", "tensor", _tensor(lambda x: (x.n, x.cfg.num_qo_heads, x.cfg.head_dim)))
CROSS_O = Arg("o", "tensor", _tensor(lambda x: (x.n, x.cfg.num_qo_heads, x.cfg.v_head_dim)))
MHA_MLA = ("mha", "mla")


def _merge_arg(name, lse):
    def shape(x):
        return (x.n or 3, x.cfg.num_qo_heads) + (() if lse else (_heads(x)[3],))
    return Arg(name, "tensor", _tensor(shape, "float32" if lse else None, free_rows=True))


def _no_op_decompress(latent, k, v):
    """Writes constants (the cache checks that k and v were written, not what they hold)."""
    for t in (k, v):
        host = t.numpy()
        host[...] = 0.5
        t.copyfrom(host)


ENTRIES: Tuple[Entry, ...] = (
    Entry("add_sequence", "kv_state_add_sequence", MHA_MLA, "idle", (Arg("seq_id", "seq_new", _const(5), SEQ),)),
    Entry("remove_sequence", "kv_state_remove_sequence", MHA_MLA, "idle", (Arg("seq_id", "seq", _const(1), SEQ),)),
    Entry("fork_sequence", "kv_state_fork_sequence", MHA_MLA, "idle",
          (Arg("parent_seq_id", "seq", _const(0), SEQ), Arg("child_seq_id", "seq_new", _const(5), SEQ),
           Arg("fork_pos", "fork_pos", _const(13), ("fork position",))), coupled=True),
    Entry("popn", "kv_state_popn", MHA_MLA, "idle",
          (Arg("seq_id", "seq", _const(1), SEQ), Arg("n", "count", _const(2), ("pop",))), coupled=True),
    Entry("begin_forward", "kv_state_begin_forward", MHA_MLA, "idle",
          (Arg("seq_ids", "seq_list", _const([0, 1]), SEQ), Arg("append_lengths", "len_list", _const([3, 2]),
                                                                 ("append length", "tokens"))), coupled=True),
    Entry("begin_forward", "kv_state_begin_forward", ("mha",), "idle",
          (Arg("seq_ids", "tree_seq_list", _const([0, 1]), SEQ), Arg("append_lengths", "len_list", _const([2, 1]),
                                                                 ("append length", "tokens")),
           Arg("token_tree_parent_ptr", "parent_list", _const([-1, 0, -1]), ("token tree", "parent"))),
          coupled=True, label="begin_forward_tree"),
    Entry("end_forward", "kv_state_end_forward", MHA_MLA, "any"),
    Entry("clear", "kv_state_clear", MHA_MLA, "any"),
    Entry("empty", "attention_kv_cache_empty", MHA_MLA, "any"),
    Entry("get_num_available_pages", "attention_kv_cache_get_num_available_pages", MHA_MLA, "any"),
    Entry("get_total_sequence_length", "attention_kv_cache_get_total_sequence_length", MHA_MLA, "any"),
    Entry("get_query_positions", "attention_kv_cache_get_query_positions", MHA_MLA, "step"),
    Entry("get_sequence_length", "attention_kv_cache_get_sequence_length", MHA_MLA, "any",
          (Arg("seq_id", "seq", _const(1), SEQ),)),
    Entry("debug_get_kv", "attention_kv_cache_debug_get_kv", ("mha",), "any",
          (Arg("seq_id", "seq", _const(0), SEQ), Arg("start_pos", "pos", _const(2), ("range",)),
           Arg("end_pos", "pos", _const(9), ("range",)),
           Arg("k_data", "tensor", _tensor(lambda x: (2, 7, x.cfg.num_kv_heads, x.cfg.head_dim))),
           Arg("v_data", "tensor", _tensor(lambda x: (2, 7, x.cfg.num_kv_heads, x.cfg.v_head_dim)))),
          coupled=True),
    Entry("debug_get_kv_mla", "attention_kv_cache_debug_get_kv_mla", ("mla",), "any",
          (Arg("seq_id", "seq", _const(0), SEQ), Arg("start_pos", "pos", _const(2), ("range",)),
           Arg("end_pos", "pos", _const(9), ("range",)),
           Arg("kv_data", "tensor", _tensor(lambda x: (2, 7, x.cfg.head_dim)))), coupled=True),
    Entry("attention_with_fused_qkv", "attention_kv_cache_attention_with_fused_qkv", ("mha",), "step",
          (LAYER, Arg("qkv", "tensor", _tensor(lambda x: (x.n, x.cfg.num_qo_heads + 2 * x.cfg.num_kv_heads,
                                                           x.cfg.head_dim), free_rows=True)),
           Arg("o", "tensor", _tensor(lambda x: (x.n, x.cfg.num_qo_heads, x.cfg.head_dim))), SCALE),
          builtin_order=("layer_id", "sm_scale", "qkv", "o"), coupled=True),
    Entry("self_attention", "attention_kv_cache_self_attention", MHA_MLA, "step", (LAYER, Q, K, V, O, LSE, SCALE),
          builtin_order=("layer_id", "sm_scale", "q", "k", "v", "o", "lse"), coupled=True),
    Entry("cross_attention", "attention_kv_cache_cross_attention", MHA_MLA, "step",
          (LAYER, CROSS_Q, CROSS_O, LSE, SCALE), builtin_order=("layer_id", "sm_scale", "q", "o", "lse")),
    Entry("attention_with_shared_kv", "attention_kv_cache_attention_with_shared_kv", ("mha",), "step",
          (dataclasses.replace(LAYER, name="source_layer_id"), Q, K, V, O, SCALE),
          builtin_order=("source_layer_id", "sm_scale", "q", "k", "v", "o")),
    Entry("merge_attn_output_inplace", "attention_kv_cache_merge_attn_output_inplace", MHA_MLA, "any",
          (_merge_arg("o_self_attn", False), _merge_arg("lse_self_attn", True), _merge_arg("o_cross_attn", False),
           _merge_arg("lse_cross_attn", True)), coupled=True),
    Entry("enable_sliding_window_for_seq", "attention_kv_cache_enable_sliding_window_for_seq", ("window",), "idle",
          (Arg("seq_id", "seq", _const(1), SEQ), Arg("sliding_window_size", "window", _const(16), ("window",)),
           Arg("attn_sink_size", "sink", _const(4), ("sink",))), coupled=True),
    Entry("commit_accepted_token_tree_nodes", "attention_kv_cache_commit_accepted_token_tree_nodes", ("mha",), "idle",
          (Arg("seq_ids", "commit_seqs", _const([2]), SEQ), Arg("leaf_indices", "leaf_list", _const([2]), ("leaf",))),
          coupled=True),
    Entry("append_mla_kv", "attention_kv_cache_append_mla_kv", ("mla",), "step",
          (LAYER, Arg("kv", "tensor", _tensor(lambda x: (x.n, x.cfg.head_dim), free_rows=True)))),
    Entry("mla_context_attention", None, ("mla",), "step",
          (LAYER, Q, O, LSE, SCALE, Arg("decompress", "callable", _const(_no_op_decompress)))),
    Entry("get_layout_hash", "attention_kv_cache_get_layout_hash", ("mha",), "any"),
    Entry("get_checkpoint_metadata", "attention_kv_cache_get_checkpoint_metadata", ("mha",), "idle",
          (Arg("seq_id", "seq", _const(0), SEQ),)),
    Entry("export_page_group", "attention_kv_cache_export_page_group", ("mha",), "idle",
          (Arg("seq_id", "seq", _const(0), SEQ), GROUP,
           Arg("out", "tensor", _tensor(lambda x: (1, 3, 2, x.cfg.num_kv_heads, x.cfg.page_size, x.cfg.head_dim)))),
          coupled=True),
    Entry("prepare_import", "attention_kv_cache_prepare_import", ("mha",), "idle",
          (Arg("seq_id", "seq_new", _const(5), SEQ),
           Arg("metadata", "metadata", lambda x: x.cache.get_checkpoint_metadata(0), ("checkpoint",))),
          coupled=True),
    Entry("import_page_group", "attention_kv_cache_import_page_group", ("mha",), "importing",
          (Arg("seq_id", "seq", _const(5), SEQ + ("import",)), GROUP,
           Arg("group", "tensor", _tensor(lambda x: (1, 3, 2, x.cfg.num_kv_heads, x.cfg.page_size, x.cfg.head_dim)))),
          coupled=True),
    Entry("finish_import", "attention_kv_cache_finish_import", ("mha",), "imported",
          (Arg("seq_id", "seq", _const(5), SEQ + ("import",)),)),
) + tuple(Entry(None, name[len("vm.builtin."):], ("mha",), "any", unsupported=True)
          for name, ours in BUILTINS.items() if getattr(ours, "unsupported", None))


# ---------------------------------------------------------------------------- hostile values


class Hostile:
    """A hostile value, its class (for the statistics) and words its error message may use."""

    def __init__(self, cls: str, value: Any, *fragments: str) -> None:
        self.cls, self.value = cls, value
        self.fragments = fragments or ((repr(value), str(value)) if _is_scalar(value) else ())


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (int, float, str, complex))


class _BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__


def _strided_tensor() -> tvm.runtime.Tensor:
    """A non-contiguous tensor (its repr raises: TVM cannot copy it out)."""
    return tvm_ffi.from_dlpack(_aligned_numpy((4, 4), "int64")[:, ::2], require_contiguous=False)


def _wrong_scalars(ctx: Ctx) -> List[Hostile]:
    """Values of the wrong type for an int or float argument."""
    return [Hostile("None", None), Hostile("str", "1"), Hostile("str", "abc"), Hostile("bool", True),
            Hostile("bool", False), Hostile("complex", 1 + 2j), Hostile("object", object(), "object"),
            Hostile("object", _BrokenRepr(), "_BrokenRepr"), Hostile("list", [1]),
            Hostile("ShapeTuple", ShapeTuple([1])),
            Hostile("tensor", tvm.runtime.tensor(np.array([1], "int64")), "Tensor"),
            Hostile("tensor", _strided_tensor(), "Tensor"), Hostile("bytes", b"\x01", "bytes")]


def _wrong_ints(ctx: Ctx) -> List[Hostile]:
    return _wrong_scalars(ctx) + [
        Hostile("float", 1.5), Hostile("float", 2.0), Hostile("nan", math.nan), Hostile("inf", math.inf),
        Hostile("np.float", np.float64(1.0), "1.0"),
        Hostile("overflow", 2**63), Hostile("overflow", -(2**63) - 1), Hostile("overflow", 2**64)]


def _ints(cls: str, *values: int) -> List[Hostile]:
    return [Hostile(cls, v) for v in values]


HUGE = (2**62, 2**63 - 1, -(2**63))

INT_KINDS: Dict[str, Callable[[Ctx], List[Hostile]]] = {
    "seq": lambda x: _ints("unknown id", -1, -7, 99) + _ints("huge", *HUGE),
    "seq_new": lambda x: _ints("existing id", 0, 1, 2),
    "count": lambda x: _ints("negative", -1, -(2**63)) + _ints("huge", 2**62, 2**63 - 1, 25),
    "fork_pos": lambda x: _ints("negative", -2, -(2**63)) + _ints("huge", 2**62, 2**63 - 1, 30),
    "window": lambda x: _ints("negative", 0, -1, -(2**63)) + _ints("huge", 2**31, 2**62, 2**63 - 1),
    "sink": lambda x: _ints("negative", -1, -(2**63)) + _ints("huge", 16, 2**31, 2**62, 2**63 - 1),
    "pos": lambda x: _ints("negative", -1, -(2**63)) + _ints("huge", 2**62, 2**63 - 1, 30),
    "layer": lambda x: _ints("negative", -1, -(2**63)) + _ints("huge", 2, 2**62, 2**63 - 1),
}


def _scale_hostiles(ctx: Ctx) -> List[Hostile]:
    return _wrong_scalars(ctx) + [Hostile("nan", math.nan), Hostile("inf", math.inf), Hostile("inf", -math.inf)]


def _callable_hostiles(ctx: Ctx) -> List[Hostile]:
    return [Hostile("None", None), Hostile("int", 1), Hostile("str", "f"), Hostile("list", [1]),
            Hostile("tensor", tvm.runtime.tensor(np.zeros(2, "float32")), "Tensor")]


def _metadata_hostiles(ctx: Ctx, valid: str) -> List[Hostile]:
    """Checkpoint metadata: wrong types, malformed JSON, fields changed or missing."""
    import json

    meta = json.loads(valid)

    def changed(cls, **fields):
        return Hostile(cls, json.dumps({**meta, **fields}), *(fields and [next(iter(fields))]))
    dropped = {k: v for k, v in meta.items() if k != "layout_hash"}
    return _wrong_scalars(ctx) + [
        Hostile("json", "", "JSON"), Hostile("json", "{", "JSON"), Hostile("json", "[]", "JSON"),
        Hostile("json", "null", "JSON"), Hostile("json", valid[:-1], "JSON"), Hostile("json", "\x00" * 8, "JSON"),
        Hostile("missing field", json.dumps(dropped), "layout_hash"),
        changed("field", layout_hash="f" * 16), changed("field", format_version=0), changed("field", dtype="int8"),
        changed("field", page_size=2**63), changed("field", seq_length=-5), changed("field", seq_length=2**62),
        changed("field", seq_length=None), changed("field", seq_length=1.0e300),
        changed("field", groups=meta["groups"][:1]), changed("field", logical_pages=[]),
        changed("field", attn_kinds=["mha"]), changed("field", num_layers=True),
        changed("field", reserved_num_seqs=-1)]


def _wrong_lists(ctx: Ctx, valid: List[int]) -> List[Hostile]:
    """Wrong containers and wrong elements for a list of ints."""
    first = valid[0]
    return [
        Hostile("None", None), Hostile("scalar", first), Hostile("str", "01"), Hostile("bytes", b"\x00\x01", "bytes"),
        Hostile("dict", {first: 1}, "dict"), Hostile("set", set(valid), "set"),
        Hostile("generator", (v for v in valid), "generator"), Hostile("float", 1.5),
        Hostile("object", object(), "object"),
        Hostile("tensor", tvm.runtime.tensor(np.array(valid, "int64")), "Tensor"),
        Hostile("tensor", _strided_tensor(), "Tensor"), Hostile("object", _BrokenRepr(), "_BrokenRepr"),
        Hostile("object elem", [_BrokenRepr()] + valid[1:], "_BrokenRepr"),
        Hostile("2-D", [valid]), Hostile("float elem", [1.5] + valid[1:], "1.5"),
        Hostile("float elem", [float(first)] + valid[1:], str(float(first))),
        Hostile("nan elem", [math.nan] + valid[1:], "nan"), Hostile("None elem", [None] + valid[1:], "None"),
        Hostile("bool elem", [True] + valid[1:], "True"), Hostile("str elem", ["0"] + valid[1:], "'0'"),
        Hostile("overflow elem", [2**63] + valid[1:], str(2**63)),
        Hostile("overflow elem", [-(2**63) - 1] + valid[1:], str(-(2**63) - 1)),
        Hostile("np.float array", np.array(valid, "float64"), "float"),
    ]


def _hostile_lists(kind: str, ctx: Ctx, valid: List[int]) -> List[Hostile]:
    """Lists of the right type but hostile contents for a list argument of ``kind``."""
    out: List[Hostile] = []
    if kind in ("seq_list", "tree_seq_list"):
        if kind == "seq_list" and ctx.variant == "mha":  # without a tree, not while 2 has pending tree nodes
            out.append(Hostile("pending tree", [0, 2], "2"))
        out += [Hostile("unknown id", [0, 99], "99"), Hostile("huge", [0, 2**63 - 1], str(2**63 - 1)),
                Hostile("huge", [-(2**63), 1], str(-(2**63))), Hostile("duplicate", [0, 0], "0"),
                Hostile("length", [0, 1, 2], "3"), Hostile("length", [0], "1"),
                Hostile("empty batch", [], "empty", "0")]
    elif kind == "len_list":
        out += [Hostile("zero", [0, 1], "0"), Hostile("negative", [-1, 1], "-1"),
                Hostile("huge", [2**62, 1], str(2**62)), Hostile("huge", [2**63 - 1, 1], str(2**63 - 1)),
                Hostile("too many tokens", [64, 1], "65"), Hostile("length", [1], "1"),
                Hostile("length", [1, 1, 1], "3"), Hostile("empty batch", [], "0", "empty")]
    elif kind == "parent_list":
        out += [Hostile("length", [-1, 0], "2"), Hostile("length", [-1, 0, -1, 0], "4"),
                Hostile("tree", [0, 0, -1], "parent"), Hostile("tree", [-1, 5, -1], "5"),
                Hostile("tree", [-1, -2, -1], "-2"), Hostile("tree", [-1, 1, -1], "1"),
                Hostile("huge", [-1, 2**62, -1], str(2**62)), Hostile("huge", [-1, -(2**63), -1], str(-(2**63))),
                Hostile("empty", [], "0")]
    elif kind == "commit_seqs":
        out += [Hostile("unknown id", [99], "99"), Hostile("huge", [2**63 - 1], str(2**63 - 1)),
                Hostile("no tree", [0], "0"), Hostile("duplicate", [2, 2], "2"), Hostile("length", [], "0")]
    elif kind == "leaf_list":
        out += [Hostile("negative", [-2], "-2"), Hostile("out of range", [4], "4"),
                Hostile("huge", [2**62], str(2**62)), Hostile("huge", [-(2**63)], str(-(2**63))),
                Hostile("length", [2, 2], "2"), Hostile("length", [], "0")]
    return out


def _aligned_numpy(shape, dtype, shift: int = 0) -> np.ndarray:
    """A numpy array whose data starts ``shift`` bytes after a 64-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.zeros(nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + shift
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def _tensor_hostiles(ctx: Ctx, spec: TensorSpec) -> List[Hostile]:
    shape, dtype, rng = spec.shape, spec.dtype, ctx.rng
    fixed = [d for d in range(len(shape)) if not (d == 0 and spec.free_rows)]
    out = [Hostile("not a tensor", None), Hostile("not a tensor", 0), Hostile("not a tensor", 1.5),
           Hostile("not a tensor", "tensor"), Hostile("not a tensor", ShapeTuple(shape), "Shape"),
           Hostile("not a tensor", np.zeros(shape, "float32").tolist(), "list", "Array"),
           Hostile("numpy float64", _aligned_numpy(shape, "float64"), "ndarray", "float64"),
           Hostile("wrong rank", _data(rng, shape + (1,), dtype)), Hostile("wrong rank", _data(rng, shape[:-1], dtype)),
           Hostile("wrong rank", _data(rng, (), dtype))]
    for other in ("float16", "float64", "int32", "bfloat16"):
        if other != dtype:
            out.append(Hostile("wrong dtype", tvm.runtime.empty(shape, other), other))
    for d in fixed:
        out.append(Hostile("wrong shape", _data(rng, shape[:d] + (shape[d] + 1,) + shape[d + 1:], dtype)))
        out.append(Hostile("zero-size", _data(rng, shape[:d] + (0,) + shape[d + 1:], dtype)))
    if spec.free_rows and shape[0] > 0:
        out.append(Hostile("too few rows", _data(rng, (shape[0] - 1,) + shape[1:], dtype)))
    out.append(Hostile("wrong device", tvm.runtime.empty(shape, dtype, tvm.cpu(1)), "cpu:1", "device"))
    wide = _aligned_numpy(shape[:-1] + (2 * shape[-1],), dtype) if shape else None
    if wide is not None:
        out.append(Hostile("strided", tvm_ffi.from_dlpack(wide[..., ::2], require_contiguous=False), "contiguous"))
    if len(shape) >= 2 and shape[0] > 1 and shape[1] > 1:
        t = _aligned_numpy(shape[1::-1] + shape[2:], dtype).swapaxes(0, 1)
        out.append(Hostile("strided", tvm_ffi.from_dlpack(t, require_contiguous=False), "contiguous"))
    row = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    base = tvm.runtime.empty((int(np.prod(shape)) + row + 64,), dtype)
    for offset in sorted({row, 4, 2, 64}):
        out.append(Hostile("byte offset", view(base, shape, offset), "offset"))
    for shift in (4, 16, 32):
        array = _aligned_numpy(shape, dtype, shift)
        out.append(Hostile("misaligned", tvm_ffi.from_dlpack(array, require_alignment=0), "align"))
    return out


def _draw(ctx: Ctx, arg: Arg, valid: Any) -> Hostile:
    """Half of the draws come from the values specific to the argument's kind (out-of-range ints,
    malformed lists), half from the wrong types; within either, a class first, then a value."""
    rng = ctx.rng
    if arg.kind == "tensor":
        candidates = _tensor_hostiles(ctx, SPECS[id(valid)])
    elif arg.kind == "scale":
        candidates = _scale_hostiles(ctx)
    elif arg.kind == "callable":
        candidates = _callable_hostiles(ctx)
    elif arg.kind == "metadata":
        candidates = _metadata_hostiles(ctx, valid)
    elif arg.kind in INT_KINDS:
        specific = INT_KINDS[arg.kind](ctx)
        candidates = specific if rng.random() < 0.5 else _wrong_ints(ctx)
    else:
        # None for token_tree_parent_ptr means "no token tree": valid
        wrong = [h for h in _wrong_lists(ctx, valid) if not (arg.kind == "parent_list" and h.value is None)]
        candidates = _hostile_lists(arg.kind, ctx, valid) if rng.random() < 0.5 else wrong
    classes = sorted({h.cls for h in candidates})
    cls = classes[rng.integers(len(classes))]
    pool = [h for h in candidates if h.cls == cls]
    return pool[rng.integers(len(pool))]


# ---------------------------------------------------------------------------- the campaign


def _call(ctx: Ctx, entry: Entry, surface: str, values: Dict[str, Any], extra: Tuple = (), drop: int = 0):
    if surface == "python":
        return getattr(ctx.cache, entry.method)(*values.values())
    order = entry.builtin_order or tuple(values)
    args = [values[name] for name in order] + list(extra)
    if drop:
        args = args[:-drop] if len(args) >= drop else args
    return tvm_ffi.get_global_func("vm.builtin." + entry.builtin)(ctx.cache, *args)


def _valid_values(ctx: Ctx, entry: Entry) -> Dict[str, Any]:
    return {arg.name: arg.valid(ctx) for arg in entry.args}


def _message_ok(entry: Entry, arg: Optional[Arg], hostile: Hostile, message: str) -> bool:
    if entry.unsupported:
        return "not supported" in message
    if arg is None:  # wrong number of arguments
        return entry.builtin in message and "argument" in message
    names = [arg.name, *arg.names, *hostile.fragments]
    if entry.coupled:
        names += [a.name for a in entry.args] + [n for a in entry.args for n in a.names]
    return any(n and n in message for n in names)


def _case(ctx: Ctx, entry: Entry, surface: str, failures: List[str]) -> None:
    rng = ctx.rng
    values = _valid_values(ctx, entry)
    arity = surface == "builtin" and (not entry.args or rng.random() < 0.08)
    arg, extra, drop = None, (), 0
    if entry.unsupported:
        hostile = Hostile("unsupported", None)
        extra = tuple(rng.choice([0, 1.5, "x", None], size=rng.integers(0, 4)).tolist())
    elif arity:
        fewest, most, _ = _arity("vm.builtin." + entry.builtin, BUILTINS["vm.builtin." + entry.builtin])
        drop = len(values) - fewest + 1 if entry.args and rng.random() < 0.5 else 0
        extra = () if drop else (0,) * (most + 1 - len(values))
        hostile = Hostile("missing argument" if drop else "extra argument", None)
    else:
        arg = entry.args[rng.integers(len(entry.args))]
        hostile = _draw(ctx, arg, values[arg.name])
        values[arg.name] = hostile.value
        if hostile.cls == "empty batch" and entry.method == "begin_forward":
            values = {name: [] for name in values}
    where = f"{entry.id} [{surface}] {arg.name if arg else '-'} = {hostile.cls}: {_describe(hostile.value)}"
    STATS["cases"][f"{entry.id} [{surface}]"] += 1
    STATS["classes"][hostile.cls] += 1
    before = snapshot(ctx.cache, pages=True)
    expected = NotImplementedError if entry.unsupported else rk.KVCacheError
    try:
        _call(ctx, entry, surface, values, extra, drop)
    except Exception as error:  # noqa: BLE001 - the campaign classifies every exception
        STATS["surfaced"][f"{surface}: {type(error).__name__}"] += 1
        message = str(error)
        STATS["messages"][f"{type(error).__name__}: {message[:160]}"] += 1
        if not isinstance(error, expected):
            failures.append(f"{where}: {type(error).__name__} instead of {expected.__name__}: {message[:300]}")
        elif not _message_ok(entry, arg, hostile, message):
            failures.append(f"{where}: message does not name the argument or value: {message[:300]}")
        try:
            assert_same(before, snapshot(ctx.cache, pages=True))
        except AssertionError as changed:
            failures.append(f"{where}: state changed after the error: {str(changed)[:200]}")
            raise _Rebuild() from None
        return
    failures.append(f"{where}: accepted (no exception)")
    raise _Rebuild()


def _describe(value: Any) -> str:
    if isinstance(value, tvm.runtime.Tensor):  # repr would copy the data (fails for strided views)
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}, " \
               f"strides={tuple(value.strides) if not value.is_contiguous() else 'contiguous'}, " \
               f"address={value.data_ptr():#x})"
    return describe(value)


class _Rebuild(Exception):
    """The cache may have changed: start the next case from a fresh one."""


@pytest.fixture(scope="module")
def kernel_sets(kernel_build):
    sets: Dict[str, KernelSet] = {}

    def get(variant: str) -> KernelSet:
        if variant not in sets:
            sets[variant] = KernelSet.from_module(kernel_build(CONFIGS[variant]))
        return sets[variant]
    yield get
    if REPORT:
        _print_report()


@pytest.fixture(autouse=True)
def _no_hang():
    """A hang (or a case that never returns) kills the run with every thread's traceback."""
    faulthandler.dump_traceback_later(120 + 2 * CASES, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _surfaces(entry: Entry) -> List[str]:
    """Python methods without arguments have nothing hostile to take; builtins can get too many."""
    registered = entry.builtin and tvm_ffi.get_global_func("vm.builtin." + entry.builtin, allow_missing=True)
    return [s for s, present in (("python", entry.method and entry.args), ("builtin", registered)) if present]


CAMPAIGN = [pytest.param(entry, variant, surface, id=f"{entry.id}-{variant}-{surface}")
            for entry in ENTRIES for variant in entry.variants for surface in _surfaces(entry)]


@pytest.mark.parametrize("entry, variant, surface", CAMPAIGN)
def test_hostile_arguments_raise_clear_errors_and_change_nothing(kernel_sets, entry, variant, surface):
    rng = np.random.default_rng([SEED, zlib.crc32(f"{entry.id}-{variant}-{surface}".encode())])
    kernels = kernel_sets(variant)
    if not entry.unsupported:  # control: the valid call succeeds (the cases differ from it in one argument)
        ctx = Ctx(variant, kernels, rng)
        ctx.enter(entry.phase)
        _call(ctx, entry, surface, _valid_values(ctx, entry))
    failures: List[str] = []
    ctx = None
    cases = CASES if entry.args else max(4, CASES // 4)  # only the arity varies
    for _ in range(cases):
        if ctx is None:
            ctx = Ctx(variant, kernels, rng)
            ctx.enter(entry.phase)
        try:
            _case(ctx, entry, surface, failures)
        except _Rebuild:
            ctx = None
    if ctx is not None:
        ctx.usable()
    assert not failures, f"{len(failures)} of {cases} cases failed:\n" + "\n".join(failures[:25])


def test_campaign_covers_every_builtin():
    """Every builtin the cache serves is in the campaign (with its Python method, if any)."""
    covered = {"vm.builtin." + e.builtin for e in ENTRIES if e.builtin}
    assert covered == set(BUILTINS), sorted(set(BUILTINS) ^ covered)


def _print_report() -> None:
    print("\n== hostile-input campaign ==")
    print(f"cases: {sum(STATS['cases'].values())} over {len(STATS['cases'])} entry points x surfaces")
    for key in ("classes", "surfaced"):
        print(f"-- {key}:")
        for name, count in sorted(STATS[key].items()):
            print(f"   {count:6d}  {name}")
    print(f"-- distinct messages: {len(STATS['messages'])}")
    for name, count in STATS["messages"].most_common():
        print(f"   {count:6d}  {name}")


# ---------------------------------------------------------------------------- deliberately accepted


def _builtin(name: str):
    return tvm_ffi.get_global_func("vm.builtin." + name)


@pytest.mark.parametrize("surface", ["python", "builtin"])
def test_accepted_inputs(kernel_sets, surface):
    """What the campaign's catalogue leaves out on purpose: these are valid, and work."""
    ctx = Ctx("mha", kernel_sets("mha"), np.random.default_rng(3))
    c, py = ctx.cache, surface == "python"

    def call(method, builtin, *args):
        return getattr(c, method)(*args) if py else _builtin(builtin)(c, *args)

    # ids anywhere in int64 (TVM's type), numpy integers for ints
    for seq_id in (2**63 - 1, -(2**63), np.int64(7), np.int32(-3)):
        call("add_sequence", "kv_state_add_sequence", seq_id)
        assert call("get_sequence_length", "attention_kv_cache_get_sequence_length", seq_id) == 0
    call("fork_sequence", "kv_state_fork_sequence", 0, np.int64(2**63 - 2), np.int16(8))
    call("popn", "kv_state_popn", 2**63 - 2, np.uint8(3))
    assert c.get_sequence_length(2**63 - 2) == 5
    # id lists as tuples, ShapeTuples (Relax), numpy arrays (Python) / Arrays (builtins)
    lists = [(0, 1), ShapeTuple([0, 1]), np.array([0, 1]) if py else [0, 1]]
    for seq_ids in lists:
        call("begin_forward", "kv_state_begin_forward", seq_ids, ShapeTuple([1, 1]))
        for layer in range(2):
            qkv = _data(ctx.rng, (2, 8, 32))
            o = tvm.runtime.empty((2, 4, 32), "float32")
            # sm_scale: any finite number, numpy and int included
            scale = (np.float32(0.2), 1, 1e6)[layer % 3]
            call("attention_with_fused_qkv", "attention_kv_cache_attention_with_fused_qkv",
                 *((layer, qkv, o, scale) if py else (layer, scale, qkv, o)))
            assert np.isfinite(o.numpy()).all()
        call("end_forward", "kv_state_end_forward")
    # the builtin's optional fourth argument None: no token tree
    if not py:
        _builtin("kv_state_begin_forward")(c, ShapeTuple([0]), ShapeTuple([1]), None)
        c.end_forward()
    # an empty commit batch is a no-op; so is a merge of zero rows
    before = snapshot(c, pages=True)
    call("commit_accepted_token_tree_nodes", "attention_kv_cache_commit_accepted_token_tree_nodes", [], [])
    empty_o, empty_lse = tvm.runtime.empty((0, 4, 32), "float32"), tvm.runtime.empty((0, 4), "float32")
    call("merge_attn_output_inplace", "attention_kv_cache_merge_attn_output_inplace",
         empty_o, empty_lse, tvm.runtime.empty((0, 4, 32), "float32"), tvm.runtime.empty((0, 4), "float32"))
    assert_same(before, snapshot(c, pages=True))
    for seq_id in (2**63 - 1, -(2**63), 7, -3, 2**63 - 2):
        call("remove_sequence", "kv_state_remove_sequence", seq_id)
    ctx.usable()


@pytest.mark.parametrize("first", [None, 0, 1.5, "cache", object(), ShapeTuple([1])])
def test_builtins_refuse_a_first_argument_that_is_no_cache(first):
    """Anything but one of our caches goes to TVM's own function, which raises TypeError."""
    for name in BUILTINS:
        f = tvm_ffi.get_global_func(name, allow_missing=True)
        if f is not None:
            with pytest.raises(TypeError):
                f(first, 0, 0)


def test_byte_offset_reads_the_views_offset():
    from relax_kvcache.tensors import byte_offset

    base = tvm.runtime.empty((256,), "float32")
    assert byte_offset(base) == 0
    for offset in (4, 64, 900):
        v = view(base, (8,), offset)
        assert byte_offset(v) == offset and v.data_ptr() == base.data_ptr() + offset


def test_checked_tensors_vouch_for_no_other_tensor(kernel_sets):
    """The tensors a step has checked are remembered (and a new one is first checked on its raw
    fields): tensors of the same shape with another dtype, device, layout or offset are still
    refused, whether they come before or after the valid ones, directly or through vm.builtin."""
    ctx = Ctx("mha", kernel_sets("mha"), np.random.default_rng(5))
    c = ctx.cache
    builtin = _builtin("attention_kv_cache_attention_with_fused_qkv")
    base = tvm.runtime.empty((2 * 8 * 32 + 64,), "float32")
    bad = {"float16": tvm.runtime.empty((2, 8, 32), "float16"),
           "device": tvm.runtime.empty((2, 8, 32), "float32", tvm.cpu(1)),
           "offset": view(base, (2, 8, 32), 64),
           "align": tvm_ffi.from_dlpack(_aligned_numpy((2, 8, 32), "float32", 16), require_alignment=0),
           "contiguous": tvm_ffi.from_dlpack(_aligned_numpy((2, 8, 64), "float32")[..., ::2],
                                             require_contiguous=False)}
    for _ in range(2):
        c.begin_forward([0, 1], [1, 1])
        qkv, o = _data(ctx.rng, (2, 8, 32)), tvm.runtime.empty((2, 4, 32), "float32")
        for word, tensor in bad.items():
            with pytest.raises(rk.KVCacheError, match=word):
                c.attention_with_fused_qkv(0, tensor, o, 0.1)
        c.attention_with_fused_qkv(0, qkv, o, 0.1)
        builtin(c, 1, 0.1, qkv, o)
        for word, tensor in bad.items():
            for call in (lambda: c.attention_with_fused_qkv(1, tensor, o, 0.1), lambda: builtin(c, 1, 0.1, tensor, o)):
                with pytest.raises(rk.KVCacheError, match=word):
                    call()
        c.end_forward()
    ctx.usable()


# ---------------------------------------------------------------------------- creation


def _creation_hostiles(kernels: KernelSet) -> Dict[int, Tuple[Tuple[str, ...], List[Hostile]]]:
    """Per creation argument: words its error messages may use, and hostile values."""
    ints = [Hostile(c, v) for c, v in (("zero", 0), ("negative", -1), ("huge", 2**31), ("huge", 2**62),
                                        ("overflow", 2**63), ("negative", -(2**63)))]
    wrong = lambda: _wrong_ints(None)  # noqa: E731
    config = [8, 200, 64, 8, 0]

    def config_with(i, v):
        return Hostile(f"cache_config[{i}]", config[:i] + [v] + config[i + 1:], str(v))
    lists = lambda valid: _wrong_lists(None, valid)  # noqa: E731
    f = kernels.copy_single_page
    kernel = [Hostile("not a function", v) for v in (3, "f", 1.5)] + [Hostile("not a function", [f], "list")]
    attention = [Hostile("bad entry", v, "argument") for v in (3, "x", ["tirx"], ["tirx", 3], ["tvm", f], [f])]
    return {
        0: (("cache_config", "KVCacheConfig", "num_pages"), lists(config) + [
            Hostile("length", config[:4], "cache_config"), Hostile("length", config + [8, 8, 8], "cache_config"),
            config_with(4, 2), config_with(4, -1),
            *(config_with(i, v) for i in range(4) for v in (0, -1, 2**31, 2**62)),
            Hostile("window", config + [0], "layer_sliding_window_size"),
            Hostile("window", config + [2**40], "layer_sliding_window_size"),
            Hostile("chunk", config + [64, 2**31], "attention_chunk_size"),
            Hostile("chunk", config + [64, -16], "attention_chunk_size")]),
        1: (("layer_indptr", "attn_kinds"), lists([0, 2]) + [
            Hostile("range", [0], "layer_indptr"), Hostile("range", [2, 1], "layer_indptr"),
            Hostile("range", [-1, 2], "layer_indptr"), Hostile("range", [0, 5], "layer_end"),
            Hostile("range", [0, 2**62], "layer_end")]),
        2: (("num_qo_heads",), wrong() + ints + [Hostile("heads", 3, "multiple")]),
        3: (("num_kv_heads", "num_qo_heads"), wrong() + ints + [Hostile("heads", 3, "multiple")]),
        4: (("qk_head_dim", "head_dim"), wrong() + ints + [Hostile("dim", 33), Hostile("dim", 512)]),
        5: (("v_head_dim",), wrong() + ints + [Hostile("dim", 16)]),
        6: (("attn_kinds",), lists([0, 0]) + [Hostile("kinds", [0], "attn_kinds"), Hostile("kinds", [0, 9], "9"),
                                              Hostile("kinds", [4, 0], "MHA_CHUNKED_LOCAL"),  # no chunk size
                                              Hostile("kinds", [4, 3], "MHA_SLIDING"),
                                              Hostile("kinds", [0, 1], "MLA"), Hostile("kinds", [0, -1], "-1")]),
        7: (("enable_kv_transfer",), [Hostile(c, v, "enable_kv_transfer") for c, v in (
            ("str", "no"), ("None", None), ("float", 1.5), ("int", 2), ("object", object()), ("list", [0]),
            ("unsupported", True))]),
        8: (("rope_mode",), wrong() + [Hostile("mode", 7), Hostile("mode", -1)]),
        9: (("rope_scale",), _scale_hostiles(None) + [Hostile("value", -1.0), Hostile("value", 0.0),
                                                      Hostile("overflow", 10**400, "finite")]),
        10: (("rope_theta",), _scale_hostiles(None) + [Hostile("value", -1.0), Hostile("overflow", 10**400, "finite")]),
        11: (("rope_ext_factors",), [Hostile("not a tensor", v, "LongRoPE") for v in (1, [], "x", [1.0, 2.0], 1.5)] + [
            Hostile("tensor", tvm.runtime.tensor(np.full(shape, value, dtype)), "rope_ext_factors")
            for shape, value, dtype in (((32,), 1.0, "float16"), ((2, 16), 1.0, "float32"), ((31,), 1.0, "float32"),
                                        ((32,), np.nan, "float32"), ((32,), -1.0, "float32"),
                                        ((32,), 0.0, "float32"), ((32,), 1.0, "float32"))]),
        12: (("argument 12", "dtype"), [Hostile("not a tensor", v, "argument 12") for v in (None, 3, "float32")] + [
            Hostile("dtype", tvm.runtime.empty((), d), d) for d in ("int32", "float64", "int8")]),
        13: (("argument 13",), kernel),
        15: (("argument 15",), attention + [Hostile("unsupported", ["flashinfer", f], "FlashInfer")]),
        17: (("argument 17",), attention),
        23: (("argument 23",), [Hostile("merge", v, "argument 23") for v in (None, [], [3], 3, "f")]),
        24: (("argument 24",), kernel),
        25: (("argument 25",), kernel + [Hostile("not a function", None, "NoneType")]),
        27: (("argument 27",), kernel),
    }


def test_hostile_creation_arguments(kernel_sets):
    """``relax_kvcache.paged_attention_kv_cache_create`` (TVM's creation convention): one hostile
    argument per case, or a wrong number of arguments; each must raise our error (or
    NotImplementedError for what relax_kvcache lacks) naming the argument or the value."""
    kernels = kernel_sets("mha")
    create = tvm_ffi.get_global_func("relax_kvcache.paged_attention_kv_cache_create")
    assert isinstance(create(*create_args(kernels)), rk.PagedAttentionKVCache)  # control
    table = _creation_hostiles(kernels)
    rng = np.random.default_rng([SEED, 28])
    failures = []
    for _ in range(CASES * 6):
        args = create_args(kernels)
        if rng.random() < 0.05:
            n = int(rng.choice([0, 27, 32]))
            args, index, words, hostile = (args + [None] * 4)[:n], None, ("28 to 31",), Hostile("arity", n)
        else:
            index = sorted(table)[rng.integers(len(table))]
            words, pool = table[index]
            hostile = pool[rng.integers(len(pool))]
            args[index] = hostile.value
        STATS["cases"]["paged_attention_kv_cache_create [builtin]"] += 1
        STATS["classes"][hostile.cls] += 1
        where = f"create argument {index} = {hostile.cls}: {_describe(hostile.value)}"
        try:
            create(*args)
        except (rk.KVCacheError, NotImplementedError) as error:
            STATS["surfaced"][f"create: {type(error).__name__}"] += 1
            if not any(w in str(error) for w in words + hostile.fragments):
                failures.append(f"{where}: message does not name the argument or value: {error}")
        except Exception as error:  # noqa: BLE001
            failures.append(f"{where}: {type(error).__name__} instead of KVCacheError: {str(error)[:200]}")
        else:
            failures.append(f"{where}: accepted (no exception)")
    assert not failures, f"{len(failures)} cases failed:\n" + "\n".join(failures[:25])


CONFIG_HOSTILES = {
    **{name: [0, -1, 2**31, 2**62, 2**63, None, 1.5, "8", True, [8]]
       for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "max_num_seqs",
                    "max_total_seq_len", "prefill_chunk_size", "layer_sliding_window_size")},
    "num_layers": [0, -1, 2**31, 2**31 - 1, 70000, None, 1.5, "8", True, [8]],  # 2**31 - 1 layers: a hang
    "num_qo_heads": [0, -1, 2**31, 2**31 - 2, 2**62, None, 1.5, "8", True, [8]],  # 2**62: a 0-byte scratch
    "v_head_dim": [0, -1, 16, 2**62, 1.5, "32", True],
    "context_chunk_size": [0, -1, 2**62, 1.5, "32", True],
    "rope_mode": [7, -1, None, "1", 1.5],
    "rope_theta": [math.nan, math.inf, -1.0, 0.0, None, "1e4", True],
    "rope_scale": [math.nan, -math.inf, -1.0, None, "1", True],
    "dtype": ["int8", "float64", None, 3, ""],
    "support_sliding_window": ["no", None, 2, 1.5, [True]],
    "attn_kinds": ["00", [0.5, 0], [0], [0, 9], [True, 0], 3, [None, 0], [0, 0, 0], [4, 0], [0, 5]],
    "attention_chunk_size": [0, -1, 2**31, 2**62, 1.5, "8", True, [8]],
    "mla_original_qk_head_dim": [24, "x"],
}


def test_hostile_config_and_constructor_arguments(kernel_sets):
    """The Python API's creation: KVCacheConfig fields and PagedAttentionKVCache's arguments."""
    kernels = kernel_sets("mha")
    failures = []
    for name, values in CONFIG_HOSTILES.items():
        for value in values:
            try:
                rk.PagedAttentionKVCache(rk.KVCacheConfig(**dict(_BASE, **{name: value})), kernels=kernels)
            except rk.KVCacheError as error:
                if name not in str(error) and str(value) not in str(error):
                    failures.append(f"KVCacheConfig({name}={value!r:.40}): message does not name it: {error}")
            except Exception as error:  # noqa: BLE001
                failures.append(f"KVCacheConfig({name}={value!r:.40}): {type(error).__name__}: {error}")
            else:
                failures.append(f"KVCacheConfig({name}={value!r:.40}): accepted")
    constructor = {"device": ["cpu", 0, ShapeTuple([1])], "kernels": [3, "k", [kernels]],
                   "layer_offset": [-1, "x", 1.5, 2**63, None, True]}
    for name, values in constructor.items():
        for value in values:
            kwargs = {"kernels": kernels, name: value}
            try:
                rk.PagedAttentionKVCache(CONFIGS["mha"], **kwargs)
            except rk.KVCacheError as error:
                if name not in str(error):
                    failures.append(f"PagedAttentionKVCache({name}={value!r:.40}): message does not name it: {error}")
            except Exception as error:  # noqa: BLE001
                failures.append(f"PagedAttentionKVCache({name}={value!r:.40}): {type(error).__name__}: {error}")
            else:
                failures.append(f"PagedAttentionKVCache({name}={value!r:.40}): accepted")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------- not a cache


@pytest.mark.parametrize("name, args", [("vm.builtin.kv_state_begin_forward", ([0], [1])),
                                        ("vm.builtin.attention_kv_cache_attention_with_fused_qkv", (0, 1.0, None, None)),
                                        ("vm.builtin.kv_state_add_sequence", (0,))])
def test_builtins_refuse_a_none_cache(name, args):
    """TVM's own builtins dereference a None cache (a segfault); the dispatcher refuses it."""
    with pytest.raises(rk.ArgumentError, match="the cache is None"):
        tvm.get_global_func(name)(None, *args)


def test_builtins_refuse_ffi_objects_that_are_not_caches():
    """Any tvm_ffi.Object went to TVM's function (TypeError / InternalError from TVM)."""
    for obj in (tvm_ffi.Array([1]), tvm_ffi.Map({"a": 1}), tvm_ffi.convert(lambda: 1), tvm_ffi.Shape([1])):
        for name, args in (("vm.builtin.kv_state_clear", ()), ("vm.builtin.kv_state_begin_forward", ([0], [1])),
                           ("vm.builtin.attention_kv_cache_get_num_available_pages", ())):
            with pytest.raises(rk.ArgumentError, match="expected a relax_kvcache.PagedAttentionKVCache or a TVM KV"):
                tvm_ffi.get_global_func(name)(obj, *args)
