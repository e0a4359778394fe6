"""Mixed precision for strategies that run the model in fp32 weights: autocast + (fp16) a GradScaler."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from toolkit.errors import RecipeError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype | None) -> str:
    """The recipe's name of a dtype (fp32, bf16, fp16); others as torch prints them, None as n/a."""
    if dtype is None:
        return "n/a"
    names = {v: k for k, v in DTYPES.items()}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def check_precision_supported(precision: str, device: torch.device) -> None:
    """Refuse a precision the device cannot compute in, before any work is done."""
    if precision == "fp32":
        return
    if device.type == "cuda":
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise RecipeError(f"precision bf16 is not supported on {torch.cuda.get_device_name(device)}; "
                              "use precision: fp16 (with loss scaling) or fp32")
        return
    try:
        with torch.autocast(device.type, dtype=DTYPES[precision]):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise RecipeError(f"precision {precision} is not supported on {device.type}: {exc}; use fp32") from None


@dataclass
class StepResult:
    grad_norm: float  # global L2 norm of the gradients before clipping
    skipped: bool  # fp16 overflow: the optimizer step was skipped
    loss_scale: float | None  # fp16 loss scale after this step
    # gradients were inf/nan without fp16 loss scaling to handle it (the torch strategies skip the update)
    nonfinite: bool = False
    # local SGD at a sync: how far the replicas had drifted apart just before it (rms ‖replica − mean‖ / ‖mean‖)
    drift_before_sync: float | None = None

    @classmethod
    def dropped(cls, *, drift_before_sync: float | None = None) -> StepResult:
        """A step whose loss was not finite, dropped without an update (train.on_nonfinite skip)."""
        return cls(grad_norm=float("nan"), skipped=True, loss_scale=None, nonfinite=True,
                   drift_before_sync=drift_before_sync)

    @property
    def advances_schedule(self) -> bool:
        """Whether the lr schedule steps after this step: not after an fp16 overflow the loss scaler skipped, as
        DeepSpeed's engine and transformers' Trainer hold it (the update did not happen; the torch strategies
        stepped it, so their lr ran ahead of a ZeRO arm's by one step per overflow). A step whose non-finite
        values were discarded (train.on_nonfinite skip) used up its batch, and does."""
        return not self.skipped or self.nonfinite


class Amp:
    """autocast for the forward, GradScaler for fp16 backward/step; a no-op in fp32."""

    def __init__(self, precision: str, device: torch.device, *, scaler_class=torch.amp.GradScaler):
        self.precision, self.device = precision, device
        self.scaler = scaler_class(device.type) if precision == "fp16" else None

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer, parameters, *, max_grad_norm: float | None, clip=None) -> StepResult:
        """Unscale (fp16), clip, step, update the scale. `clip(params, max_norm)` returns the total norm."""
        clip = clip or torch.nn.utils.clip_grad_norm_
        if self.scaler:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = clip(parameters, max_grad_norm if max_grad_norm else math.inf)
        grad_norm = float(grad_norm)  # device sync: once per optimizer step
        if not self.scaler:
            if not math.isfinite(grad_norm):  # inf/nan gradients would make every weight NaN: no update
                return StepResult(grad_norm=grad_norm, skipped=True, loss_scale=None, nonfinite=True)
            optimizer.step()
            return StepResult(grad_norm=grad_norm, skipped=False, loss_scale=None)
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skips the step when the grads hold inf/nan
        self.scaler.update()
        after = self.scaler.get_scale()
        return StepResult(grad_norm=grad_norm, skipped=after < before, loss_scale=after)
