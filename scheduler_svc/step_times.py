"""Where the step loop's time goes: the core, the workers' forward passes, and the rest (gRPC)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTimes:
    executed_steps: int = 0
    step_seconds: float = 0.0  # schedule() .. postprocess() and event dispatch
    forward_seconds: float = 0.0  # the slowest worker's forward pass, per step
    core_seconds: float = 0.0  # schedule() + postprocess()

    def add(self, step: float, forward: float, core: float) -> None:
        self.executed_steps += 1
        self.step_seconds += step
        self.forward_seconds += forward
        self.core_seconds += core
