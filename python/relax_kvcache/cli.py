"""Command line: ``relax-kvcache demo``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relax-kvcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a small serving workload on the CPU, checked against numpy")
    demo.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quiet", action="store_true", help="print only the summary line")
    args = parser.parse_args(argv)

    from .demo import run_demo

    def log(message: str) -> None:
        if not args.quiet:
            print(message, flush=True)

    result = run_demo(dtype=args.dtype, seed=args.seed, log=log)
    status = "OK" if result.ok else "FAILED"
    print(f"demo {status}: {result.steps} steps, {result.tokens} tokens, {result.tokens_per_second:,.0f} tokens/s "
          f"through the cache, max |error| vs float64 reference {result.max_error:.1e} "
          f"(tolerance {result.tolerance:.0e})", flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
