"""The admission core: one decision for every front door (the guard's proxy, the LiteLLM gate, a Ray Serve router).

In the style of h11: no I/O, no callbacks, no clock read. The front door reads the hooks, the clocks and the
upstream; the core keeps the state (each replica's readings and holds, the pool, the queue) and says what to do.

Readings (readings.py). One `Readings` per replica (its hooks' `HookReading`s); report each hook's answer with
`readings.record_at(hook, fits, error, rejected, now, wall)` (`parse_hook(text)` gives fits and rejected) and the
replica's health with `admission.pool.leave(replica, why)` / `admission.pool.back(replica)`. `Replica(name,
readings)` (pool.py) is one engine; `Admission(replicas, Settings(when_blind, queue_s, max_queued))` one front door
over the one `ReplicaPool` of those replicas. Clocks: `Now(monotonic, wall)` (wall: unix time, the hooks' forecast
stamps).

One request:

    prompt = Prompt(measure(path, parse_body(raw)))      # sized without a tokenizer (prompt.py; PromptError: 400)
    while True:
        decision = admission.decide(prompt, Now(time.monotonic(), time.time()))
        match decision:
            case CountFirst(replica, body):     # POST body to replica's /tokenize, then ask again
                prompt.counted(answer["count"])  # or prompt.not_counted(refusal_relaying_the_upstreams_answer)
            case ReadModels(replica):           # GET replica's /v1/models, then ask again
                admission.models_read(replica, parse_models(body) or None, now)
            case Hold(refusal, deadline):        # wait until admission.wake(now) names `prompt`, or the deadline,
                ...                              # then ask again; a client that leaves: admission.leave(prompt, now)
            case Forward(replica, tokens, counted_by):
                # send it; admission.release(decision, now) once, at the answer's first byte (or on any failure);
                # a replica that refuses the connection: admission.unreachable(decision, why, now), ask again
                break
            case RefuseTransient() | RefusePermanent():
                # answer decision.status, decision.body, decision.headers (OpenAI's error shape: refusal.py)
                break

Call `admission.wake(now)` whenever the limit may have risen (a hook answered, a hold was released, a replica came
back) and wake the prompts it returns: on asyncio, `HeldPrompts` (waiting.py) does both, the one place every front
door's held prompts wait (`await held.wait(prompt, hold.deadline, client_gone)`, `held.kick()`). Every decision
is cheap (no I/O): thousands a second (tests/admission).
`Forward`, `Hold`, `CountFirst`, `ReadModels`, `RefuseTransient`, `RefusePermanent` are in decisions.py; the refusal
bodies and the rules for permanent against transient in refusal.py; the at-best limit in at_best.py; the queue's
order rules in queue.py. This API is kept stable: it is extended, not broken.
"""

from telemetry.admission.at_best import AtBest, AtBestBook, best_replica
from telemetry.admission.core import (
    BLIND_ROOM,
    SETTING_RANGES,
    WAITABLE,
    WHEN_BLIND,
    Admission,
    Now,
    Prompt,
    Settings,
)
from telemetry.admission.decisions import (
    CountFirst,
    Decision,
    Forward,
    Hold,
    ReadModels,
    Refuse,
    RefusePermanent,
    RefuseTransient,
)
from telemetry.admission.pool import MaxModelLen, Replica, ReplicaPool
from telemetry.admission.prompt import PromptError, PromptSize, measure, parse_body
from telemetry.admission.readings import (
    HookReading,
    Limit,
    RankFit,
    Readings,
    deployment_at_best,
    parse_hook,
    replica_at_best,
)
from telemetry.admission.refusal import Refusal, error_body, parse_models

__all__ = ["BLIND_ROOM", "SETTING_RANGES", "WAITABLE", "WHEN_BLIND", "Admission", "AtBest", "AtBestBook",
           "CountFirst", "Decision",
           "Forward", "Hold", "HookReading", "Limit", "MaxModelLen", "Now", "Prompt", "PromptError", "PromptSize",
           "RankFit", "ReadModels", "Readings", "Refusal", "Refuse", "RefusePermanent", "RefuseTransient", "Replica",
           "ReplicaPool", "Settings", "best_replica", "deployment_at_best", "error_body", "measure", "parse_body",
           "parse_hook", "parse_models", "replica_at_best"]
