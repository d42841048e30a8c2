"""Which cell (a scheduler and its workers) a request goes to: pure logic, no gRPC, no
protobuf, so that the gateway and `llmserve bench sim --cells` route with the same code.

- `settings.py`: the policies and their thresholds (`RouterSettings`, `RoutePolicy`);
- `prefix_index.py`: per cell, a bounded set of the block keys it was sent (`PrefixIndex`);
- `prompt_keys.py`: a prompt's block keys, as the scheduler's prefix cache computes them;
- `sticky.py`: the stable digests that rendezvous hashing of sessions uses;
- `router.py`: the decision (`Router.route` answers a `Route`: the cell and why).
"""

from gateway.routing.prompt_keys import prompt_keys
from gateway.routing.router import Reason, Route, Router
from gateway.routing.settings import RoutePolicy, RouterSettings

__all__ = ["Reason", "Route", "RoutePolicy", "Router", "RouterSettings", "prompt_keys"]
