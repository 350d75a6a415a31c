"""`Admission`: the decisions of every front door, in the style of h11 (see telemetry/admission/__init__.py).

The rules for one prompt against one replica's limit (`judge`), moved from the guard's former admission.py:

1. The byte bound fits (and no field only the engine can count): forwarded, holding the bound, unless the bound is
   far above the words and would take a large share of the rank (`PromptSize.count_to_hold`): then the upstream's
   /tokenize counts it first, so it holds what its prefill needs.
2. Exact ids or the words prove it over the limit: refused (refusal.py says permanent or transient: over
   max-model-len or over the deployment's trusted at-best limit; a words count that may or may not reach either is
   counted by /tokenize first, `undecided`).
3. Otherwise /tokenize counts it (a request with a field only the engine can count always goes here); prompt_embeds
   over the limit by their bound cannot be counted by anyone: within the rank's own limit (only the prefills beside
   them stop them) they wait, as any prompt in_prefill; over it they are refused.

A /tokenize that fails while the byte bound fits (the count was only for the hold) forwards by the bound; otherwise
its answer is relayed. Every decision after a count is taken on the limit at that moment (the hooks and the holds
may have moved while the upstream counted): the caller asks again, and the core reads the limit again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from telemetry.admission.at_best import AtBest
from telemetry.admission.decisions import (
    CountFirst,
    Decision,
    Forward,
    Hold,
    ReadModels,
    RefusePermanent,
    RefuseTransient,
    refuse,
)
from telemetry.admission.pool import Replica, ReplicaPool
from telemetry.admission.prompt import PromptSize
from telemetry.admission.queue import Waiting, WaitLine
from telemetry.admission.readings import MAX_NODE_BYTES, Limit, deployment_at_best
from telemetry.admission.refusal import (
    RETRY_AFTER_S,
    Refusal,
    behind,
    error_body,
    refusal_for,
    uncountable,
    undecided,
)
from telemetry.catalogue.fields import GUARD_BLIND, GUARD_UPSTREAM_UNAVAILABLE

WHEN_BLIND = ("admit", "reject")
BLIND_ROOM = 1 << 62  # the queue's room while blind with --when-blind admit: every waiter is decided again
WAITABLE = ("would_not_fit", "in_prefill", "no_replica")  # the transient reasons waiting can cure


class Now(NamedTuple):
    """The clocks at one moment: `monotonic` (deadlines, ages) and `wall` (unix time: the hooks' forecast stamps)."""

    monotonic: float
    wall: float


# The ranges every front door holds its settings to (the guard's flags, MEMTEL_LITELLM_*, the Ray router's kwargs):
# under a second every forecast (the hook's cycle is 5 s) would be stale, the front door blind for good with nothing
# said; a reserve past what any node has (readings.MAX_NODE_BYTES) refuses everything.
SETTING_RANGES: dict[str, tuple[float, float]] = {
    "queue_s": (0.0, 3600.0),  # how long a prompt that does not fit now waits (LiteLLM's hold_s)
    "stale_s": (1.0, 86400.0),  # a hook's forecast older than this is not used
    "reserve_mb": (0.0, float(int(MAX_NODE_BYTES) >> 20)),  # more of each rank's budget kept free
    "timeout_s": (0.05, 60.0),  # one read of a hook or an engine
    "max_queued": (1, 100_000),  # prompts waiting at once (each holds its body)
}


@dataclass(frozen=True)
class Settings:
    when_blind: str = "admit"  # no fresh limit: admit (holding nothing) or refuse (503)
    queue_s: float = 0.0  # the longest a prompt that does not fit now waits (0: refused at once)
    max_queued: int = 32

    def __post_init__(self) -> None:
        if self.when_blind not in WHEN_BLIND:
            raise ValueError(f"when_blind: expected one of {', '.join(WHEN_BLIND)}, got {self.when_blind!r}")


class Prompt:
    """One request's prompt as the core follows it across its decisions: its size, its count once the upstream
    counted it, its place in the queue. Create one per request; pass it to every `decide` of that request."""

    def __init__(self, size: PromptSize) -> None:
        self.size = size
        self.tokens: int | None = None  # the upstream's count (with the size's own counted tokens)
        self.count_failure: Refusal | None = None  # the upstream's answer where it gave no count
        self.waiting: Waiting | None = None
        self.refusal: Refusal | None = None  # the last transient refusal while it waits
        self._counting: str | None = None  # "hold" or "decide": why the last CountFirst was asked
        self._decide_tried = False  # a count to tell permanent from transient was tried (it may have failed)
        self._models_asked: set[str] = set()  # replicas whose /v1/models this prompt asked to read

    def counted(self, count: int) -> None:
        """The upstream's /tokenize `count` (after a CountFirst)."""
        self.tokens = count + self.size.counted_tokens
        self._decide_tried = self._decide_tried or self._counting == "decide"
        self._counting = None

    def not_counted(self, refusal: Refusal) -> None:
        """The upstream gave no count (after a CountFirst): `refusal` is its answer, relayed where it matters."""
        if self._counting == "decide":
            self._decide_tried = True  # the words stand: a transient refusal, as without max-model-len
        else:
            self.count_failure = refusal
        self._counting = None


class Admission:
    """The admission state of one front door: its replica pool, the holds, the queue. Pure: every method takes the
    clocks (`Now`); the caller performs the decisions (decisions.py)."""

    def __init__(self, replicas: Sequence[Replica], settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.pool = ReplicaPool(replicas)
        self.line: WaitLine[Prompt] = WaitLine(self.settings.queue_s, self.settings.max_queued)

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    @property
    def queued(self) -> int:
        return len(self.line.waiters)

    # -- one prompt ----------------------------------------------------------------------------------------------
    def decide(self, prompt: Prompt, now: Now) -> Decision:
        """The next step for `prompt` (decisions.py); call again after performing a CountFirst, a ReadModels or a
        Hold."""
        waiting = prompt.waiting
        if waiting is not None and now.monotonic >= waiting.deadline and prompt.refusal is not None:
            return self._timed_out(prompt, now)
        replica = self.pool.choose(now.monotonic, now.wall)
        if replica is None:
            return self._transient(prompt, self._no_replica(), "no_replica", None, now)
        limit = replica.readings.limit_at(now.monotonic, now.wall)
        if limit is None:
            return self._blind(prompt, replica, now)
        verdict = self._judge(prompt, replica, limit, now)
        if not isinstance(verdict, tuple):
            if isinstance(verdict, Refusal):
                return self._refused(prompt, verdict, verdict.counted_as, limit, now)
            return verdict
        tokens, counted_by = verdict
        # A prompt that fits now waits behind a head that has waited its turn, but only where it has a place to
        # wait: with the queue full it goes on, never a 503 "queue full" for a prompt the engine can take now.
        if prompt.waiting is None and self.line.enabled and self.line.waiters and not self.line.full \
                and self.line.blocked(self._at_rest(now), now.monotonic):
            return self._transient(prompt, behind(tokens, counted_by, limit), "in_prefill", tokens, now)
        return self._forward(prompt, replica, tokens, counted_by, now)

    def _judge(self, prompt: Prompt, replica: Replica, limit: Limit,
               now: Now) -> tuple[int, str] | CountFirst | ReadModels | Refusal:
        """One prompt against one replica's limit (the module's rules): (tokens to hold, counted by) to forward."""
        size = prompt.size
        if prompt.tokens is None:
            if prompt.count_failure is None and size.fits_by_bound(limit.tokens) \
                    and not size.count_to_hold(limit.rank_tokens):
                return size.most_tokens, "token_ids" if size.exact else "byte_bound"
            if size.exact or size.least_tokens > limit.tokens:
                return self._over(prompt, replica, limit, size.most_tokens if size.exact else size.least_tokens,
                                  "token_ids" if size.exact else "words", now)
            if size.tokenize_body is None:
                if size.most_tokens <= limit.rank_tokens:  # fits the rank alone: only the prefills beside it stop it
                    refusal = refusal_for(size.most_tokens, "byte_bound", limit, None, size.param)
                    refusal.counted_as = refusal.reason
                    return refusal
                refusal = uncountable(size, limit)
                refusal.counted_as = "bad_request"
                return refusal
            if prompt.count_failure is None:
                return self._count(prompt, replica, "hold")
            if not size.fits_by_bound(limit.tokens):
                prompt.count_failure.counted_as = None
                return prompt.count_failure  # the upstream's answer, relayed
            return size.most_tokens, "byte_bound"
        if prompt.tokens > limit.tokens:
            return self._over(prompt, replica, limit, prompt.tokens, "tokenize", now)
        return prompt.tokens, "tokenize"

    def _count(self, prompt: Prompt, replica: Replica, why: str) -> CountFirst:
        assert prompt.size.tokenize_body is not None
        prompt._counting = why
        return CountFirst(replica, prompt.size.tokenize_body)

    def _over(self, prompt: Prompt, replica: Replica, limit: Limit, tokens: int, counted_by: str,
              now: Now) -> CountFirst | ReadModels | Refusal:
        """A prompt of `tokens` over the limit: max-model-len read first (at most once a minute), a words count that
        may or may not be permanent counted first, then the refusal."""
        # Over max-model-len is permanent only where no replica could take it: replicas may differ (the largest
        # counts), and one whose max-model-len is unknown might take it (unknown: transient).
        for other in sorted(self.replicas, key=lambda r: r is not replica):  # the chosen one first
            if other.models.stale(now.monotonic) and other.name not in prompt._models_asked:
                prompt._models_asked.add(other.name)
                return ReadModels(other)
        lengths = [r.models.get(prompt.size.model) for r in self.replicas]
        max_model_len = None if None in lengths else max(n for n in lengths if n is not None)
        best, unknown = self.at_best(now)
        if not prompt._decide_tried and undecided(prompt.size, tokens, counted_by, max_model_len, best):
            return self._count(prompt, replica, "decide")
        refusal = refusal_for(tokens, counted_by, limit, max_model_len, prompt.size.param, best, unknown)
        refusal.counted_as = refusal.reason or "would_not_fit"
        return refusal

    # -- the outcomes ----------------------------------------------------------------------------------------
    def _forward(self, prompt: Prompt, replica: Replica, tokens: int, counted_by: str, now: Now) -> Forward:
        since = self.line.leave(prompt)
        replica.readings.hold_at(tokens, now.wall)
        waited = None if since is None else now.monotonic - since
        return Forward(replica, tokens, counted_by, None if since is None else "admitted", waited)

    def _refused(self, prompt: Prompt, refusal: Refusal, counted_as: str | None, limit: Limit | None,
                 now: Now) -> Decision:
        if refusal.status == 503 and refusal.reason in WAITABLE:
            return self._transient(prompt, refusal, counted_as, None, now)
        since = self.line.leave(prompt)
        return refuse(refusal, counted_as, queue_outcome=None if since is None else "refused",
                      waited_s=None if since is None else now.monotonic - since)

    def _transient(self, prompt: Prompt, refusal: Refusal, counted_as: str | None, tokens: int | None,
                   now: Now) -> Decision:
        """A refusal waiting can cure: the prompt waits in the queue where it is on (and has room), else refused."""
        refusal.counted_as = counted_as
        if not self.line.enabled:
            return refuse(refusal, counted_as)
        needed, proven = _needs(refusal, tokens)
        waiting = prompt.waiting
        if waiting is None:
            if self.line.full:
                refusal.body["error"]["queue"] = f"full: {self.line.max_queued} requests wait (--max-queued)"
                return refuse(refusal, counted_as, queue_outcome="queue_full", waited_s=0.0)
            waiting = self.line.join(prompt, needed, proven, now.monotonic)
        else:
            waiting.tokens, waiting.proven, waiting.trying = needed, proven, False
        prompt.refusal = refusal
        return Hold(refusal, waiting.deadline)

    def _timed_out(self, prompt: Prompt, now: Now) -> RefuseTransient | RefusePermanent:
        refusal = prompt.refusal
        assert refusal is not None
        since = self.line.leave(prompt)
        seconds = now.monotonic - (since if since is not None else now.monotonic)
        refusal.body["error"]["queued_s"] = round(seconds, 3)
        refusal.body["error"]["message"] += f" (after waiting {seconds:.1f} s in the queue)"
        return refuse(refusal, refusal.counted_as, queue_outcome="timed_out", waited_s=seconds)

    def _blind(self, prompt: Prompt, replica: Replica, now: Now) -> Decision:
        """No fresh limit on the chosen replica: --when-blind decides. One admitted blind is in flight there like
        any other (it holds 0 tokens), so a snapshot meanwhile is not taken for an idle rank's (at_best.py)."""
        if self.settings.when_blind == "admit":
            return self._forward(prompt, replica, 0, "blind", now)
        message = ("the memtel guard is blind (no fresh forecast from any hook) and refuses requests until it sees "
                   f"again (--when-blind reject): {self.pool.why_blind(now.monotonic, now.wall)}")
        hooks = [h.target.url for r in self.replicas for h in r.readings.hooks]
        refusal = Refusal(503, error_body(GUARD_BLIND, message, 503, hooks=hooks), RETRY_AFTER_S["blind"])
        refusal.counted_as = "blind"
        since = self.line.leave(prompt)
        return refuse(refusal, "blind", queue_outcome=None if since is None else "refused",
                      waited_s=None if since is None else now.monotonic - since)

    def _no_replica(self) -> Refusal:
        refusal = Refusal(503, error_body(GUARD_UPSTREAM_UNAVAILABLE, f"memtel guard: no replica is healthy now "
                                          f"({self.pool.why_none()})", 503, reason="no_replica", retryable=True),
                          RETRY_AFTER_S["no_replica"], reason="no_replica")
        return refusal

    def no_replica(self) -> RefuseTransient | RefusePermanent:
        """The answer when every replica refused the connection (each left the pool)."""
        return refuse(self._no_replica(), "no_replica")

    # -- what the front door reports -------------------------------------------------------------------------
    def release(self, forward: Forward, now: Now) -> None:
        """The forwarded prompt's prefill is over (the answer's first byte, or it never ran): once per Forward."""
        forward.replica.readings.release_at(forward.tokens, now.wall)

    def unreachable(self, forward: Forward, why: str, now: Now) -> bool:
        """The replica refused the connection (nothing was sent): its hold is released and it leaves the pool;
        decide again. Whether it was in the pool."""
        self.release(forward, now)
        return self.pool.leave(forward.replica, why)

    def leave(self, prompt: Prompt, now: Now) -> float | None:
        """The client left while its prompt waited: out of the queue; how long it waited (None: it did not)."""
        since = self.line.leave(prompt)
        return None if since is None else now.monotonic - since

    def models_read(self, replica: Replica, by_model: dict[str, int] | None, now: Now) -> None:
        """What a ReadModels found (None: the read failed; what was known stays)."""
        replica.models.record(by_model, now.monotonic)

    def wake(self, now: Now) -> list[Prompt]:
        """The waiting prompts to decide again now (the limit may have risen: a hook answered, a hold was released,
        a replica came back). Call it whenever that happens; it is cheap when nothing waits."""
        if not self.line.waiters:
            return []
        found = self.pool.rooms(now.monotonic, now.wall)
        if not found and self.settings.when_blind == "admit" and any(r.healthy for r in self.replicas):
            found = [(BLIND_ROOM, BLIND_ROOM)]  # blind, admitting: every waiter is decided (and admitted) again
        best = self.at_best(now)[0]
        ceiling = None if best is None else best.tokens
        return self.line.wake([t for t, _rest in found], max((r for _t, r in found), default=0), ceiling,
                              now.monotonic)

    def at_best(self, now: Now) -> tuple[AtBest | None, str | None]:
        """The deployment's at-best limit (the best replica's, known only where every replica's is) and why not."""
        return deployment_at_best([r.readings for r in self.replicas], now.monotonic, now.wall)

    def _at_rest(self, now: Now) -> int:
        return max((rest for _tokens, rest in self.pool.rooms(now.monotonic, now.wall)), default=0)


def _needs(refusal: Refusal, default: int | None) -> tuple[int, bool]:
    """(the tokens a refused prompt needs: its count or its lower bound by words; whether that count can prove a
    misfit: a byte bound is an upper bound and proves nothing)."""
    error = refusal.body.get("error", {})
    tokens = error.get("prompt_tokens")
    found = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else (default or 0)
    return found, error.get("prompt_tokens_counted_by") in ("token_ids", "tokenize", "words")


__all__ = ["BLIND_ROOM", "WAITABLE", "WHEN_BLIND", "Admission", "Now", "Prompt", "Settings"]
