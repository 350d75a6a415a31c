"""`memtel ab run LADDER.yaml [--out DIR] [--resume] [--overwrite]` and `memtel ab report DIR`.

Both exit with the run's verdict (harness/ab/report/verdict.py, docs/harness.md "Exit codes"): 0 every
request ok and every gate passed, 3 a gate failed, 4 requests failed, 1 nothing ran or the run did not
finish, 2 bad input, 130 interrupted (`ab run`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from telemetry.errors import ConfigError

EXIT_CODES = ("exit codes: 0 every request ok and every gate passed; 1 nothing ran, or the run did not finish; "
              "2 bad input; 3 a gate failed; 4 requests failed; 130 interrupted (docs/harness.md, \"Exit codes\")")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ab_command", metavar="COMMAND")
    run_parser = sub.add_parser("run", help="run a ladder file against its arms, then write the report",
                                description="Run a ladder file: fresh serve per arm, cold prefills, telemetry "
                                            "after each request; results.jsonl, then report.md.",
                                epilog=EXIT_CODES)
    run_parser.add_argument("ladder", type=Path, help="the ladder file (YAML); see docs/harness.md")
    run_parser.add_argument("--out", type=Path, default=None,
                            help="run directory (default: runs/<ladder name>-<UTC time>)")
    run_parser.add_argument("--resume", action="store_true", help="finish an interrupted run in --out")
    run_parser.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a run")
    run_parser.add_argument("--no-report", action="store_true",
                            help="do not write the report at the end (the gates are still evaluated)")
    report_parser = sub.add_parser("report", help="write report.md, summary.json and plots for a run directory",
                                   description="Write report.md, summary.json and plots for a run directory "
                                               "(from its results.jsonl).", epilog=EXIT_CODES)
    report_parser.add_argument("run_dir", type=Path, help="a run directory (with results.jsonl)")


def run(args: argparse.Namespace) -> int:
    if args.ab_command == "run":
        return _run(args)
    if args.ab_command == "report":
        return _report(args.run_dir)
    raise ConfigError("usage: memtel ab {run LADDER.yaml [--out DIR] [--resume] [--overwrite] | report DIR}")


def _run(args: argparse.Namespace) -> int:
    from harness.ab.config import load_ladder

    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out DIR (the run to finish)")
    out = args.out or Path("runs") / f"{args.ladder.stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    ladder = load_ladder(args.ladder)
    from harness.ab.runner import run_ladder  # after the ladder is read: a bad one fails without loading the runner

    try:
        results = run_ladder(ladder, out, resume=args.resume, overwrite=args.overwrite)
    except KeyboardInterrupt:
        print(f"\ninterrupted; servers stopped. Finish with: memtel ab run {args.ladder} --out {out} --resume",
              file=sys.stderr)
        return 130
    print(f"results: {results}")
    return _report(results.parent, write=not args.no_report)


def _report(run_dir: Path, write: bool = True) -> int:
    """Write the report (unless told not to), print the verdict, return its exit code."""
    from harness.ab.report import Report

    report = Report.build(run_dir)
    if write:  # with what `memtel demo` (or another first writer) added to it, as it wrote it
        print(f"report: {report.write_again()}")
    print(report.verdict.line.replace("**", ""))
    return report.verdict.exit_code
