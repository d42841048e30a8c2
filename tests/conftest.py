"""Every scheduler the tests start checks the core's invariants after each step and exits loudly
(code 70, the violation in its log) when one breaks; see scheduler_svc/invariants.py."""

from __future__ import annotations

import os

from scheduler_svc.invariants import ENV_VAR

os.environ.setdefault(ENV_VAR, "1")
