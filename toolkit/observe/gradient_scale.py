"""How large each parameter's gradient is next to the whole gradient, over a run (the compare's reference
arm records it; see toolkit/compare/verdict.py for how it tells weights that only rounding noise moved)."""

from __future__ import annotations

import math


class GradientScale:
    """Per parameter: the largest, over the run's steps, of max|g_element| / ‖g‖₂ (the step's global norm)."""

    def __init__(self) -> None:
        self.ratio: dict[str, float] = {}
        self.num_steps = 0

    def update(self, abs_max: dict[str, float], *, grad_norm: float) -> None:
        if not math.isfinite(grad_norm) or grad_norm <= 0:
            return  # nothing to relate to (a skipped or empty step)
        for name, value in abs_max.items():
            self.ratio[name] = max(self.ratio.get(name, 0.0), value / grad_norm)
        self.num_steps += 1

    def summary(self) -> dict:
        return {"num_steps": self.num_steps, "max_abs_over_norm": dict(sorted(self.ratio.items()))}
