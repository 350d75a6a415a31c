"""memtel for Ray Serve: a request router that sends each prompt to the replica where it fits (`memtel[ray]`).

- replica.py: what a replica says about itself in its routing stats (its hooks, its engine), no Ray import.
- refusal.py: the router's refusal as an exception an ingress answers (400 or 503, the guard's body).
- router.py: `MemtelRequestRouter`, a `ray.serve.request_router.RequestRouter` that takes every decision from the
  admission core (telemetry/admission).

docs/ray.md shows the set-up.
"""
