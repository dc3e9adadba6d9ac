"""The two builds ``e2e_bench.py`` compares, compiled here (needs TVM's compiler).

* ``ours``: :class:`relax_kvcache.models.llama.Llama` (our frontend, our kernels in the module);
* ``native``: the same model, whose ``create_kv_cache`` builds TVM's own ``TIRPagedKVCache``
  (TVM's TIR kernels and its C++ cache). Baseline code: it lives in ``benchmarks/`` only;
* ``ours-fp8`` (with a ``kv_dtype``): ``ours`` whose cache stores 8-bit float pages.

Both differ from the library's model in one place, ``prefill``: it returns the logits of the
step's last token only ``(1, 1, vocab)``, as serving engines do (the first token is sampled
from them; the vocabulary projection of every prompt token would cost 10-20 % of the prefill).
Every other line (layers, the weights as parameters in ``LlamaConfig.param_shapes`` order,
``decode``) is the library's, and both builds compile with ``relax_kvcache.frontend.compile``
(TVM's pipeline; the model's matmuls get the same schedules on both sides).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import time
from typing import Dict, List, Optional

import tvm
from tvm import relax as rx
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv

import gpu_prepare
from relax_kvcache import deploy, frontend
from relax_kvcache.models import LlamaConfig
from relax_kvcache.models.llama import Llama

PAGE_SIZE = 16
REPO = pathlib.Path(__file__).resolve().parent.parent
SIZE_LIMIT = 64 << 20  # what the device tool carries per call, repository included


def _last_token(x: nn.Tensor) -> nn.Tensor:
    """``x (1, n, h)`` -> ``(1, 1, h)``: the last row."""
    def compute(t: te.Tensor) -> te.Tensor:
        n = t.shape[1]
        return te.compute((1, 1, t.shape[2]), lambda i, j, k: t[i, n - 1, k], name="last_token")

    return nn.op.tensor_expr_op(compute, "take_last_token", [x])


class OursLlama(Llama):
    """The library's Llama; ``prefill`` returns the last token's logits (``prefill_rows``, the
    library's, is what ``generate.Engine`` calls in the soak)."""

    def prefill(self, input_ids: nn.Tensor, cache) -> nn.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cache)
        return self.lm_head(self.norm(_last_token(x))).astype("float32")


class NativeLlama(OursLlama):
    """The same model on TVM's native cache (``TIRPagedKVCache``: TVM's kernels, C++ cache)."""

    def create_kv_cache(self, max_batch_size, max_total_seq_len, prefill_chunk_size):
        cfg = self.cfg
        return tvm_kv.TIRPagedKVCache(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=self.page_size, support_sliding_window=0,
            layer_partition=rx.ShapeExpr([0, cfg.num_layers]), num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, qk_head_dim=cfg.head_dim,
            v_head_dim=cfg.head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
            rope_mode=tvm_kv.RopeMode.NORMAL, rope_scale=1, rope_theta=cfg.rope_theta, rope_scaling={},
            rope_ext_factors=rx.prim_value(0), rotary_dim=cfg.head_dim, enable_disaggregation=False,
            dtype=cfg.dtype, target=self.target)

    def export_spec(self) -> dict:
        spec = super().export_spec()
        del spec["prefill_rows"]
        cache = nn.spec.Object(object_type=tvm_kv.PagedKVCache)
        spec["prefill"]["cache"] = cache
        spec["decode"]["cache"] = cache
        return spec


MODEL_CLASSES = {"ours": OursLlama, "native": NativeLlama}
FP8_SIDE = "ours-fp8"  # OursLlama over 8-bit pages


def build_module(side: str, cfg: LlamaConfig, target: tvm.target.Target, kv_dtype=None) -> tvm.IRModule:
    """The IRModule of one side (weights as parameters, in ``cfg.param_shapes()`` order);
    ``FP8_SIDE`` takes ``kv_dtype``, the format of its pages."""
    if (side == FP8_SIDE) != (kv_dtype is not None):
        raise ValueError(f"side {side!r} with kv_dtype {kv_dtype!r}: only {FP8_SIDE!r} takes (and needs) one")
    cls = OursLlama if side == FP8_SIDE else MODEL_CLASSES[side]
    model = cls(cfg, target, PAGE_SIZE, kv_dtype)
    mod, params = model.export_tvm(spec=model.export_spec(), debug=False)
    exported = [(name, tuple(int(d) for d in param.shape)) for name, param in params]
    if exported != cfg.param_shapes():
        raise AssertionError(f"{side}: exported parameters differ from LlamaConfig.param_shapes()")
    return mod


#: largest prefill step (tokens) and decode batch the builds plan their activations for
UPPER_BOUNDS = {"n": 8192, "b": 128}


def compile_model(side: str, cfg: LlamaConfig, target: tvm.target.Target, kv_dtype=None):
    """The relax executable of one side for ``target`` (``FP8_SIDE``: over ``kv_dtype`` pages)."""
    return frontend.compile(build_module(side, cfg, target, kv_dtype), target, upper_bounds=UPPER_BOUNDS)


def cuda_sources(module: tvm.runtime.Module) -> List[str]:
    """CUDA C++ sources of every CUDA module inside a compiled, not yet loaded, module."""
    found, stack = [], [module]
    while stack:
        mod = stack.pop()
        if mod.kind == "cuda":
            found.append(mod.inspect_source())
        stack.extend(mod.imports)
    return found


def prepare(out: pathlib.Path, arch: str, models: Dict[str, LlamaConfig], manifest_name: str,
            bundle: bool, kv_dtype: Optional[str] = None) -> int:
    """Compile both sides of ``models`` for CUDA ``arch`` into ``out``: ``<side>-<model>.so`` with
    its checksum, the nvcc fatbins in ``out/cache``, ``manifest_name`` (models built before for
    the same arch are kept); with ``kv_dtype``, a third side ``ours-fp8`` over pages of that format
    (the manifest's ``kv_dtype``); with ``bundle``, TVM's runtime-only bundle in ``out/bundle``.
    Returns 1 when the folder and the repository exceed what the device tool carries."""
    from relax_kvcache.targets import make_target

    target = make_target("cuda", arch=arch)
    out.mkdir(parents=True, exist_ok=True)
    path = out / manifest_name
    manifest = json.loads(path.read_text()) if path.exists() else {}
    if manifest.get("arch") != arch or manifest.get("tvm_version") != tvm.__version__:
        manifest = {"arch": arch, "tvm_version": tvm.__version__, "models": {}}
    for name, cfg in models.items():
        entry = {"config": dataclasses.asdict(cfg), "kv_dtype": kv_dtype}
        for side in [*MODEL_CLASSES, *([FP8_SIDE] if kv_dtype else [])]:
            start = time.perf_counter()
            lib = out / f"{side}-{name}.so"
            executable = compile_model(side, cfg, target, kv_dtype if side == FP8_SIDE else None)
            executable.export_library(str(lib))
            deploy.write_checksum(lib)
            fatbin = sum(gpu_prepare.precompile(source, arch, out) for source in cuda_sources(executable.mod))
            entry[side] = lib.name
            print(f"{lib.name}: {time.perf_counter() - start:.0f} s, {lib.stat().st_size / 2**20:.1f} MiB, "
                  f"fatbin {fatbin / 2**20:.1f} MiB", flush=True)
        manifest["models"][name] = entry
        path.write_text(json.dumps(manifest, indent=1) + "\n")
    if bundle:
        subprocess.run(["bash", str(REPO / "tools" / "make_bundle.sh"), str(out / "bundle")], check=True,
                       stdout=subprocess.DEVNULL)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = sum((REPO / f).stat().st_size for f in listed.decode().split("\0") if f and (REPO / f).is_file())
    print(f"{out}: {total / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of tracked repository files)")
    if total + tree > SIZE_LIMIT:
        print(f"WARNING: over the {SIZE_LIMIT >> 20} MiB carried to the GPU host", file=sys.stderr)
        return 1
    return 0
