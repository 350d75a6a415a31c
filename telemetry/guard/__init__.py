"""`memtel guard`: refuse, before the engine sees it, the prompt whose prefill would not fit.

- `GuardProxy` (proxy.py): the reverse proxy; sizes completion prompts, forwards (to the replica with the most
  room, given several) or answers 503.
- `GuardQueue` (queue.py): a prompt that does not fit now waits for room (--queue-s) instead of a 503 at once.
- replicas.py: the engines behind the guard from --upstream/--hooks, --replica or a --replicas YAML file (each URL
  an `Endpoint` of the one URL parser, telemetry/url.py).
- `LimitTracker` (limit.py): the hooks' forecasts, the limit in force, the blind episodes.
- `PromptSize`, `measure` (prompt.py): a prompt's tokens bounded from above and below without a tokenizer.
- `GuardMetrics`, `GuardCollector`, `guard_registry` (metrics.py): the guard's own Prometheus metrics.
- http.py: HTTP/1.1 through h11 on both sides, over connections with backpressure both ways.

Standard library plus h11 and prometheus_client: it runs on serving boxes with the core install (docs/guard.md).
"""

from telemetry.guard.limit import Limit, LimitTracker, RankFit, parse_fits
from telemetry.guard.metrics import GuardCollector, GuardMetrics, guard_registry
from telemetry.guard.prompt import PromptError, PromptSize, measure, parse_body
from telemetry.guard.proxy import GuardLimits, GuardProxy

__all__ = ["GuardCollector", "GuardLimits", "GuardMetrics", "GuardProxy", "Limit", "LimitTracker", "PromptError",
           "PromptSize", "RankFit", "guard_registry", "measure", "parse_body", "parse_fits"]
