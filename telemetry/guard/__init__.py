"""`memtel guard`: refuse, before the engine sees it, the prompt whose prefill would not fit.

The decisions are the admission core's (telemetry/admission: `Admission.decide`); the guard performs them:
- `GuardProxy` (proxy.py): the glue that performs each decision (CountFirst: the upstream's /tokenize; ReadModels:
  its /v1/models; Hold: the queue's waiter; Forward; the refusals).
- server.py: the client connections and their bounds; upstream.py: the upstream client (kept-alive connections,
  one exchange, a forward relayed); queue.py: a held request's thin waiter; bounds.py: `GuardLimits`.
- replicas.py: the engines behind the guard from --upstream/--hooks, --replica or a --replicas YAML file (each URL
  an `Endpoint` of the one URL parser, telemetry/url.py).
- `LimitTracker` (limit.py): the hooks scraped into the core's `Readings`, the clocks read, the blind episodes logged.
- `GuardMetrics`, `GuardCollector`, `guard_registry` (metrics.py): the guard's own Prometheus metrics.
- http.py: HTTP/1.1 through h11 on both sides, over connections with backpressure both ways.

Standard library plus h11 and prometheus_client: it runs on serving boxes with the core install (docs/guard.md).
"""

from telemetry.guard.limit import Limit, LimitTracker, RankFit, parse_fits
from telemetry.guard.metrics import GuardCollector, GuardMetrics, guard_registry
from telemetry.guard.proxy import GuardLimits, GuardProxy

__all__ = ["GuardCollector", "GuardLimits", "GuardMetrics", "GuardProxy", "Limit", "LimitTracker", "RankFit",
           "guard_registry", "parse_fits"]
