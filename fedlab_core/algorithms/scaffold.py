"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020): local steps corrected by control variates.

The server holds a control variate c, each client its own c_i (both zero at start). A local step is
``w <- w - lr (g + c - c_i)``: the correction removes the drift of the client's gradient from the
global one. After K local steps the client updates its variate with the paper's option II,
``c_i+ = c_i - c + (w_global - w_i) / (K lr)``, and uploads ``delta_w = w_i - w_global`` and
``delta_c = c_i+ - c_i``. The server steps ``w += server_lr * mean(delta_w)`` and
``c += (|S| / N) mean(delta_c) = sum(delta_c) / N`` (N: all clients), which keeps c the mean of every c_i.
The message down carries w and c, so a round moves twice FedAvg's tensor bytes each way.
Defaults: ``server_lr = 1.0`` (the paper's eta_g = 1 throughout, Section 7). mean(delta_w) is the
paper's unweighted mean over S (``sample_weighted=True`` weights it by sample counts, as FedAvg does);
mean(delta_c) is always unweighted, since c must stay the plain mean of the c_i. Local training: the
paper's epoch is 5 local steps on batches of a fifth of the client's data, with the client rate tuned
per algorithm and not stated; here one local epoch of batch 32 at 0.05 (ours). Control
variates cover the shared parameters only; batch-norm running statistics are buffers without a
gradient: their deltas are averaged with step 1, which is exactly FedAvg's average. Option II assumes
plain SGD; with momentum or Adam it is used as is (an approximation).
"""
from __future__ import annotations

from typing import Any

import torch

from ..params import Range
from .base import Algorithm, FlatState, Message, Training, local_steps_taken, weighted_mean


class Scaffold(Algorithm):
    """Stochastic controlled averaging (option II control-variate update).

    Parameters
    ----------
    training : local training settings; its lr enters the control-variate update.
    server_lr : the server's global step size on the averaged update.
    sample_weighted : weight the mean update by the clients' sample counts (the paper's is uniform).
    """

    name = "scaffold"
    batched = True
    shares = "the change of its control variate, every round"
    constraints = {"server_lr": Range(0, low_open=True)}
    paper_training = Training(local_epochs=1, batch_size=32, lr=0.05)

    def __init__(self, training: Training | None = None, server_lr: float = 1.0, sample_weighted: bool = False):
        super().__init__(training)
        self.server_lr = server_lr
        self.sample_weighted = sample_weighted

    def init(self, model, federation) -> dict[str, Any]:
        state = super().init(model, federation)
        self.param_mask = self.shared.parameter_mask(model)  # (P,) bool
        names = {name for name, _ in model.named_parameters()} & set(self.shared.names)
        self.params = FlatState(model, keep=lambda name: name in names)  # same order as the mask
        return {**state, "control": torch.zeros(self.params.size, device=self.device)}

    def init_client(self, cid: int) -> dict[str, Any]:
        return {**super().init_client(cid), "control": torch.zeros(self.params.size, device=self.device)}

    def server_message(self, server_state, cid) -> Message:
        return Message({"weights": server_state["weights"], "control": server_state["control"]})

    @staticmethod
    def control_update(c_i: torch.Tensor, c: torch.Tensor, w_global: torch.Tensor, w_local: torch.Tensor,
                       num_steps: int, lr: float) -> torch.Tensor:
        """Option II: the client's new variate ``c_i - c + (w_global - w_local) / (K lr)`` (flat, (Q,))."""
        return c_i - c + (w_global - w_local) / (num_steps * lr)

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        super().start(message, client_state)
        self._global, self._control = message.tensors["weights"], message.tensors["control"]  # (P,), (Q,)
        c_i = client_state["control"]  # (Q,)
        # each corrected parameter's slices of c and c_i: the context of its steps
        self._context = {**{f"c.{name}": self.params.view(self._control, name) for name in self.params.names},
                         **{f"c_i.{name}": self.params.view(c_i, name) for name in self.params.names}}
        return self._context

    @staticmethod
    def corrected_gradient(grad: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor) -> torch.Tensor:
        """The corrected local gradient ``g + c - c_i`` of one parameter."""
        return grad.add(c).sub(c_i)

    def correct(self, grads, params, context):
        return {name: self.corrected_gradient(g, context[f"c.{name}"], context[f"c_i.{name}"])
                if f"c.{name}" in context else g for name, g in grads.items()}

    @torch.no_grad()
    def before_step(self, client_state: dict[str, Any]) -> None:
        params = {name: p for name, p in self.model.named_parameters() if f"c.{name}" in self._context}
        # the correction applies even where the loss has no gradient
        grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in params.items()}
        for name, grad in self.correct(grads, params, self._context).items():
            params[name].grad = grad

    def finish(self, data, loss, client_state):
        c, c_i, w_global = self._control, client_state["control"], self._global
        upload = self.upload(data, loss, client_state)  # the trained weights, local entries kept
        w_i = upload.tensors.pop("weights")  # (P,)
        steps = local_steps_taken(data.num_train, self.training)
        if steps:
            new_c_i = self.control_update(c_i, c, w_global[self.param_mask], w_i[self.param_mask], steps,
                                          self.training.lr)
        else:  # no step taken: nothing learnt about the local gradient
            new_c_i = c_i.clone()
        upload.tensors["delta"] = w_i - w_global
        upload.tensors["delta_control"] = new_c_i - c_i
        return upload, {**client_state, "control": new_c_i}

    def aggregate(self, server_state, uploads: list[tuple[int, Message]], round_idx) -> dict[str, Any]:
        w, c = server_state["weights"], server_state["control"]  # (P,), (Q,)
        delta = weighted_mean([m.tensors["delta"] for _, m in uploads],
                              [m.num_samples if self.sample_weighted else 1.0 for _, m in uploads])
        # parameters take the server step; buffers take the plain average (step 1)
        new_w = w + torch.where(self.param_mask, self.server_lr * delta, delta)
        new_c = c.clone()  # (Q,)
        for _, m in uploads:  # c += (|S|/N) mean_S(delta_c) = sum_S(delta_c) / N
            new_c.add_(m.tensors["delta_control"], alpha=1.0 / self.federation.num_clients)
        return {**server_state, "weights": new_w, "control": new_c}
