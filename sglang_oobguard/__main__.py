"""Command line: `python -m sglang_oobguard {demo,doctor}`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_oobguard")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_cmd = sub.add_parser("demo", help="a stale slot id in a real sglang KV pool, unguarded then guarded")
    demo_cmd.add_argument("--engine", action="store_true", help="the same story in the real sglang Engine (~2 min)")
    sub.add_parser("doctor", help="what the guard covers on the installed sglang")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.run_engine_story() if args.engine else demo.run()
    from .doctor import run

    return run()


if __name__ == "__main__":
    sys.exit(main())
