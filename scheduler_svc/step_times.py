"""Where the step loops' time goes: the core, the workers' forward passes, and the rest (gRPC)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTimes:
    executed_steps: int = 0
    step_seconds: float = 0.0  # each step's share of its worker's wall time (plan .. complete)
    forward_seconds: float = 0.0  # the worker's forward pass
    core_seconds: float = 0.0  # schedule() + complete()

    def add(self, step: float, forward: float, complete: float, executions: int = 1) -> None:
        self.executed_steps += executions
        self.step_seconds += step
        self.forward_seconds += forward
        self.core_seconds += complete
