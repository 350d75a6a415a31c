"""The harness's `memtel` subcommands, registered through the `memtel.commands` entry points (pyproject.toml).

This module imports nothing but telemetry/commands.py: `memtel --help` loads it to list the commands.
"""

from __future__ import annotations

from telemetry.commands import Command

AB = Command("harness.ab.cli", "run an A/B prefill ladder against two servers, or write its report", "harness")
LAB = Command("harness.labserver.cli", "serve the lab model: an OpenAI-compatible server with the indexer pattern",
              "harness")
DEMO = Command("harness.demo.cli", "run the whole A/B pipeline on this machine and write the report", "harness")
