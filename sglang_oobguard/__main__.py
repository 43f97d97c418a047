"""Command line: `python -m sglang_oobguard {demo,doctor,report,help}`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_oobguard")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_cmd = sub.add_parser("demo", help="a stale slot id in a real sglang KV pool, unguarded then guarded")
    demo_cmd.add_argument("--engine", action="store_true", help="the same story in the real sglang Engine (~2 min)")
    sub.add_parser("doctor", help="what the guard covers on the installed sglang")
    sub.add_parser("help", help="the checks SGLANG_OOBGUARD_CHECKS turns on and off: name, default, what it catches")
    report_cmd = sub.add_parser("report", help="summarise a report folder (SGLANG_OOBGUARD_REPORT_DIR); "
                                "exit 1 on any violation, 2 when no process was guarded, 3 when a check "
                                "asked for did not install in some process")
    report_cmd.add_argument("folder", help="the folder the guarded processes wrote to")
    report_cmd.add_argument("--json", action="store_true", help="the same summary as JSON")
    args = parser.parse_args(argv)
    if args.command == "report":
        from .report import summary

        return summary.run(args.folder, args.json)
    if args.command == "help":
        from .checks.registry import UNITS
        from .model import switches

        print(switches.HELP)
        print("\n".join(switches.help_lines({unit.name: unit.catches for unit in UNITS})))
        return 0
    if args.command == "demo":
        from . import demo

        return demo.run_engine_story() if args.engine else demo.run()
    from .activate.doctor import run

    return run()


if __name__ == "__main__":
    sys.exit(main())
