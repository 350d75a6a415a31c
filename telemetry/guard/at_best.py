"""The at-best limit lives in the admission core (telemetry/admission/at_best.py); these read the clocks for the
callers that do not pass them."""

from __future__ import annotations

import time
from collections.abc import Sequence

from telemetry.admission import at_best as core
from telemetry.admission.at_best import AT_BEST_WINDOW_S, CLEAN_SLACK_S, AtBest, AtBestBook, best_replica
from telemetry.admission.readings import Readings


def replica_at_best(tracker: Readings) -> tuple[AtBest | None, str | None]:
    return core.replica_at_best(tracker, time.monotonic(), time.time())


def deployment_at_best(trackers: Sequence[Readings]) -> tuple[AtBest | None, str | None]:
    return core.deployment_at_best(trackers, time.monotonic(), time.time())


__all__ = ["AT_BEST_WINDOW_S", "CLEAN_SLACK_S", "AtBest", "AtBestBook", "best_replica", "deployment_at_best",
           "replica_at_best"]
