"""Compile the demo's Llama-style model with the cache and generate from a few prompts.

    python examples/llama_generate.py [--target llvm|cuda] [--arch sm_90a]

The model (``relax_kvcache.models.llama``) and the cache's kernels are one IRModule compiled
with ``relax_kvcache.frontend.compile``; ``relax_kvcache.generate.Engine`` batches the requests
(chunked prefill mixed with decode) and forks the first one into a second continuation. Weights
are random (seeded), so the tokens mean nothing; the logits are checked against the float64
numpy model as the engine goes.
"""

from __future__ import annotations

import argparse

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

import relax_kvcache  # noqa: F401  (before the VirtualMachine: routes vm.builtin.* to our cache)
from relax_kvcache import frontend
from relax_kvcache.generate import Engine
from relax_kvcache.models import LlamaConfig, LlamaNumpy, random_weights
from relax_kvcache.models.llama import build_module
from relax_kvcache.targets import make_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    parser.add_argument("--arch", help="CUDA architecture (default: the local GPU's)")
    args = parser.parse_args()
    target = make_target(args.target, arch=args.arch)
    device = tvm.cpu() if args.target == "llvm" else tvm.cuda(0)
    cfg = LlamaConfig(dtype="float32" if args.target == "llvm" else "float16")

    vm = VirtualMachine(frontend.compile(build_module(cfg, target), target), device)
    weights = random_weights(cfg, seed=0)
    shape = tvm.runtime.ShapeTuple
    cache = vm["create_kv_cache"](shape([8]), shape([2048]), shape([128]))
    engine = Engine(vm, [tvm.runtime.tensor(w.astype(cfg.dtype), device) for w in weights.values()], cache,
                    device, prefill_chunk_size=128, reference=LlamaNumpy(cfg, weights).logits,
                    vocab_size=cfg.vocab_size)

    rng = np.random.default_rng(1)
    requests = [engine.add_request(rng.integers(0, cfg.vocab_size, n).tolist(), max_new_tokens=10)
                for n in (50, 130, 7)]
    outputs = {}
    while engine.requests:
        for req in engine.step():
            outputs[req.seq_id] = req.tokens[req.prompt_len:]
        first = requests[0]
        if first.generated == 1 and len(engine.requests) == len(requests):
            engine.fork(first, int(np.argsort(first.last_logits)[-2]))  # a second continuation
    for seq_id in sorted(outputs):
        print(f"sequence {seq_id}: {outputs[seq_id]}")
    stats = engine.stats
    print(f"{stats.steps} steps, {stats.prefill_tokens} prefill + {stats.decode_tokens} decode tokens, "
          f"max logit error vs float64 numpy {stats.max_rel_error:.1e} (relative to the largest logit)")


if __name__ == "__main__":
    main()
