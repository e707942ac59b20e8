"""Command line: ``python -m torch_mirage demo | bench | config`` (also the ``torch-mirage`` script).

A bad argument, or a ``MIRAGE_*`` variable with a bad value, gets argparse's usage error: one line on stderr
naming the valid choices, exit status 2. A command that fails while running prints one line and exits 1; ``-v``
shows the traceback instead.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from .config import ConfigError, describe, load
from .failures import describe_error

PROG = "python -m torch_mirage"
COMMANDS = {
    "demo": "compile a Llama-style decoder block with backend='mirage' and report what was done",
    "bench": f"run the benchmark suite ({PROG} bench --help)",
    "config": "print the effective configuration and every MIRAGE_* knob",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="\n".join(f"  {c:<7} {what}" for c, what in COMMANDS.items()))
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of a failure")
    p.add_argument("command", choices=list(COMMANDS), help="what to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help=f"the command's own arguments ({PROG} COMMAND --help)")
    return p


def _config(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} config", description=COMMANDS["config"])
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of a failure")
    p.parse_args(argv)
    try:
        cfg = load()
    except ConfigError as e:
        p.error(str(e))
    print(cfg)
    print()
    print(describe())
    return 0


def _demo(argv: list[str]) -> int:
    from .demo import main as demo   # loaded on use: `config` and `--help` stay light (no Dynamo, no Triton)
    return demo(argv)


def _bench(argv: list[str]) -> int:
    from .bench.cli import main as bench
    return bench(argv)


_RUN: dict[str, Callable[[list[str]], int]] = {"demo": _demo, "bench": _bench, "config": _config}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    if not argv or argv[0] in ("help", "-h", "--help"):
        p.print_help()
        return 0
    args = p.parse_args(argv)
    verbose = args.verbose or any(a in ("-v", "--verbose") for a in args.args)
    if args.command != "config":   # config reports a bad MIRAGE_* value itself, as its own usage error
        try:
            load()
        except ConfigError as e:
            p.error(str(e))
    try:
        return _RUN[args.command](args.args)
    except Exception as e:
        if verbose:
            raise
        print(f"{PROG} {args.command}: error: {describe_error(e, limit=1000)} (-v shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
