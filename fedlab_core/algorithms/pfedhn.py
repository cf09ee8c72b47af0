"""pFedHN (Shamsian, Navon, Fetaya and Chechik, "Personalized Federated Learning using Hypernetworks",
ICML 2021): the server holds a hypernetwork h(v_i; phi) and one embedding v_i per client, and sends
client i the weights theta_i = h(v_i; phi) of its personal model. The client trains theta_i locally and
uploads delta_i = theta_i_trained - theta_i; the server takes one optimiser step per upload on phi and
v_i with the gradient ``(d theta_i / d (phi, v_i))^T (-delta_i)`` (the paper's Eq. 4 update).

How it differs from FedAvg
--------------------------
- The server state is the hypernetwork's weights and its optimiser state (``state_dict()`` dicts), not
  a global model; the hypernetwork itself is an ``nn.Module`` kept on the algorithm instance.
- It generates every floating-point *parameter* of the workspace model. Floating-point *buffers*
  (batch-norm running statistics) are not generated: they keep FedAvg's behaviour (sent down, trained,
  averaged by sample count), so the global prediction has statistics too. The paper's models have none.
- ``predict`` uses client i's h(v_i). There is no global model (the paper defines none): the global test
  set is not scored (``global_model`` False).

Defaults (the authors' code, github AvivSham/pFedHN, ``experiments/pfedhn/trainer.py``)
------------------------------------------------------------------------------------
embedding dim ``int(1 + num_clients / 4)``; MLP ``Linear(embed, 100)`` then 3 x (ReLU, Linear(100, 100));
one linear output layer per target parameter, here one ``Linear(100, P)`` whose rows are those layers
stacked (the same function and the same initialisation); embeddings ~ N(0, 1) (``nn.Embedding``).
Server optimiser SGD lr 1e-2, momentum 0.9, weight decay 1e-3 (or Adam lr 1e-2, no decay), the
hypernetwork gradient clipped to norm 50. Client: 50 local steps of batch 64, SGD lr 5e-3, momentum 0.9,
weight decay 5e-5 (the ``Training`` used when none is given). The client's gradient is clipped to norm
50 as in the code (``client_grad_clip``); without it, one-class clients at lr 0.05 diverged here.

The output layer has ``100 x P`` weights: fine for the paper's small CNNs, the MLP and LeNet-5, but
for large target models (the FedBN digit CNN, AlexNet) it is the method's known memory cost.
The hypernetwork is initialised from torch's global generator, which the run seeds for model
initialisation (deterministic per run seed).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..data.federation import ClientData, Federation
from ..params import Range, OneOf
from .base import Algorithm, FlatState, Message, Training, weighted_mean


class HyperNetwork(nn.Module):
    """Client embeddings and an MLP that maps an embedding to a flat vector of target weights.

    Parameters
    ----------
    num_clients : number of embeddings.
    out_size : P, the number of generated target weights.
    embed_dim, hidden_dim, hn_layers : embedding size, MLP width, number of hidden (ReLU, Linear) blocks.
    """

    def __init__(self, num_clients: int, out_size: int, embed_dim: int, hidden_dim: int = 100, hn_layers: int = 3):
        super().__init__()
        self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden_dim)]
        for _ in range(hn_layers):
            layers += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(hidden_dim, out_size)

    def embedding(self, cid: int) -> torch.Tensor:
        """v_cid, (embed_dim,)."""
        return self.embeddings.weight[cid]

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(v))  # (embed_dim,) -> (P,)


class PFedHN(Algorithm):
    """Personalised federated learning with a server-side hypernetwork.

    Parameters
    ----------
    training : local training (default: the paper's 50 steps of batch 64, SGD lr 5e-3, momentum 0.9,
        weight decay 5e-5).
    embed_dim : client embedding size; 0 means ``int(1 + num_clients / 4)``.
    hidden_dim : width of the hypernetwork's MLP.
    hn_layers : number of hidden (ReLU, Linear) blocks after the first layer.
    server_optimizer : "sgd" or "adam".
    server_lr, server_momentum, server_weight_decay : the server optimiser's settings (momentum and
        weight decay are SGD's).
    grad_clip : clip the hypernetwork gradient to this norm (0: no clipping).
    client_grad_clip : clip the client's gradient to this norm in every local step (0: no clipping).
    """

    name = "pfedhn"
    batched = True
    paper_training = Training(local_steps=50, batch_size=64, lr=5e-3, momentum=0.9, weight_decay=5e-5)
    global_model = False  # a personal model per client; the mean-embedding model is ours, not the paper's
    constraints = {"embed_dim": Range(0), "hidden_dim": Range(1), "hn_layers": Range(0),
                   "server_optimizer": OneOf("sgd", "adam"), "server_lr": Range(0, low_open=True),
                   "server_momentum": Range(0, 1, high_open=True), "server_weight_decay": Range(0),
                   "grad_clip": Range(0), "client_grad_clip": Range(0)}

    def __init__(self, training: Training | None = None, embed_dim: int = 0, hidden_dim: int = 100,
                 hn_layers: int = 3, server_optimizer: str = "sgd", server_lr: float = 1e-2,
                 server_momentum: float = 0.9, server_weight_decay: float = 1e-3, grad_clip: float = 50.0,
                 client_grad_clip: float = 50.0):
        super().__init__(training)
        self.embed_dim, self.hidden_dim, self.hn_layers = embed_dim, hidden_dim, hn_layers
        self.server_optimizer, self.server_lr = server_optimizer, server_lr
        self.server_momentum, self.server_weight_decay = server_momentum, server_weight_decay
        self.grad_clip, self.client_grad_clip = grad_clip, client_grad_clip

    # ------------------------------------------------------------------ protocol

    def init(self, model: nn.Module, federation: Federation) -> dict[str, Any]:
        super().init(model, federation)
        param_names = {n for n, _ in model.named_parameters()}
        self.params = FlatState(model, keep=lambda n: n in param_names)        # generated by h
        self.buffers = FlatState(model, keep=lambda n: n not in param_names)   # averaged as in FedAvg
        embed_dim = self.embed_dim or int(1 + federation.num_clients / 4)
        self.hnet = HyperNetwork(federation.num_clients, self.params.size, embed_dim, self.hidden_dim,
                                 self.hn_layers).to(self.device)
        if self.server_optimizer == "adam":
            self.opt = torch.optim.Adam(self.hnet.parameters(), lr=self.server_lr)
        else:
            self.opt = torch.optim.SGD(self.hnet.parameters(), lr=self.server_lr, momentum=self.server_momentum,
                                       weight_decay=self.server_weight_decay)
        return self._server_state()

    def init_client(self, cid: int) -> dict[str, Any]:
        return {"cid": cid}  # predict needs to know whose embedding to use

    def server_message(self, server_state: dict[str, Any], cid: int) -> Message:
        tensors = {"weights": self.generate(server_state, cid)}
        if self.buffers.size:
            tensors["buffers"] = server_state["buffers"]
        return Message(tensors)

    def start(self, message: Message, client_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The client's generated weights h(v_i) (and the averaged buffers) into the workspace model."""
        self._sent = message.tensors["weights"]  # (P,)
        self._load(self._sent, message.tensors.get("buffers"))
        return {}

    def finish(self, data: ClientData, loss: float, client_state: dict[str, Any]) -> tuple[Message, dict[str, Any]]:
        tensors = {"delta": self.params.get() - self._sent}  # (P,)
        if self.buffers.size:
            tensors["buffers"] = self.buffers.get()
        return Message(tensors, num_samples=data.num_train, metrics={"loss": loss}), client_state

    def aggregate(self, server_state: dict[str, Any], uploads: list[tuple[int, Message]],
                  round_idx: int) -> dict[str, Any]:
        self._load_server(server_state)
        self.hnet.train()
        for cid, m in uploads:  # one hypernetwork step per client, in client order
            self.opt.zero_grad(set_to_none=True)
            theta = self.hnet(self.hnet.embedding(cid))  # (P,)
            # vector-Jacobian product: d theta/d(phi, v_i)^T (theta_sent - theta_trained)
            theta.backward(-m.tensors["delta"].to(theta))
            if self.grad_clip:
                nn.utils.clip_grad_norm_(self.hnet.parameters(), self.grad_clip)
            self.opt.step()
        state = self._server_state()
        if self.buffers.size:
            state["buffers"] = weighted_mean([m.tensors["buffers"] for _, m in uploads],
                                             [m.num_samples for _, m in uploads])
        else:
            state["buffers"] = server_state["buffers"]
        return state

    @torch.no_grad()
    def predict(self, server_state: dict[str, Any], client_state: dict[str, Any] | None,
                x: torch.Tensor) -> torch.Tensor:
        """Logits of client i's personal model h(v_i) (there is no global model)."""
        self._load(self.generate(server_state, client_state["cid"]), server_state["buffers"])
        self.model.eval()
        return self.model(x)

    # ------------------------------------------------------------------ building blocks

    @torch.no_grad()
    def before_step(self, client_state: dict[str, Any]) -> None:
        params = {name: p for name, p in self.model.named_parameters() if p.grad is not None}
        for name, grad in self.correct({n: p.grad for n, p in params.items()}, params, {}).items():
            params[name].grad = grad

    def correct(self, grads, params, context):
        """The gradients clipped to a total norm of ``client_grad_clip``, as ``nn.utils.clip_grad_norm_`` clips
        them (its arithmetic, so its bits on a CPU)."""
        if not self.client_grad_clip or not grads:
            return grads
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads.values()]), 2.0)
        factor = torch.clamp(self.client_grad_clip / (total + 1e-6), max=1.0)
        return {name: g * factor for name, g in grads.items()}

    @torch.no_grad()
    def generate(self, server_state: dict[str, Any], cid: int) -> torch.Tensor:
        """The target weights h(v_cid) as a flat (P,) vector."""
        self._load_server(server_state, optimizer=False)
        return self.hnet(self.hnet.embedding(cid)).detach().clone()

    def _load(self, weights: torch.Tensor, buffers: torch.Tensor | None) -> None:
        self.params.set(weights)
        if self.buffers.size and buffers is not None:
            self.buffers.set(buffers)

    def _load_server(self, server_state: dict[str, Any], optimizer: bool = True) -> None:
        self.hnet.load_state_dict(server_state["hnet"])
        if optimizer:
            # deep copies both ways: the optimiser updates its buffers in place, saved states must not move
            self.opt.load_state_dict(copy.deepcopy(server_state["optimizer"]))

    def _server_state(self) -> dict[str, Any]:
        return {"hnet": {k: v.detach().clone() for k, v in self.hnet.state_dict().items()},
                "optimizer": copy.deepcopy(self.opt.state_dict()),
                "buffers": self.buffers.get().to(self.device)}
