"""The A/B harness: cold long-context prefill ladders against two servers, and their report.

Stages, one module each: config (ladder files) -> prompts -> client -> serve -> samplers ->
records (results.jsonl) -> runner (orders them) -> report (report.md, summary.json, plots).
"""

from harness.ab.config import Ladder, LadderError, load_ladder

__all__ = ["Ladder", "LadderError", "load_ladder"]
