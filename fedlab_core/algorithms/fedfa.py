"""FedFA (Zhou and Konukoglu, "FedFA: Federated Feature Augmentation", ICLR 2023; code github
tfzhou/FedFA, ``pyfed/utils/ffa_layer.py``): FedAvg whose clients perturb the channel statistics of
intermediate feature maps during local training.

For a feature map x (B, C, H, W) with instance statistics ``mu = mean_HW x`` and ``sigma = sqrt(var_HW x
+ eps)`` (each (B, C)), with probability p per layer and batch the map is re-styled as

    x' = (x - mu) / sigma * sigma_new + mu_new,   mu_new ~ N(mu, S_mu^2),   sigma_new ~ N(sigma, S_sigma^2)

with ``S^2 = (gamma + 1) * (var_B(stat) + eps)`` per channel: the batch variance of the statistic
widened by a client-sharing factor ``gamma = C * r / sum_c r``, ``r = V / (1 + V)``, where V (C,) is
the variance across clients of their momentum-averaged channel statistics (the server computes it from
the uploads each round and sends it down; ones before the first round, as the code initialises it).
Gradients flow through mu, sigma and the sampled statistics, as in the code. At evaluation the
augmentation is the identity: the hooks exist only inside :meth:`FedFA.loss` on a training step.

Where: forward hooks on the output of each convolutional block (the model's ``blocks``: after conv,
batch norm, ReLU and, where the block has one, max-pooling), as the code places its layers in its
AlexNet (after each of the five stages, none in the classifier); for the ResNets, after the stem and
after each residual stage, never inside a residual branch (the code has no ResNet). ``layers`` names
other modules. Maps with one pixel are left alone (no spatial variance). A model without convolutional
blocks (the MLP) is refused: FedFA on it would be plain FedAvg.

Defaults: ``p = 0.5``, ``momentum = 0.99`` for the client statistics, ``eps = 1e-6`` (the code's).
Local training (``paper_training``): SGD, lr 0.01, batch 32, one local epoch, as the code trains on
Office-Caltech-10 (``pyfed`` configs; 400 rounds).

Choices and differences from the code
-------------------------------------
- Each client keeps its momentum statistics (mean and std per channel of every hooked layer, zeros and
  ones at first) in its client state and uploads them (2 x channels floats) every round; the code stores
  them as model buffers, which its server also averages and sends back.
- They are updated on every training batch; the code updates them only on batches it augments.
- V is the per-channel variance across this round's uploads (the paper's). The code calls
  ``torch.var`` on the stacked (clients, C) tensor, a single number per layer, which makes gamma = 1
  for every channel; ``pooled_client_variance=True`` reproduces that.
- Every random draw (the coin per layer and batch, the Gaussian noise) comes from the client's rng, drawn for a
  batch before its step (:meth:`FedFA.draws`), in the order the hooks would draw them in the forward pass, so that
  the batched executor (:mod:`fedlab_core.batched`) draws them as the loop does and trains the clients together.
  The maps are re-styled in the loss's forward pass only: an augmentation that runs the model itself to make its
  batch (AdvProp's adversarial step) sees the model's own maps. (No page combines FedFA with AdvProp.)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models import MODELS, meta_model
from ..params import Range
from .base import Algorithm, Training


@torch.no_grad()
def _output_shapes(model: nn.Module, modules: list[nn.Module], input_shape: tuple[int, int, int]
                   ) -> list[tuple[int, ...]]:
    """The shape of each module's output for one sample, (C, H, W) for a feature map, from one forward pass of two
    zero images (eval mode, so no batch-norm statistic moves)."""
    seen: dict[int, tuple[int, ...]] = {}

    def record(module, args, out) -> None:  # returns None: the output passes unchanged
        seen[id(module)] = tuple(out.shape[1:])
    handles = [m.register_forward_hook(record) for m in modules]
    was_training = model.training
    model.eval()
    try:
        model(torch.zeros(2, *input_shape, device=next(model.parameters()).device))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return [seen[id(m)] for m in modules]


def client_sharing_factor(client_var: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``gamma = C * r / sum(r)`` with ``r = V / (1 + V)`` for client-sharing variances V (C,)."""
    r = 1.0 / (1.0 + 1.0 / (client_var + eps))  # (C,)
    return len(r) * r / r.sum()


def batch_mean(stat: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over a batch's samples of a statistic (B, C): over its `real` rows (B,) bool where given (the batched
    executor's padded batch)."""
    if real is None:
        return stat.mean(0)
    return torch.where(real[:, None], stat, 0.0).sum(0) / real.sum().clamp(min=1)


def batch_var(stat: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The unbiased variance over a batch's samples of a statistic (B, C), over its `real` rows where given."""
    if real is None:
        return stat.var(0)
    centred = torch.where(real[:, None], stat - batch_mean(stat, real), 0.0)
    return centred.square().sum(0) / (real.sum() - 1).clamp(min=1)


def resample_statistics(x: torch.Tensor, client_var_mean: torch.Tensor, client_var_std: torch.Tensor,
                        noise_mean: torch.Tensor, noise_std: torch.Tensor, eps: float = 1e-6,
                        real: torch.Tensor | None = None) -> torch.Tensor:
    """FedFA's feature-statistics augmentation of one feature map.

    Parameters
    ----------
    x : (B, C, H, W) feature map, B >= 2 and H * W >= 2.
    client_var_mean, client_var_std : (C,) variances across clients of the channel means and stds.
    noise_mean, noise_std : (B, C) standard normal draws.
    real : (B,) bool, the samples of a padded batch that count (the batched executor's): the batch variances of
        the statistics are taken over them; None: every sample.

    Returns
    -------
    (B, C, H, W) map whose instance channel means are ``mu + noise_mean * S_mu`` and stds
    ``(sigma + noise_std * S_sigma) * sqrt(var_HW / (var_HW + eps))``.
    """
    mean = x.mean(dim=(2, 3))                      # (B, C)
    std = (x.var(dim=(2, 3)) + eps).sqrt()         # (B, C)
    scale_mean = ((client_sharing_factor(client_var_mean, eps) + 1) * (batch_var(mean, real) + eps)).sqrt()  # (C,)
    scale_std = ((client_sharing_factor(client_var_std, eps) + 1) * (batch_var(std, real) + eps)).sqrt()    # (C,)
    new_mean = mean + noise_mean * scale_mean      # (B, C)
    new_std = std + noise_std * scale_std          # (B, C)
    normalised = (x - mean[:, :, None, None]) / std[:, :, None, None]
    return normalised * new_std[:, :, None, None] + new_mean[:, :, None, None]


class Received(nn.Module):
    """The client-sharing variances a client received, ``client_var_mean`` and ``client_var_std`` (sum C,), as
    buffers: a frozen model of the batched executor, which puts each client's own into it."""

    def __init__(self, total: int):
        super().__init__()
        self.register_buffer("client_var_mean", torch.ones(total))
        self.register_buffer("client_var_std", torch.ones(total))


class FedFA(Algorithm):
    """FedAvg with federated feature augmentation of intermediate feature maps.

    Parameters
    ----------
    training : local training settings.
    p : probability of augmenting a hooked layer's output on a batch.
    momentum : momentum of the client's running channel statistics.
    eps : added to variances.
    layers : names of the modules whose outputs are augmented (None: the rule in the module docstring).
    pooled_client_variance : one client-sharing variance per layer over all channels (the code's).
    """

    name = "fedfa"
    batched = True
    paper_training = Training(lr=0.01, batch_size=32, local_epochs=1)
    constraints = {"p": Range(0, 1), "momentum": Range(0, 1), "eps": Range(0, low_open=True)}
    STATISTICS = ("running_mean", "running_std")  # a client's momentum statistics, kept and uploaded

    def __init__(self, training: Training | None = None, p: float = 0.5, momentum: float = 0.99,
                 eps: float = 1e-6, layers: tuple[str, ...] | None = None, pooled_client_variance: bool = False):
        super().__init__(training)
        self.p = p
        self.momentum = momentum
        self.eps = eps
        self.layers = layers
        self.pooled_client_variance = pooled_client_variance

    def check_model(self, model) -> None:
        names = self.layers if self.layers is not None else getattr(model, "blocks", ())
        if not names:
            raise ValueError(f"{self.name!r} re-styles the statistics of convolutional feature maps, and "
                             f"{type(model).__name__} has no convolutional block; use a convolutional model "
                             f"({', '.join(n for n in MODELS if meta_model(n, (3, 64, 64), 10).blocks)})")
        modules = dict(model.named_modules())
        for name in names:
            if name not in modules:
                raise ValueError(f"{self.name!r} parameter 'layers': {name!r} is not a module of "
                                 f"{type(model).__name__} (its convolutional blocks end at: {', '.join(model.blocks)})")

    def init(self, model, federation):
        server = super().init(model, federation)
        modules = dict(model.named_modules())
        names = list(self.layers if self.layers is not None else model.blocks)
        self.hooked = [(n, modules[n]) for n in names]
        shapes = _output_shapes(model, [m for _, m in self.hooked], federation.input_shape)
        channels = [shape[0] for shape in shapes]
        self.slices = [slice(sum(channels[:i]), sum(channels[:i + 1])) for i in range(len(channels))]
        # the maps that can be re-styled: (C, H, W) with a spatial variance (a map of one pixel has none)
        self.styled = [len(shape) == 3 and shape[1] * shape[2] >= 2 for shape in shapes]
        total = sum(channels)
        self.received = Received(total).to(self.device)
        server["client_var_mean"] = torch.ones(total, device=self.device)  # (sum C,)
        server["client_var_std"] = torch.ones(total, device=self.device)
        return server

    def init_client(self, cid: int) -> dict[str, Any]:
        total = sum(s.stop - s.start for s in self.slices)
        return {**super().init_client(cid), "running_mean": torch.zeros(total, device=self.device),
                "running_std": torch.ones(total, device=self.device)}

    def server_message(self, server_state, cid):
        message = super().server_message(server_state, cid)
        message.tensors.update(client_var_mean=server_state["client_var_mean"],
                               client_var_std=server_state["client_var_std"])
        return message

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        """The received model; the received client-sharing variances into :meth:`frozen_models` (and as the context,
        from which the batched executor puts each client's into it); the client's momentum statistics, which its
        steps update (:meth:`carried`)."""
        super().start(message, client_state)
        with torch.no_grad():
            for name, t in self.received.named_buffers():
                t.copy_(message.tensors[name])
        self._running = {k: client_state[k].clone() for k in self.STATISTICS}
        return {f"received.{n}": t.clone() for n, t in self.received.named_buffers()}

    def carried(self) -> dict[str, torch.Tensor]:
        return self._running  # updated by the loss on every training batch (the hooks), not by a step rule

    def frozen_models(self) -> dict[str, nn.Module]:
        return {"received": self.received}

    def finish(self, data, loss, client_state):
        upload, client_state = super().finish(data, loss, client_state)
        client_state.update(self._running)
        upload.tensors.update(self._running)
        return upload, client_state

    def draws(self, x, y, rng) -> dict[str, torch.Tensor]:
        """Each hooked layer's draws for this batch, in the forward pass's order: the coin (one per layer and
        batch, ``"augment.<i>"`` (B,) bool, every row the batch's coin) and, where it says to re-style the map, the
        normal draws of its new means and stds (``"noise.<i>"`` (B, 2, C), zeros otherwise). A layer whose map has
        no spatial variance, or a batch of one sample, draws nothing."""
        out = {}
        for i, (s, styled) in enumerate(zip(self.slices, self.styled)):
            hit = styled and len(x) >= 2 and torch.rand((), generator=rng).item() < self.p
            noise = (torch.randn((2, len(x), s.stop - s.start), generator=rng).transpose(0, 1).to(self.device) if hit
                     else torch.zeros(len(x), 2, s.stop - s.start, device=self.device))
            out[f"augment.{i}"] = torch.full((len(x),), hit, device=self.device)
            out[f"noise.{i}"] = noise
        return out

    def loss(self, x, y, client_state):
        """The cross-entropy with the hooked layers' maps re-styled by the batch's draws (``client_state["draws"]``;
        none: the model's own maps)."""
        handles = [m.register_forward_hook(self._hook(i, client_state)) for i, (_, m) in enumerate(self.hooked)]
        try:
            return super().loss(x, y, client_state)
        finally:
            for h in handles:
                h.remove()

    def _hook(self, i: int, step: dict[str, Any]):
        """Layer `i`'s hook for one step (`step`: the loss's client state): it moves the client's momentum
        statistics and re-styles the map where the batch's coin says so. On the batched executor's padded batch
        (``step["real"]``) the batch's statistics are over its real samples, and the statistics moved are the
        client's as the executor carries them (``step["carried"]``)."""
        channels = self.slices[i]

        def hook(module: nn.Module, inputs, x: torch.Tensor):
            draws, real = step.get("draws"), step.get("real")
            if draws is None or not module.training or not self.styled[i] or real is None and len(x) < 2:
                return None
            running = step.get("carried", self._running)
            with torch.no_grad():
                mean, std = x.mean(dim=(2, 3)), (x.var(dim=(2, 3)) + self.eps).sqrt()  # (B, C)
                for key, stat in zip(self.STATISTICS, (mean, std)):
                    old = running[key]
                    part = old[channels].mul(self.momentum).add(batch_mean(stat, real), alpha=1 - self.momentum)
                    if real is not None:  # a batch of one real sample moves nothing
                        part = torch.where(real.sum() >= 2, part, old[channels])
                    running[key] = torch.cat((old[:channels.start], part, old[channels.stop:]))
            augment, noise = draws[f"augment.{i}"], draws[f"noise.{i}"]  # (B,), (B, 2, C)
            if real is None and not augment[0]:
                return None
            styled = resample_statistics(x, self.received.client_var_mean[channels],
                                         self.received.client_var_std[channels], noise[:, 0], noise[:, 1], self.eps,
                                         real)
            return styled if real is None else torch.where(augment[:, None, None, None], styled, x)
        return hook

    def aggregate(self, server_state, uploads, round_idx):
        server = super().aggregate(server_state, uploads, round_idx)
        if len(uploads) < 2 or server["client_var_mean"].numel() == 0:  # no spread to measure, or no maps
            return server
        for key, stat in (("client_var_mean", "running_mean"), ("client_var_std", "running_std")):
            stats = torch.stack([m.tensors[stat] for _, m in uploads])  # (K, sum C)
            var = stats.var(0)  # (sum C,)
            if self.pooled_client_variance:
                for s in self.slices:
                    var[s] = stats[:, s].var()
            server[key] = var
        return server
