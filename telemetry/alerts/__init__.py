"""`memtel alerts`: score alert rules against timelines of what really happened (docs/alerts.md).

- timeline.py: the timeline file (flight recorder records plus an outcome line) and its checks;
- promtool.py: the rules evaluated over a timeline by promtool's rule engine;
- score.py: lead times, misses and benign firings per alert, and the problems CI fails on;
- burnin.py: record this machine's own timeline with the daemon and score the rules on it;
- cli.py: the command.
"""
