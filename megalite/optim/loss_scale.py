"""A dynamic loss scaler for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training")."""

from __future__ import annotations


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018): multiply the loss by `scale`, and
    on an inf/nan gradient skip the step and halve the scale; double it after `growth_interval`
    clean steps. A no-op (scale 1) for fp32/bf16, whose exponent range needs none."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.enabled, self.growth_interval = enabled, growth_interval
        self.scale = init_scale if enabled else 1.0
        self._good_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.scale, self._good_steps = float(d["scale"]), int(d["good_steps"])
