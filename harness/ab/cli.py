"""`memtel ab run LADDER.yaml [--out DIR] [--resume] [--overwrite]` and `memtel ab report DIR`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from telemetry.errors import ConfigError


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ab_command", metavar="{run,report}")
    run_parser = sub.add_parser("run", help="run a ladder file against its arms, then write the report",
                                description="Run a ladder file: fresh serve per arm, cold prefills, telemetry "
                                            "after each request; results.jsonl, then report.md.")
    run_parser.add_argument("ladder", type=Path, help="the ladder file (YAML); see docs/harness.md")
    run_parser.add_argument("--out", type=Path, default=None,
                            help="run directory (default: runs/<ladder name>-<UTC time>)")
    run_parser.add_argument("--resume", action="store_true", help="finish an interrupted run in --out")
    run_parser.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a run")
    run_parser.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    report_parser = sub.add_parser("report", help="write report.md, summary.json and plots for a run directory")
    report_parser.add_argument("run_dir", type=Path, help="a run directory (with results.jsonl)")


def run(args: argparse.Namespace) -> int:
    if args.ab_command == "run":
        return _run(args)
    if args.ab_command == "report":
        return _report(args.run_dir)
    raise ConfigError("usage: memtel ab {run LADDER.yaml [--out DIR] [--resume] [--overwrite] | report DIR}")


def _run(args: argparse.Namespace) -> int:
    from harness.ab.config import load_ladder
    from harness.ab.runner import run_ladder

    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out DIR (the run to finish)")
    out = args.out or Path("runs") / f"{args.ladder.stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    ladder = load_ladder(args.ladder)
    try:
        results = run_ladder(ladder, out, resume=args.resume, overwrite=args.overwrite)
    except KeyboardInterrupt:
        print(f"\ninterrupted; servers stopped. Finish with: memtel ab run {args.ladder} --out {out} --resume",
              file=sys.stderr)
        return 130
    print(f"results: {results}")
    if args.no_report:
        return 0
    return _report(results.parent)


def _report(run_dir: Path) -> int:
    from harness.ab.report import write_report

    print(f"report: {write_report(run_dir)}")
    return 0
