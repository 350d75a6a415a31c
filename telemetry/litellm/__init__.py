"""memtel for a LiteLLM proxy: the guard's decision where users already have a gateway (`memtel[litellm]`).

- gauges.py: each deployment's hook gauges (`memtel_hooks` in its `model_info`), one LimitTracker per
  deployment, each hook scraped by its own task, and which deployments refused a connection. No LiteLLM
  import: tested without it.
- gate.py: `Gate`, the admission core's decisions (telemetry/admission) performed for one request: the
  deployments its model names, /tokenize and /v1/models asked, held until woken, pinned, or refused; it fails
  closed. No LiteLLM import either.
- upstream.py: /tokenize and /v1/models of a deployment's engine over kept-alive connections.
- client.py: `ClientWatch`, the ASGI middleware that sees a client leave (a held prompt is dropped, a forwarded
  one's upstream call cancelled) and ends a request's holds however it ends.
- metrics.py: `GateMetrics`, the gate's own registry (blind deployments, failed scrapes, holds, refusals) and
  why it is blind, served by client.py's middleware at `GET /memtel/metrics` and in `/health*`'s
  `x-memtel-gate-blind` header.
- refusals.py: a Refusal as the arguments of LiteLLM's ProxyException, named for the gate.
- pre_call.py: `MemtelPreCall`, a `CustomLogger` whose `async_pre_call_hook` asks the gate and carries out its
  answer in LiteLLM's terms.
- routing.py: `MemtelRouting`, a `CustomLogger` whose `async_filter_deployments` leaves the router the
  deployment where the prompt fits with the most room.

docs/guard.md, "Where users already have a gateway", and configs/litellm/config.yaml show the set-up.
"""
