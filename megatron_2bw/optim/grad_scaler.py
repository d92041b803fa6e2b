"""Loss scalers for fp16 (Megatron semantics). bf16 and fp32 use `NoLossScaler` (scale 1)."""
from __future__ import annotations

from megatron_2bw.config import PrecisionConfig


class NoLossScaler:
    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """A static scale never changes (an overflowing step is still skipped by the caller)."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(NoLossScaler):
    """Back off by `backoff` after `hysteresis` overflows; grow by `growth` after `window` clean
    steps in a row; never below `min_scale`."""

    dynamic = True

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int,
                 growth: float = 2.0, backoff: float = 0.5):
        if initial_scale <= 0 or min_scale <= 0 or window < 1 or hysteresis < 1:
            raise ValueError("--initial-loss-scale and --min-loss-scale must be > 0, "
                             "--loss-scale-window and --hysteresis >= 1")
        super().__init__(initial_scale)
        self.min_scale, self.window, self.hysteresis = min_scale, window, hysteresis
        self.growth, self.backoff = growth, backoff
        self.clean_steps = 0
        self.overflows_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.overflows_left = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "overflows_left": self.overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = state.get("clean_steps", 0)
        self.overflows_left = state.get("overflows_left", self.hysteresis)


def build_loss_scaler(precision: PrecisionConfig) -> NoLossScaler:
    if not precision.fp16:
        return NoLossScaler()
    if precision.loss_scale is not None:
        return NoLossScaler(precision.loss_scale)
    return DynamicLossScaler(precision.initial_loss_scale, precision.min_loss_scale,
                             precision.loss_scale_window, precision.hysteresis)
