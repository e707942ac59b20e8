"""Command line: ``python -m torch_mirage demo | bench | config``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "help"
    if command == "demo":
        from .demo import main as demo
        return demo(argv)
    if command == "bench":
        from .bench.cli import main as bench
        return bench(argv)
    if command == "config":
        from .config import describe, load
        print(load())
        print()
        print(describe())
        return 0
    print("usage: python -m torch_mirage {demo,bench,config} [options]\n"
          "  demo    compile a Llama-style decoder block with backend='mirage' and report what was done\n"
          "  bench   run the benchmark suite (python -m torch_mirage bench --help)\n"
          "  config  print the effective configuration and every MIRAGE_* knob")
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
