"""How long a prefill takes on the simulator: a cost model, calibrated on the reference run.

With `--allocator sim` nothing computes, yet the time to first token must grow with the work the way
a real prefill's does, or the A/B report's TTFT columns would mean nothing. Each rank charges its share
of three kinds of work and sleeps until the charged time has passed:

- every prompt token through every layer (projections, MLP, attention other than the indexer),
- every logits element the indexer computes (`rows x kv length`, not the padded width: the fixed-width
  arm pads its buffer but computes the same part),
- every kernel launch (the fixed arm makes more of them in its first chunks).

The defaults are calibrated so that a cold 100k-token prefill with the reference shape (45 layers,
8,192-token chunks, compress ratio 4, two ranks) costs about 54 s, as measured on the user's pair of
DGX Sparks; roughly a sixth of it is the indexer's logits, as its FLOPs suggest (64 heads x 128 dims
x 2 = ~16k FLOP per element at ~100 TFLOP/s effective). `time_scale` shrinks the charged time so a demo
of three long prefills per arm takes seconds; reports show the scaled times.
"""

from __future__ import annotations

from dataclasses import dataclass

REFERENCE_TTFT_S = 54.0  # cold ~100k-token prefill, TP=2 over two DGX Sparks


@dataclass(frozen=True)
class CostModel:
    # Seconds per unit of work for the whole TP group; a rank doing 1/ranks of the work in parallel
    # takes 1/ranks of the group's work at the same speed, so the group's wall time is unchanged.
    token_layer_s: float = 9.9e-6
    logit_element_s: float = 1.6e-10
    launch_s: float = 2.0e-5
    decode_token_s: float = 0.05  # one output token (the user sees ~20 tokens/s)
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("token_layer_s", "logit_element_s", "launch_s", "decode_token_s", "time_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")

    def prefill_step_s(self, tokens: int, logit_elements: int, launches: int, layers: int = 1) -> float:
        """Scaled seconds for one chunk step of the whole group (`logit_elements`/`launches` per layer)."""
        per_layer = tokens * self.token_layer_s + logit_elements * self.logit_element_s + launches * self.launch_s
        return per_layer * layers * self.time_scale

    def decode_s(self, tokens: int) -> float:
        return tokens * self.decode_token_s * self.time_scale
