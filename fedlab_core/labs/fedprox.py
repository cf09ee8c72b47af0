"""Checks for Lab 2, an algorithm as a difference from FedAvg: FedAvg's aggregate and FedProx's proximal term.

FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017) averages the clients' weights weighted by their numbers of samples; FedProx (Li et al.,
"Federated Optimization in Heterogeneous Networks", MLSys 2020) adds ``mu/2 ||w - w_global||^2`` to each
client's local objective, ``w_global`` being the weights the client received this round. The student writes
both against the algorithm protocol of :mod:`fedlab_core.algorithms.base`; the checks run them on
hand-made uploads and on real local updates, against :class:`~fedlab_core.algorithms.FedAvg` and
:class:`~fedlab_core.algorithms.FedProx`.
"""
from __future__ import annotations

import torch

from ..algorithms import FedAvg, FedProx, Message, Training
from ..runs import RunConfig, build
from . import LabCheckError, close, passed, require

TRAINING = Training(lr=0.1, batch_size=16, local_epochs=2)


def check_aggregate(algorithm_class: type) -> None:
    """`algorithm_class().aggregate(server_state, uploads, round_idx)` must be FedAvg's sample-weighted mean,
    returning the whole server state with new ``"weights"``."""
    server = {"weights": torch.zeros(2), "round_note": "kept"}
    uploads = [(0, Message({"weights": torch.tensor([1.0, 2.0])}, num_samples=1)),
               (3, Message({"weights": torch.tensor([4.0, 8.0])}, num_samples=2))]
    new = algorithm_class(training=TRAINING).aggregate(server, uploads, 1)
    require(isinstance(new, dict) and "weights" in new,
            "aggregate: return the new server state, a dict with the averaged 'weights'")
    require(new.get("round_note") == "kept", "aggregate: the other entries of the server state were lost; return "
                                             "{**server_state, 'weights': ...}")
    got = new["weights"]
    if torch.is_tensor(got) and torch.allclose(got, torch.tensor([2.5, 5.0])):
        raise LabCheckError("aggregate: [2.5, 5.0] is the plain mean of [1, 2] and [4, 8]; expected [3.0, 6.0], "
                            "each client weighted by its number of samples (1 and 2)")
    close(got, [3.0, 6.0], "aggregate of [1, 2] (1 sample) and [4, 8] (2 samples)")
    generator = torch.Generator().manual_seed(0)
    uploads = [(k, Message({"weights": torch.randn(7, generator=generator)}, num_samples=n))
               for k, n in enumerate((5, 1, 30, 12))]
    expected = FedAvg(TRAINING).aggregate({"weights": torch.zeros(7)}, uploads, 1)["weights"]
    close(algorithm_class(training=TRAINING).aggregate({"weights": torch.zeros(7)}, uploads, 1)["weights"], expected,
          "aggregate of four random uploads (5, 1, 30 and 12 samples)")
    passed("aggregate: the sample-weighted mean, and the rest of the server state kept")


def _workspace():
    """A model and a three-client federation of real 8x8 digits, for local updates that take milliseconds."""
    config = RunConfig(dataset="digits", model="mlp", num_clients=3, num_rounds=1, seed=0)
    sim = build(config, torch.device("cpu"))
    return sim.model, sim.federation


def _local_weights(algorithm, model, federation, weights: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Client 0's uploaded weights after one local update from the received `weights`."""
    algorithm.init(model, federation)
    upload, _ = algorithm.local_update(Message({"weights": weights.clone()}), algorithm.init_client(0),
                                       federation.clients[0], torch.Generator().manual_seed(seed))
    return upload.tensors["weights"]


def check_fedprox(algorithm_class: type) -> None:
    """`algorithm_class(training, mu)`'s local update: FedAvg's when mu = 0, the library's FedProx otherwise,
    with the anchor taken from each round's message (two rounds with different messages)."""
    model, federation = _workspace()
    start = FedAvg(TRAINING).init(model, federation)["weights"].clone()
    fedavg = _local_weights(FedAvg(TRAINING), model, federation, start)
    got = _local_weights(algorithm_class(training=TRAINING, mu=0.0), model, federation, start)
    require(torch.allclose(got, fedavg, atol=1e-5),
            "fedprox with mu = 0: the local update differs from FedAvg's; the proximal term must vanish when mu = 0 "
            "and nothing else may change")
    mu = 0.5
    shifted = start + 0.05 * torch.randn(start.shape, generator=torch.Generator().manual_seed(2))
    student = algorithm_class(training=TRAINING, mu=mu)
    for round_idx, weights in enumerate((start, shifted)):  # one object, two rounds with different messages
        expected = _local_weights(FedProx(TRAINING, mu=mu), model, federation, weights)
        got = _local_weights(student, model, federation, weights)
        if torch.allclose(got, expected, atol=1e-5):
            continue
        fresh = _local_weights(algorithm_class(training=TRAINING, mu=mu), model, federation, weights)
        if round_idx and torch.allclose(fresh, expected, atol=1e-5):
            raise LabCheckError("fedprox: right in the first round, wrong in the second; the anchor w_global must "
                                "be the weights received in this round's message, not an earlier round's")
        plain = _local_weights(FedAvg(TRAINING), model, federation, weights)
        moved, want, free = ((w - weights).norm().item() for w in (got, expected, plain))
        hint = ("the pull towards w_global is too weak or points away from it (check the sign)" if moved > want
                else "the pull towards w_global is too strong (the gradient of mu/2 ||w - w_global||^2 is "
                     "mu (w - w_global))")
        raise LabCheckError(f"fedprox with mu = {mu}: the local model moved {moved:.4f} from the weights it "
                            f"received, the library's FedProx {want:.4f} (FedAvg {free:.4f}); {hint}")
    passed("fedprox: FedAvg when mu = 0, FedProx's proximal pull towards each round's global weights otherwise")
