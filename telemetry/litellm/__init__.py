"""memtel for a LiteLLM proxy: the guard's decision where users already have a gateway (`memtel[litellm]`).

- gauges.py: each deployment's hook gauges (`memtel_hooks` in its `model_info`), one LimitTracker per
  deployment scraped by the guard's own loop, and the choice of the deployment with the most room. No
  LiteLLM import: the choice is tested without it.
- refusals.py: a guard Refusal as the arguments of LiteLLM's ProxyException (no LiteLLM import either).
- pre_call.py: `MemtelPreCall`, a `CustomLogger` whose `async_pre_call_hook` sizes the prompt and admits,
  holds or refuses it as `memtel guard` does.
- routing.py: `MemtelRouting`, a `CustomLogger` whose `async_filter_deployments` leaves the router the
  deployment where the prompt fits with the most room.

docs/guard.md, "Where users already have a gateway", and configs/litellm/config.yaml show the set-up.
"""
