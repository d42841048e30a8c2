"""Speculative decoding, the scheduler's side (docs/speculative.md): proposers that draft the
tokens a request will likely produce next (`ngram`: prompt lookup in its own tokens; `suffix`:
an index over recent requests'), and the rule that chooses each step's draft lengths from the
requests' acceptance rates and the worker's step-time model (`length`). Pure: no grpc, no
torch. The worker verifies the drafts (worker_svc/verify.py)."""
