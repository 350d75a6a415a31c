"""`memtel alerts score CORPUS [--rules FILE ...] [--json]` and `memtel alerts burn-in --minutes N`.

score: every timeline of CORPUS (a .jsonl file, or a directory of them) is evaluated by promtool with the
rules (default: the shipped memtel-recording.yml and memtel-alerts.yml, package data of
telemetry.alerts, which dashboards/prometheus/ links to); it prints per alert the lead time before
each failure it caught, the failures it missed and the benign timelines it fired on. Exit 0 when no
critical alert fired on a benign timeline and every expected catch happened in time, 1 otherwise, 2 for bad
input (a bad corpus file is one line naming the file and line).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import sys
from importlib import resources
from pathlib import Path

from telemetry.errors import ConfigError

RULE_FILES = ("memtel-recording.yml", "memtel-alerts.yml")


def default_rules() -> list[Path]:
    """The rules shipped in the package (telemetry/alerts/rules/; dashboards/prometheus/memtel-*.yml link there,
    so Prometheus loads the same files), as paths promtool can read."""
    rules = resources.files("telemetry.alerts") / "rules"
    files = []
    for name in RULE_FILES:
        resource = rules / name
        if not resource.is_file():
            raise ConfigError(f"the shipped rule file {name} is missing from this install of memtel; "
                              "name the rule files with --rules FILE ...")
        if isinstance(resource, Path):
            files.append(resource)
        else:  # a zipped install: promtool needs a file, so extract it for this process's lifetime
            files.append(_EXTRACTED.enter_context(resources.as_file(resource)))
    return files


_EXTRACTED = contextlib.ExitStack()
atexit.register(_EXTRACTED.close)


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="alerts_action", metavar="COMMAND")
    score = actions.add_parser("score", help="score alert rules against a corpus of timelines",
                               description="Score alert rules against timelines whose outcome is known.")
    score.add_argument("corpus", metavar="CORPUS", help="a timeline .jsonl file, or a directory of them")
    score.add_argument("--rules", nargs="+", metavar="FILE",
                       help="Prometheus rule files (default: the shipped memtel-recording.yml and memtel-alerts.yml)")
    score.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    burn = actions.add_parser("burn-in", help="record this machine's timeline with the daemon and score the rules",
                              description="Run the memtel daemon with its flight recorder for N minutes, then score "
                                          "the rules on the recorded timeline as a benign one.")
    burn.add_argument("--minutes", type=float, required=True, metavar="N", help="how long to record (0.5 to 1440)")
    burn.add_argument("--out", metavar="FILE.jsonl", help="also keep the recorded timeline here")
    burn.add_argument("--rules", nargs="+", metavar="FILE", help="rule files (default: the shipped ones)")
    burn.add_argument("--state-dir", metavar="DIR",
                      help="the daemon's state directory for the run (default: a new temporary directory)")
    burn.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                      help="where the burn-in's daemon listens (default 127.0.0.1 on a free port)")
    burn.add_argument("--json", action="store_true", help="print the scores as one JSON object")


def run(args: argparse.Namespace) -> int:
    from telemetry.alerts.promtool import check_rules
    from telemetry.alerts.score import as_dict, as_text, score
    from telemetry.alerts.timeline import load_timeline, timeline_paths

    if args.alerts_action not in ("score", "burn-in"):
        print("memtel alerts: choose an action: score or burn-in (see memtel alerts --help)", file=sys.stderr)
        return 2
    rules = [Path(p) for p in args.rules] if args.rules else default_rules()
    if args.alerts_action == "score":
        timelines = [load_timeline(p) for p in timeline_paths(Path(args.corpus))]  # bad input first, cheaply
        check_rules(rules)
    else:
        check_rules(rules)
        from telemetry.alerts.burnin import burn_in

        timelines = [burn_in(args.minutes, args.state_dir, args.listen, args.out)]
    result = score(timelines, rules)
    print(json.dumps(as_dict(result), indent=1) if args.json else as_text(result))
    return 1 if result.problems else 0
