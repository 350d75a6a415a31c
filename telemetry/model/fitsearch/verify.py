"""`memtel tune --verify`: the top settings and the process's own run for real, a fresh process per prefill.

Per setting, with N its predicted longest fit: a prefill of N tokens must fit and one of N + 1 must run out of
memory (the real longest fit is then N, as predicted; below max-model-len), and a prefill of the target length
gives the real peak reserved and its time. Each probe is a fresh Python process (`python -m
telemetry.model.fitsearch.verify`, a JSON request on stdin) whose environment carries the setting's
`PYTORCH_CUDA_ALLOC_CONF`, as the lines to paste would:

- `cuda`: the process starts under the snapshot's own allocator settings, rebuilds the snapshot's state by
  allocating (rebuild.py, checked against the snapshot's layout), switches to the setting's allocator settings
  (`torch.cuda.memory._set_allocator_settings`, as the simulator keeps the state and applies the new settings
  from then on), caps the allocator at the limit (`set_per_process_memory_fraction`: the problem's cap must be
  "fraction", which the prediction then models) and runs the prefill on `CudaBackend`; peak from
  `reserved_bytes.all.peak`;
- `sim`: the lab's simulated allocator: a simulator seeded with the state under the settings read back from
  the probe's environment, capped as the problem's cap says, the launches made through the hook target
  (`indexer_logits_launch`), as the lab server's ranks make them. It checks the pipeline (the lines, a fresh
  process, the launch path); it is the same model as the prediction, so only the GPU can prove the prediction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.errors import RunError
from telemetry.model.fitsearch.search import Outcome, Problem, simulated_limit
from telemetry.model.indexer.prefill import LaunchPattern
from telemetry.model.indexer.shape import IndexerShape

ALLOC_CONF_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SnapshotSource:
    """Where a probe reads the state again: the file and the loader's limits (the same as the parent's)."""

    path: str
    device: int | None
    max_bytes: int
    max_objects: int
    max_blocks: int


@dataclass(frozen=True)
class Probe:
    tokens: int
    fits: bool
    peak_reserved_bytes: int
    seconds: float
    rebuilt: str | None = None    # CUDA: None when the rebuilt state has the snapshot's layout, else the difference

    def as_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class Verified:
    """A setting run for real. real_fit: N when N fit and N + 1 did not (or N is max-model-len and fit); None
    when the probes disagree with the prediction (`probes` says how)."""

    outcome: Outcome
    probes: tuple[Probe, ...]
    real_fit: int | None
    target: Probe | None

    @property
    def agrees(self) -> bool:
        predicted = self.outcome.target
        return (self.real_fit == self.outcome.fit_tokens and self.target is not None and predicted is not None
                and self.target.fits != predicted.out_of_memory
                and (not self.target.fits or self.target.peak_reserved_bytes == predicted.peak_reserved_bytes))

    def as_json(self) -> dict[str, Any]:
        return {"setting": self.outcome.setting.as_json(), "predicted_fit_tokens": self.outcome.fit_tokens,
                "real_fit_tokens": self.real_fit,
                "predicted_peak_reserved_bytes": (self.outcome.target.peak_reserved_bytes
                                                  if self.outcome.target else None),
                "real_peak_reserved_bytes": self.target.peak_reserved_bytes if self.target else None,
                "target_seconds": self.target.seconds if self.target else None, "agrees": self.agrees,
                "probes": [p.as_json() for p in self.probes]}


def _request(problem: Problem, source: SnapshotSource, outcome: Outcome, tokens: int, allocator: str) -> dict[str, Any]:
    setting = outcome.setting
    return {"snapshot": dataclasses.asdict(source), "shape": setting.shape(problem.base).as_dict(),
            "mode": setting.mode, "tokens": tokens, "limit_bytes": problem.limit_bytes,
            "total_memory": problem.total_memory, "release_cache_on_oom": problem.release_cache_on_oom,
            "pattern": dataclasses.asdict(problem.pattern), "allocator": allocator, "alloc_conf": setting.alloc_conf,
            "process_alloc_conf": problem.state.alloc_conf or "", "cap": problem.cap}


def run_probe(problem: Problem, source: SnapshotSource, outcome: Outcome, tokens: int, allocator: str,
              timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """One prefill of `tokens` in a fresh process under `outcome`'s setting."""
    request = _request(problem, source, outcome, tokens, allocator)
    env = dict(os.environ)
    env.pop("PYTORCH_ALLOC_CONF", None)   # torch reads it before PYTORCH_CUDA_ALLOC_CONF
    # The sim probe reads the setting from its environment (the line to paste); a CUDA probe starts under the
    # snapshot's settings, rebuilds the state, then switches to the setting's (module docstring).
    env[ALLOC_CONF_VARIABLE] = outcome.setting.alloc_conf if allocator == "sim" else request["process_alloc_conf"]
    try:
        done = subprocess.run([sys.executable, "-m", "telemetry.model.fitsearch.verify"], input=json.dumps(request),
                              capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RunError(f"verify: a {tokens:,}-token probe of {outcome.setting.label()} ran past {timeout:.0f} s") \
            from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RunError(f"verify: the {tokens:,}-token probe of {outcome.setting.label()} failed "
                       f"(exit {done.returncode}): {tail[0][:500]}")
    return Probe(**json.loads(done.stdout))


def verify(problem: Problem, source: SnapshotSource, outcomes: list[Outcome], allocator: str) -> list[Verified]:
    """Run each outcome's probes (module docstring): N, N + 1 (below max-model-len) and the target length."""
    if allocator == "cuda" and problem.cap != "fraction":
        raise RunError("verify on cuda caps the allocator with a per-process memory fraction: search with the cap "
                       "\"fraction\" (memtel tune --cap fraction) so that the prediction is of the same cap")
    results = []
    top = problem.base.max_model_len
    for outcome in outcomes:
        fit = outcome.fit_tokens
        lengths = [n for n in (fit, fit + 1) if 1 <= n <= top]
        if problem.target_tokens not in lengths:
            lengths.append(problem.target_tokens)
        probes = {n: run_probe(problem, source, outcome, n, allocator) for n in lengths}
        fits_at = probes[fit].fits if fit >= 1 else True
        beyond = probes.get(fit + 1)
        real = fit if fits_at and (beyond is None or not beyond.fits) else None
        results.append(Verified(outcome, tuple(probes[n] for n in lengths), real, probes[problem.target_tokens]))
    return results


# ---- the probe process ---------------------------------------------------------------------------


def _load_state(request: dict[str, Any]) -> Any:
    from telemetry.model.allocsim.snapshot import load_allocator_state

    src = request["snapshot"]
    return load_allocator_state(Path(src["path"]), device=src["device"], max_bytes=src["max_bytes"],
                                max_objects=src["max_objects"], max_blocks=src["max_blocks"])


class _SimProcess:
    """The probe's simulated allocator as a launch backend: launches through the hook target."""

    name = "sim"

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.peak = sim.reserved_bytes

    def launch(self, rows: int, width: int, kv_len: int) -> object:
        from telemetry.model.indexer import launch as indexer

        return self._track(indexer.indexer_logits_launch(self.sim, rows, width, kv_len))

    def alloc(self, nbytes: int) -> object:
        return self._track(self.sim.malloc(nbytes))

    def _track(self, handle: object) -> object:
        self.peak = max(self.peak, self.sim.reserved_bytes)
        return handle

    def release(self, allocation: object) -> None:
        self.sim.free(allocation)

    def counters(self) -> Any:
        from telemetry.allocator_counters import AllocatorCounters

        return AllocatorCounters.from_mapping(self.sim.stats())

    def finish(self) -> None:
        """Nothing is in flight on a simulator."""

    def close(self) -> None:
        """Nothing to release."""

    def describe(self) -> dict[str, Any]:
        return {"allocator": "sim", "seeded": True}


def _sim_probe(request: dict[str, Any], shape: IndexerShape, pattern: LaunchPattern) -> Probe:
    from telemetry.model.allocsim.simulator import SimulatedOutOfMemoryError
    from telemetry.model.allocsim.snapshot import seeded_simulator
    from telemetry.model.indexer.prefill import run_prefill

    state = _load_state(request)
    problem = Problem(state, shape, request["limit_bytes"], max(request["tokens"], 1), pattern,
                      request["total_memory"], request["release_cache_on_oom"], request["cap"])
    conf, capacity, total = simulated_limit(problem, os.environ.get(ALLOC_CONF_VARIABLE, ""))
    sim = seeded_simulator(state, conf, capacity_bytes=capacity, total_memory=total,
                           release_cache_on_oom=request["release_cache_on_oom"])
    backend = _SimProcess(sim)
    started = time.perf_counter()
    try:
        run_prefill(backend, shape, request["mode"], request["tokens"], pattern=pattern)
        fits = True
    except SimulatedOutOfMemoryError:
        fits = False
    return Probe(request["tokens"], fits, backend.peak, time.perf_counter() - started)


def _cuda_probe(request: dict[str, Any], shape: IndexerShape, pattern: LaunchPattern) -> Probe:
    from telemetry.model.allocsim.snapshot import read_allocator_state
    from telemetry.model.fitsearch.rebuild import compare, rebuild
    from telemetry.model.indexer.backends import CudaBackend
    from telemetry.model.indexer.prefill import run_prefill

    if request["process_alloc_conf"]:
        # _set_allocator_settings changes only the keys it names: from other settings than the defaults a
        # probe could not reach a setting that leaves one of them unset.
        raise RunError("verify on cuda starts from a snapshot taken under the default allocator settings; this one "
                       f"recorded {request['process_alloc_conf']!r}")
    state = _load_state(request)
    backend = CudaBackend(state.device if request["snapshot"]["device"] is not None else "cuda")
    torch = backend.torch
    kept = rebuild(backend, state)
    torch.cuda.synchronize(backend.device)
    difference = compare(state, read_allocator_state(torch.cuda.memory_snapshot(), device=backend.index))
    torch.cuda.memory._set_allocator_settings(request["alloc_conf"] or "expandable_segments:False")
    total = int(torch.cuda.get_device_properties(backend.device).total_memory)
    torch.cuda.set_per_process_memory_fraction(min(request["limit_bytes"] / total, 1.0), backend.device)
    torch.cuda.reset_peak_memory_stats(backend.device)
    started = time.perf_counter()
    try:
        run_prefill(backend, shape, request["mode"], request["tokens"], pattern=pattern)
        backend.finish()
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    seconds = time.perf_counter() - started
    peak = int(torch.cuda.memory_stats(backend.device)["reserved_bytes.all.peak"])
    del kept
    return Probe(request["tokens"], fits, peak, seconds, difference)


def _probe_main() -> int:
    request = json.loads(sys.stdin.read())
    shape = IndexerShape(**request["shape"])
    pattern = LaunchPattern(**request["pattern"])
    probe = (_cuda_probe if request["allocator"] == "cuda" else _sim_probe)(request, shape, pattern)
    json.dump(probe.as_json(), sys.stdout)
    return 0


__all__ = ["Probe", "SnapshotSource", "Verified", "run_probe", "verify"]


if __name__ == "__main__":
    sys.exit(_probe_main())
