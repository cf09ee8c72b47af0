"""AdvProp (Xie, Tan, Gong, Wang, Yuille and Le, "Adversarial Examples Improve Image Recognition",
CVPR 2020): train on clean and adversarial examples together, normalising the adversarial ones with
auxiliary batch-norm layers so their statistics do not pollute the main ones; test with the main BN.

How it plugs in
---------------
- :meth:`AdvProp.prepare_model` replaces every batch-norm layer with a :class:`DualBatchNorm` that holds
  the original layer (``main_bn``) and a copy (``aux_bn``). The state-dict names change accordingly
  (``conv.1.weight`` becomes ``conv.1.main_bn.weight`` and ``conv.1.aux_bn.weight``), so an algorithm
  averages the auxiliary entries like any other (FedAvg does; FedBN-style ``"*bn*"`` patterns keep both
  local).
- :meth:`AdvProp.train_batch` makes adversarial examples with an L-infinity PGD attack run through the
  auxiliary BN (model in train mode, gradients taken with respect to the inputs only), then returns the
  batch ``[clean; adversarial]`` with labels ``[y; y]`` and marks every dual BN with ``split_at = B``:
  in training mode, an input of exactly ``2B`` rows is normalised half by ``main_bn`` and half by
  ``aux_bn``. The algorithm's ordinary cross-entropy over the ``2B`` rows is then
  ``(L_clean + L_adv) / 2``, the paper's loss up to a factor 1/2. Evaluation (eval mode) uses ``main_bn``.
- A model without batch norm (LeNet-5, the MLP, the OT CNN) is refused: there would be nothing to route,
  and AdvProp would silently be plain adversarial training on clean + adversarial batches.

Defaults: ``epsilon = 2/255`` on inputs in [0, 1], ``steps = 1``, ``step_size = epsilon`` (one FGSM
step; the paper uses PGD with budgets of a few intensity levels out of 255 and step size 1/255),
no random start, adversarial inputs clipped to [0, 1].
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..models import BATCH_NORM, require_layers
from ..params import Range
from .base import Augment


class DualBatchNorm(nn.Module):
    """A main and an auxiliary batch norm with a switch.

    Attributes
    ----------
    route : "main" or "aux": which BN a training-mode forward uses when the batch is not split.
    split_at : if set, a training-mode input with exactly ``2 * split_at`` rows is normalised as
        ``[main_bn(x[:split_at]); aux_bn(x[split_at:])]``. Eval mode always uses ``main_bn``.
    """

    def __init__(self, bn: _BatchNorm):
        super().__init__()
        self.main_bn = bn
        self.aux_bn = copy.deepcopy(bn)
        self.route = "main"
        self.split_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.main_bn(x)
        if self.route == "aux":
            return self.aux_bn(x)
        s = self.split_at
        if s is not None and x.shape[0] == 2 * s:
            return torch.cat([self.main_bn(x[:s]), self.aux_bn(x[s:])])  # each half with its own statistics
        return self.main_bn(x)


def dual_bn(model: nn.Module) -> nn.Module:
    """Replace every batch-norm layer of `model` in place by a :class:`DualBatchNorm`; idempotent."""
    for name, child in model.named_children():
        if isinstance(child, DualBatchNorm):
            continue
        if isinstance(child, _BatchNorm):
            setattr(model, name, DualBatchNorm(child))
        else:
            dual_bn(child)
    return model


class AdvProp(Augment):
    """Clean + adversarial training with auxiliary batch norm for the adversarial half.

    Parameters
    ----------
    epsilon : L-infinity budget of the perturbation (inputs in [0, 1]).
    steps : PGD iterations (1: FGSM).
    step_size : size of each signed-gradient step (0: epsilon).
    random_start : start from a uniform point of the epsilon ball (Madry et al.) instead of x.
    clip : (low, high) range the adversarial inputs are clipped to, or None.
    """

    name = "advprop"
    batched = False  # its adversarial batch is the model's gradient
    constraints = {"epsilon": Range(0, low_open=True), "steps": Range(1), "step_size": Range(0)}

    def __init__(self, epsilon: float = 2 / 255, steps: int = 1, step_size: float = 0.0,
                 random_start: bool = False, clip: tuple[float, float] | None = (0.0, 1.0)):
        self.epsilon, self.steps = epsilon, steps
        self.step_size = step_size or epsilon
        self.random_start = random_start
        self.clip = tuple(clip) if clip is not None else None

    def check_model(self, model: nn.Module) -> None:
        require_layers(model, BATCH_NORM, self.name, "normalises adversarial examples with auxiliary batch norm")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return dual_bn(model)

    @staticmethod
    def _set(model: nn.Module, route: str, split_at: int | None) -> None:
        for m in model.modules():
            if isinstance(m, DualBatchNorm):
                m.route, m.split_at = route, split_at

    def attack(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        """PGD adversarial examples (B, C, H, W) within `epsilon` of x, through the auxiliary BN."""
        self._set(model, "aux", None)
        x_adv = x.detach().clone()
        if self.random_start:
            noise = torch.rand(x.shape, generator=rng).to(x) * 2 - 1  # (B, C, H, W) in [-1, 1]
            x_adv = x_adv + self.epsilon * noise
        for _ in range(self.steps):
            x_adv.requires_grad_(True)
            loss = F.cross_entropy(model(x_adv), y)
            (grad,) = torch.autograd.grad(loss, x_adv)  # inputs only: the weights' .grad stay untouched
            with torch.no_grad():
                x_adv = x_adv + self.step_size * grad.sign()
                x_adv = torch.min(torch.max(x_adv, x - self.epsilon), x + self.epsilon)
                if self.clip is not None:
                    x_adv = x_adv.clamp(*self.clip)
        self._set(model, "main", None)
        return x_adv.detach()

    def train_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cid: int,
                    rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x_adv = self.attack(model, x, y, rng)  # (B, C, H, W)
        self._set(model, "main", len(x))  # the next 2B-row forward routes its halves
        return torch.cat([x, x_adv]), torch.cat([y, y])
