"""FRAug (Chen, Frikha, Krompass, Tresp, "FRAug: Tackling Federated Learning with Non-IID Features via
Representation Augmentation", ICCV 2023): FedBN whose clients also train their prediction heads on
synthetic embeddings, made by a generator shared by all clients and a network each client keeps.

How it differs from FedBN
-------------------------
- The model is split into a feature extractor ``f`` (``model.features``) and a head ``h``
  (``model.head``); every model of the library has the split (``lenet5_bn``: its 84-d layer, ``digit``:
  its 512-d layer). Batch norm stays local, as in FedBN.
- A **generator** ``G(z, y)`` (Linear(latent + classes, F), BN, ReLU, Linear(F, F), BN, ReLU; ``y``
  one-hot, F the feature size) is shared: the server averages it, weighted by sample counts like the model.
  Its output ``v_hat`` is meant to be client-agnostic.
- Each client keeps an **RTNet** ``m`` (Linear(F + classes, latent), BN, ReLU, Linear(latent, F), BN; its
  input is ``v_hat`` and the one-hot class) that turns ``v_hat`` into a client-specific residual, and
  **class prototypes**: ``proto_c <- 0.7 proto_c + 0.3 (the batch's mean embedding of class c)`` before
  each model step, from zeros, for the classes the batch holds (the code's rate; the paper's ramp-up of
  the rate is not specified). Neither ever leaves the client.
- Synthetic embeddings (Eq. 3): ``u_hat = u + lam m(G(z, y))`` around the batch's real embeddings
  ``u = f(x)``, and ``u_hat_c = proto_c + lam m(G(z', c))`` around the prototypes, for a batch of the
  same size whose labels run through the classes in turn (as the code does; Eq. 2's sum over classes).
- Each local step has two stages (Algorithm 1):
  1. the model, with G and RTNet fixed: ``L_real + L_syn`` (Eq. 1-2), cross-entropy on the real batch,
     plus cross-entropy on ``u_hat`` and on ``u_hat_c``; the synthetic embeddings are built without
     gradient, so ``L_syn`` trains the head only;
  2. G and RTNet, with the model fixed: G minimises ``CE(h(u_hat), y) - alpha MMD(u_hat, u)`` (Eq. 5),
     RTNet ``-(H(h(u_hat)) + H(h(u_hat_c))) + beta (MMD(u_hat, u) + MMD(u_hat_c, proto))`` (Eq. 6), H the
     mean entropy of the head's softmax; each steps on the gradient of its own loss (SGD, ``aux_lr``,
     momentum 0.5, a fresh optimiser each round unless ``keep_optimizer``). Stage 2 reuses stage 1's
     embeddings ``u``.
- The three cross-entropies of stage 1 are weighted real : synthetic : prototype-synthetic = 1 : 1 : 1,
  Eq. 1-2 as the paper writes them; ``loss_weights=(0.5, 0.25, 0.25)`` is the authors' code on Digits
  (``user_FRAug.py``). At 1 : 1 : 1 the two synthetic terms outweigh the real one 2 : 1.
- ``lam = exp(gamma (r - R) ramp_rounds / R)`` in round r of R (``smoothing``; the paper: "increase it
  following an exponential schedule", no formula). The code's formula is ``exp(gamma (r - R))`` over its
  300 rounds, a ramp from 0.05 to 1 at gamma 0.01; ``ramp_rounds=300`` (default) gives that shape over
  any number of rounds, ``ramp_rounds=0`` the code's formula unscaled (over 30 rounds it only runs from
  0.75 to 1). The code runs Digits with no schedule (``lam = 1``): ``smoothing=False``.
- MMD (:func:`mmd`): the biased estimate with a sum of five Gaussian kernels whose bandwidths double from
  the mean pairwise squared distance / 4, as in the authors' code.

Where the paper and the authors' code differ (``variant``; the paper's reading is the default)
-------------------------------------------------------------------------------------------------
``variant="code"`` switches all of these to the code's:

- noise ``z ~ N(0, I)`` (paper) or ``torch.rand``, uniform on [0, 1) (code);
- the model's loss ``L_real + L_syn`` (Eq. 1) or ``(1 - Lr) L_real + Lr L_syn / 2`` with
  ``Lr = min(0.5, the schedule's ramp)``, which stays at 0.5 for a whole Digits run (gamma 0.002): 0.5 :
  0.25 : 0.25;
- G's loss on ``u_hat`` (Eq. 5) or on its own output ``v_hat`` (the code, MMD against the real embeddings).

Batch norm stays local, all of it, in both: the code's ``no_bn_running_stats`` mode reads like "share batch norm's
weights, keep its running statistics", but its server (``servers/server_base.py``) skips every key containing
"bn" once ``'no_bn' in mode``, which that mode's name satisfies: FedBN's rule, which the paper cites.

Options for the code's other choices: ``keep_optimizer=True`` keeps the model's and the auxiliary networks'
SGD momentum on the client from one round to the next, as the code's optimisers live across rounds; the
training transform ``"crop_jitter_gray"`` (:mod:`fedlab_core.data.transforms`) is the code's Digits image
augmentation. The code's scoring, each client's test accuracy at its best round on a validation split, is
the verdicts' ``BEST_VALIDATION`` score of a run with ``RunConfig.validation_monitor``. Not reproduced: its
Digits generator distance (L2 to the prototypes in place of MMD), PACS's RTNet distance (L2), and real
features recomputed in eval mode after the model step.

The RTNet's loss (Eq. 6) is read with Eq. 3's lam, on ``u + lam m(G(z, y))`` (the paper, default). The authors'
code trains the RTNet on the unscaled residual, ``u + m(G(z, y))`` (lam = 1), and applies lam only to what the head
trains on: ``rt_full=True``. The difference matters: a RTNet trained on ``u + lam m`` learns a residual about
1/lam too large while lam is small, which the rising schedule then releases at full strength onto the head.

Switches for the paper's Table 3 ablation: ``rtnet=False`` ("generator only": the head trains on the
client-agnostic embeddings ``v_hat = G(z, y)`` themselves in place of ``u_hat`` and ``u_hat_c``, as the
paper's text describes the row and as the code runs it with ``use_FTNet=False``), ``prototypes=False`` (no
``u_hat_c``), ``smoothing=False`` (``lam = 1``).

Local training as the authors' code runs Digits: SGD, lr 0.01, momentum 0.5, 20 local steps of batch 64.
Each client predicts with its own model (shared weights, its batch norm); synthetic embeddings are never
used at test time. There is no global model (``global_model`` False). Each upload's diagnostic
``mmd_real_synthetic`` (for the log, not counted as communication) is the mean MMD between ``u_hat`` and
``u`` over the client's stage-2 steps.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..params import OneOf, Range
from .base import FlatState, Message, Training, weighted_mean
from .fedbn import FedBN

VARIANTS = ("paper", "code")


def mmd(x: torch.Tensor, y: torch.Tensor, kernels: int = 5, mul: float = 2.0) -> torch.Tensor:
    """Squared maximum mean discrepancy between samples x (n, D) and y (m, D), biased estimate, with the sum
    of `kernels` Gaussian kernels ``exp(-d^2 / b_i)``, ``b_i = b0 mul^i``, ``b0`` the mean squared distance
    between distinct points of the pooled sample divided by ``mul^(kernels // 2)`` (not differentiated)."""
    z = torch.cat([x, y])
    d2 = torch.cdist(z, z).pow(2)  # (n + m, n + m)
    n = len(z)
    base = (d2.detach().sum() / max(n * n - n, 1)).clamp_min(1e-12) / mul ** (kernels // 2)
    k = sum(torch.exp(-d2 / (base * mul ** i)) for i in range(kernels))
    nx = len(x)
    return k[:nx, :nx].mean() + k[nx:, nx:].mean() - 2 * k[:nx, nx:].mean()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean entropy of the softmax of logits (B, classes)."""
    logp = logits.log_softmax(1)
    return -(logp.exp() * logp).sum(1).mean()


class Generator(nn.Module):
    """G(z, y): noise and a one-hot class to a client-agnostic embedding of the feature size."""

    def __init__(self, latent: int, num_classes: int, feature_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.net = nn.Sequential(nn.Linear(latent + num_classes, feature_dim), nn.BatchNorm1d(feature_dim), nn.ReLU(),
                                 nn.Linear(feature_dim, feature_dim), nn.BatchNorm1d(feature_dim), nn.ReLU())

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, F.one_hot(y, self.num_classes).float()], 1))  # (B, F)


class RTNet(nn.Module):
    """m(v, y): a client's map from the generator's embedding (and its class) to a residual of the feature size."""

    def __init__(self, latent: int, num_classes: int, feature_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.net = nn.Sequential(nn.Linear(feature_dim + num_classes, latent), nn.BatchNorm1d(latent), nn.ReLU(),
                                 nn.Linear(latent, feature_dim), nn.BatchNorm1d(feature_dim))

    def forward(self, v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([v, F.one_hot(y, self.num_classes).float()], 1))  # (B, F)


class FRAug(FedBN):
    """FedBN plus synthetic embeddings from a shared generator and a local RTNet.

    Parameters
    ----------
    training : the model's local training (default: the authors' code on Digits, see the module doc).
    alpha : weight of the MMD the generator maximises (Eq. 5; the code's Digits value, 1).
    beta : weight of the MMD the RTNet minimises (Eq. 6; the code searches 0.1, 1 and 10 on Digits).
    latent : size of the generator's noise and of the RTNet's hidden layer (0: half the feature size, the
        code's default).
    aux_lr : SGD learning rate of the generator and the RTNet (momentum 0.5, as the code's).
    gamma : rate of the exponential schedule (the code: 0.01 on PACS and OfficeHome, 0.002 on Digits).
    ramp_rounds : the schedule as over this many rounds, whatever the run's (the code's 300); 0: unscaled.
    variant : "paper" or "code" (see the module doc).
    smoothing : scale the residuals by the schedule's lam (Eq. 3); False: ``lam = 1``.
    rtnet : False: the head trains on the generator's output itself (Table 3's "generator only").
    prototypes : False: no prototype-anchored embeddings u_hat_c.
    ema : the prototypes' rate, proto <- (1 - ema) proto + ema batch mean (the code: 0.3).
    loss_weights : (real, synthetic, prototype-synthetic) weights of the model's loss; None: the variant's
        (paper 1 : 1 : 1; code (1 - Lr) : Lr / 2 : Lr / 2).
    keep_optimizer : keep the SGD momentum of the model, G and RTNet on the client across rounds.
    rt_full : train the RTNet on the unscaled residual (lam = 1, the code); False: on Eq. 3's ``u + lam m`` (the
        paper).
    """

    name = "fraug"
    shares = ("the shared generator's weights, every round "
              "(its RTNet and class prototypes stay on the client)")
    paper_training = Training(lr=0.01, momentum=0.5, batch_size=64, local_steps=20)  # the authors' code, Digits
    constraints = {"alpha": Range(0), "beta": Range(0), "latent": Range(0), "aux_lr": Range(0, low_open=True),
                   "gamma": Range(0), "variant": OneOf(*VARIANTS), "ema": Range(0, 1), "ramp_rounds": Range(0),
                   "loss_weights": Range(0)}

    def __init__(self, training: Training | None = None, alpha: float = 1.0, beta: float = 1.0, latent: int = 0,
                 aux_lr: float = 0.05, gamma: float = 0.01, variant: str = "paper", smoothing: bool = True,
                 rtnet: bool = True, prototypes: bool = True, ema: float = 0.3, ramp_rounds: int = 300,
                 loss_weights: tuple[float, float, float] | None = None, keep_optimizer: bool = False,
                 rt_full: bool = False):
        super().__init__(training)
        self.alpha, self.beta, self.latent, self.aux_lr, self.gamma = alpha, beta, latent, aux_lr, gamma
        self.variant, self.smoothing, self.use_rtnet, self.use_prototypes, self.ema = (
            variant, smoothing, rtnet, prototypes, ema)
        self.ramp_rounds, self.loss_weights, self.keep_optimizer = ramp_rounds, loss_weights, keep_optimizer
        self.rt_full = rt_full
        self._momentum = None  # the client's momentum buffers while it trains under keep_optimizer

    # ------------------------------------------------------------------ protocol

    def init(self, model: nn.Module, federation) -> dict[str, Any]:
        server = super().init(model, federation)
        c, d = federation.num_classes, model.feature_dim
        self.width = self.latent or max(1, d // 2)
        self.generator = Generator(self.width, c, d).to(self.device)
        self.gen_state = FlatState(self.generator)
        self.rt_seed = int(torch.randint(2 ** 62, (1,)))  # from the run's seeded initialisation stream
        self.rtnet = self.new_rtnet(0)
        self.rt_state = FlatState(self.rtnet)
        return {**server, "generator": self.gen_state.get(), "round": 0}

    def new_rtnet(self, cid: int) -> RTNet:
        """Client `cid`'s RTNet as it starts: its own random weights, the same in every run of the seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.rt_seed + cid)
            return RTNet(self.width, self.federation.num_classes, self.model.feature_dim).to(self.device)

    def init_client(self, cid: int) -> dict[str, Any]:
        protos = torch.zeros(self.federation.num_classes, self.model.feature_dim, device=self.device)  # (C, F)
        return {**super().init_client(cid), "rtnet": FlatState(self.new_rtnet(cid)).get(), "prototypes": protos}

    def server_message(self, server_state: dict[str, Any], cid: int) -> Message:
        # the round number drives the schedule (8 bytes, counted as a metric)
        return Message({"weights": server_state["weights"], "generator": server_state["generator"]},
                       metrics={"round": server_state["round"] + 1})

    def local_update(self, message: Message, client_state: dict[str, Any], data, rng: torch.Generator):
        self.gen_state.set(message.tensors["generator"])
        self.rt_state.set(client_state["rtnet"])
        self._prototypes = client_state["prototypes"].clone()
        self._lam, *self._loss_weights = self.weights(int(message.metrics["round"]))
        self._aux_opt = torch.optim.SGD([*self.generator.parameters(), *self.rtnet.parameters()], lr=self.aux_lr,
                                        momentum=0.5)
        self._rng, self._mmd, self._momentum = rng, [], client_state.get("momentum") if self.keep_optimizer else None
        if self._momentum is not None:
            set_momentum(self._aux_opt, self._momentum["aux"])
        upload, client_state = super().local_update(message, client_state, data, rng)
        client_state["rtnet"], client_state["prototypes"] = self.rt_state.get(), self._prototypes
        if self.keep_optimizer:
            client_state["momentum"] = {"model": momentum(self._model_opt), "aux": momentum(self._aux_opt)}
        upload.tensors["generator"] = self.gen_state.get()
        upload.diagnostics["mmd_real_synthetic"] = sum(self._mmd) / max(len(self._mmd), 1)
        return upload, client_state

    def aggregate(self, server_state: dict[str, Any], uploads: list[tuple[int, Message]],
                  round_idx: int) -> dict[str, Any]:
        server = super().aggregate(server_state, uploads, round_idx)
        generator = weighted_mean([m.tensors["generator"] for _, m in uploads], [m.num_samples for _, m in uploads])
        return {**server, "generator": generator, "round": round_idx}

    @torch.no_grad()
    def samples(self, server_state: dict[str, Any], client_state: dict[str, Any], x: torch.Tensor, y: torch.Tensor,
                seed: int = 0) -> dict[str, torch.Tensor]:
        """What a client's networks make of a batch, for pictures: its real embeddings ``u = f(x)``, the
        generator's ``v_hat = G(z, y)`` and the transformed ``u_hat = u + lam m(v_hat, y)`` (lam of the last
        round trained; without RTNet, ``v_hat`` itself), each (B, F), every network in eval mode, the noise from `seed`."""
        self.load(server_state["weights"], client_state)
        self.gen_state.set(server_state["generator"])
        self.rt_state.set(client_state["rtnet"])
        for net in (self.model, self.generator, self.rtnet):
            net.eval()
        self._rng = torch.Generator().manual_seed(seed)
        u = self.model.features(x)
        v = self.generator(self.draw(len(y)), y)
        lam = self.weights(max(1, int(server_state["round"])))[0]
        return {"real": u, "generated": v, "transformed": u + lam * self.rtnet(v, y) if self.use_rtnet else v}

    @torch.no_grad()
    def synthetic_statistics(self, server_state: dict[str, Any], client_state: dict[str, Any], x: torch.Tensor,
                             y: torch.Tensor, seed: int = 0) -> dict[str, float]:
        """How a client's synthetic embeddings ``u_hat`` (:meth:`samples`, of a batch x (B, ...), y (B,)) sit
        against its real ones ``u``, what its head trains on: the mean norms of ``u`` (``real norm``) and of the
        offset ``u_hat - u`` (``offset norm``: ``lam m(v_hat, y)``; without RTNet ``v_hat - u``), their mean cosine
        (``cosine``), and the head's accuracy on ``u`` (``head on real``) and on ``u_hat`` (``head on
        synthetic``; below chance: the offsets point the head away from the class they are labelled with)."""
        made = self.samples(server_state, client_state, x, y, seed)
        u, offset, head = made["real"], made["transformed"] - made["real"], self.model.head
        accuracy = lambda e: float((head(e).argmax(1) == y).float().mean())
        return {"real norm": float(u.norm(dim=1).mean()), "offset norm": float(offset.norm(dim=1).mean()),
                "cosine": float(F.cosine_similarity(u, offset).mean()), "head on real": accuracy(u),
                "head on synthetic": accuracy(made["transformed"])}

    # ------------------------------------------------------------------ building blocks

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """The model's optimiser, with the client's momentum of its last round under ``keep_optimizer``."""
        self._model_opt = super().make_optimizer(params)
        if self._momentum is not None:
            set_momentum(self._model_opt, self._momentum["model"])
        return self._model_opt

    def weights(self, round_idx: int) -> tuple[float, float, float, float]:
        """(lam, w_real, w_syn, w_proto) in round `round_idx` of R: the residuals' scale (Eq. 3) and the
        weights of the real, synthetic and prototype-synthetic cross-entropies in the model's loss."""
        scale = self.ramp_rounds / self.num_rounds if self.ramp_rounds else 1.0
        ramp = math.exp(self.gamma * scale * (round_idx - self.num_rounds))
        lam = ramp if self.smoothing else 1.0
        if self.loss_weights is not None:
            return (lam, *map(float, self.loss_weights))
        if self.variant == "code":
            share = min(0.5, ramp)
            return lam, 1.0 - share, share / 2, share / 2
        return lam, 1.0, 1.0, 1.0

    def draw(self, n: int) -> torch.Tensor:
        """Noise z (n, latent) from the client's stream: N(0, I) ("paper") or U[0, 1) ("code")."""
        shape = (n, self.width)
        draw = torch.randn if self.variant == "paper" else torch.rand
        return draw(shape, generator=self._rng).to(self.device)

    def synthetic(self, u: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The synthetic embeddings of one step (Eq. 3), as {"v": G(z, y) (B, F), "u_hat": around the real
        embeddings u (B, F)} plus, with prototypes, {"y_c": class-balanced labels (B,), "anchor_c": their
        prototypes (B, F), "u_hat_c": around them (B, F)}."""
        v = self.generator(self.draw(len(y)), y)
        out = {"v": v, "u_hat": v}
        if self.use_rtnet:
            out["r"] = self.rtnet(v, y)  # the residual before the schedule's scale
            out["u_hat"] = u + self._lam * out["r"]
        if self.use_prototypes:
            c = self.federation.num_classes
            start = int(torch.randint(c, (1,), generator=self._rng))
            y_c = (start + torch.arange(len(y), device=self.device)) % c  # every class in turn
            v_c = self.generator(self.draw(len(y)), y_c)
            anchor = self._prototypes[y_c]
            out.update(y_c=y_c, anchor_c=anchor, u_hat_c=v_c)
            if self.use_rtnet:
                out["r_c"] = self.rtnet(v_c, y_c)
                out["u_hat_c"] = anchor + self._lam * out["r_c"]
        return out

    def train_step(self, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer,
                   client_state: dict[str, Any]) -> torch.Tensor:
        loss, u = self.model_step(x, y, opt)
        self.auxiliary_step(u, y)
        return loss

    def model_step(self, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 1: update the prototypes, then one step of the model on ``w_real L_real + w_syn L_syn`` with G
        and RTNet fixed (eval mode, as the code); the synthetic loss reaches the head only. Returns the loss
        and the batch's embeddings u (B, F), detached."""
        head = self.model.head
        opt.zero_grad(set_to_none=True)
        u = self.model.features(x)  # (B, F)
        real = F.cross_entropy(head(u), y)
        with torch.no_grad():  # the prototypes: an EMA of the batch's class means, for the classes it holds
            counts = torch.bincount(y, minlength=len(self._prototypes)).unsqueeze(1)  # (C, 1)
            means = torch.zeros_like(self._prototypes).index_add_(0, y, u) / counts.clamp_min(1)  # (C, F)
            rate = self.ema * (counts > 0)  # 0 for the classes the batch lacks: they keep their prototype
            self._prototypes.mul_(1 - rate).add_(rate * means)
        self.generator.eval(), self.rtnet.eval()
        with torch.no_grad():
            s = self.synthetic(u.detach(), y)
        w_real, w_syn, w_proto = self._loss_weights
        loss = w_real * real + w_syn * F.cross_entropy(head(s["u_hat"]), y)
        if self.use_prototypes:
            loss = loss + w_proto * F.cross_entropy(head(s["u_hat_c"]), s["y_c"])
        loss.backward()
        opt.step()
        return loss.detach(), u.detach()

    def auxiliary_step(self, u: torch.Tensor, y: torch.Tensor) -> None:
        """Stage 2: one step of G on Eq. 5 and of RTNet on Eq. 6, each on the gradient of its own loss, with the
        model fixed; u (B, F) are the batch's real embeddings."""
        head = self.model.head
        self.generator.train(), self.rtnet.train()
        head.requires_grad_(False)
        try:
            s = self.synthetic(u, y)
            logits = head(s["u_hat"])
            gap = mmd(s["u_hat"], u)
            if self.variant == "paper":
                gen_loss = F.cross_entropy(logits, y) - self.alpha * gap
            else:  # the code scores the generator's own output
                gen_loss = F.cross_entropy(head(s["v"]), y) - self.alpha * mmd(s["v"], u)
            params = list(self.generator.parameters())
            grads = list(torch.autograd.grad(gen_loss, params, retain_graph=self.use_rtnet))
            if self.use_rtnet:
                if self.rt_full:   # the code: the RTNet learns the full residual; lam scales only what the head sees
                    u_rt = u + s["r"]
                    rt_loss = -entropy(head(u_rt)) + self.beta * mmd(u_rt, u)
                else:              # the paper: Eq. 6 on Eq. 3's u_hat
                    rt_loss = -entropy(logits) + self.beta * gap
                if self.use_prototypes:
                    uc_rt = s["anchor_c"] + s["r_c"] if self.rt_full else s["u_hat_c"]
                    rt_loss = rt_loss - entropy(head(uc_rt)) + self.beta * mmd(uc_rt, s["anchor_c"])
                rt_params = list(self.rtnet.parameters())
                params += rt_params
                grads += torch.autograd.grad(rt_loss, rt_params)
        finally:
            head.requires_grad_(True)
        self._aux_opt.zero_grad(set_to_none=True)
        for p, g in zip(params, grads):
            p.grad = g
        self._aux_opt.step()
        self._mmd.append(float(gap.detach()))


def momentum(opt: torch.optim.SGD) -> torch.Tensor:
    """The SGD momentum buffers of every parameter of `opt`, flattened into one vector (zeros before a step)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    buffers = [opt.state[p].get("momentum_buffer") for p in params]   # None (or absent) before a step
    return torch.cat([(torch.zeros_like(p) if b is None else b).flatten() for p, b in zip(params, buffers)])


def set_momentum(opt: torch.optim.SGD, flat: torch.Tensor) -> None:
    """Give `opt` the momentum buffers of :func:`momentum`, as if it had stepped before."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for p, buffer in zip(params, flat.split([p.numel() for p in params])):
        opt.state[p]["momentum_buffer"] = buffer.view_as(p).clone()


# ------------------------------------------------------------------ what the chapter's figures read

def statistics_at_end(sim, state) -> list[dict[str, float]]:
    """Each client's :meth:`FRAug.synthetic_statistics` on its own training images after a run's last round
    (`state` its final state, `sim` its simulation), the noise from the client's id: what the chapter's table of
    the synthetic embeddings reads, stored by :func:`fedlab_core.runs.measured` (sources
    :data:`STATISTICS_SOURCES`) in place of the final state."""
    return [sim.algorithm.synthetic_statistics(state.server, state.clients[cid], client.x_train, client.y_train,
                                               seed=cid)
            for cid, client in enumerate(sim.federation.clients)]


def embedding_map(sim, state, per_client: int) -> dict[str, Any]:
    """What the chapter's picture of the embeddings draws, measured on a run's final `state`: the real, generated
    and transformed embeddings (:meth:`FRAug.samples`) of each client's first `per_client` training images, under
    one UMAP (:func:`~fedlab_core.viz.umap_embedding`, seed 0) as 2-D points per kind rounded to 1e-3, the
    client and class of each image, and per kind the silhouette of the clients
    (:func:`~fedlab_core.viz.class_separation`, on the unrounded points). Sources: :data:`MAP_SOURCES`."""
    import numpy as np

    from ..viz import class_separation, umap_embedding

    kinds = ("real", "generated", "transformed")
    points, owners, labels = {k: [] for k in kinds}, [], []
    for cid, client in enumerate(sim.federation.clients):
        x, y = client.x_train[:per_client], client.y_train[:per_client]
        made = sim.algorithm.samples(state.server, state.clients[cid], x, y, seed=cid)
        for k in kinds:
            points[k].append(made[k].numpy())
        owners += [cid] * len(y)
        labels += y.tolist()
    flat = np.concatenate([np.concatenate(points[k]) for k in kinds])
    xy = umap_embedding(flat, seed=0).reshape(len(kinds), -1, 2)
    return {"xy": {k: np.round(pts.astype(np.float64), 3).tolist() for k, pts in zip(kinds, xy)},
            "owners": owners, "labels": labels,
            "separation": {k: class_separation(pts, np.array(owners)) for k, pts in zip(kinds, xy)}}


STATISTICS_SOURCES = ("algorithms/fraug.py::statistics_at_end", "algorithms/fraug.py::FRAug.synthetic_statistics",
                      "algorithms/fraug.py::FRAug.samples")
MAP_SOURCES = ("algorithms/fraug.py::embedding_map", "algorithms/fraug.py::FRAug.samples", "viz.py::umap_embedding",
               "viz.py::class_separation")
