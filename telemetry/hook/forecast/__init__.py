"""The hook's live forecast: how many bytes the next prefill of N tokens would add to this process's allocator.

Opt-in (MEMTEL_FORECAST_TOKENS, docs/hook.md "Live forecast"). A daemon thread per process (runner.py) takes
the allocator's segments every MEMTEL_FORECAST_INTERVAL_S seconds, seeds the caching-allocator simulator
with them and runs the indexer's prefill of each length (`telemetry.model.indexer.forecast.forecast`) with the
running server's workload (workload.py; vLLM's, read at `Worker.load_model` by telemetry/engines/vllm.py). The
collector (collector.py) exports the results. settings.py parses the settings. On CUDA the simulation runs in
a helper process (helper.py, compute.py) on a shadow of the allocator kept from its events (shadow.py).

Modules import the model (telemetry/model: the simulator, the indexer's launch loop) only when a forecast runs:
`import telemetry.hook` stays light.
"""

from telemetry.hook.forecast.workload import ForecastWorkload, set_forecast_workload

__all__ = ["ForecastWorkload", "set_forecast_workload"]
