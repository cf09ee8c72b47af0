"""Lab 2's checks accept FedAvg's aggregate and FedProx written against the protocol, and reject the common
mistakes: an unweighted mean, a lost server state, and a proximal term with the wrong sign, strength or anchor."""
import pytest
import torch

from fedlab_core.algorithms import Algorithm, FedAvg, FedProx
from fedlab_core.labs import LabCheckError
from fedlab_core.labs import fedprox as checks


class Prox(Algorithm):
    """FedProx as the lab asks for it: an anchor per parameter, a gradient term scaled by `scale`."""
    scale = 1.0

    def __init__(self, training=None, mu=1.0):
        super().__init__(training)
        self.mu = mu

    def local_update(self, message, client_state, data, rng):
        self.load(message.tensors["weights"], client_state)
        self.anchors = [p.detach().clone() for p in self.model.parameters()]
        return super().local_update(message, client_state, data, rng)

    @torch.no_grad()
    def before_step(self, client_state):
        for p, anchor in zip(self.model.parameters(), self.anchors):
            p.grad.add_(p - anchor, alpha=self.scale * self.mu)


def test_correct_answers_pass(capsys):
    checks.check_aggregate(FedAvg)
    checks.check_fedprox(Prox)
    checks.check_fedprox(FedProx)
    assert capsys.readouterr().out.count("✔") == 3


class Unweighted(Algorithm):
    def aggregate(self, server_state, uploads, round_idx):
        return {**server_state, "weights": torch.stack([m.tensors["weights"] for _, m in uploads]).mean(0)}


class LosesState(Algorithm):
    def aggregate(self, server_state, uploads, round_idx):
        return {"weights": FedAvg.aggregate(self, server_state, uploads, round_idx)["weights"]}


@pytest.mark.parametrize("wrong, message", [(Unweighted, "weighted by its number of samples"),
                                            (LosesState, "other entries")])
def test_aggregate_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_aggregate(wrong)


class WrongSign(Prox):
    scale = -1.0


class TwiceTooStrong(Prox):
    scale = 2.0


class StaleAnchor(Prox):
    def local_update(self, message, client_state, data, rng):
        self.load(message.tensors["weights"], client_state)
        if not hasattr(self, "anchors"):
            self.anchors = [p.detach().clone() for p in self.model.parameters()]
        return Algorithm.local_update(self, message, client_state, data, rng)


class CurrentWeightsAsAnchor(Prox):
    @torch.no_grad()
    def before_step(self, client_state):
        self.anchors = [p.detach().clone() for p in self.model.parameters()]
        super().before_step(client_state)


class AlwaysOn(Prox):
    """Forgets mu: a fixed pull even when mu = 0."""
    @torch.no_grad()
    def before_step(self, client_state):
        for p, anchor in zip(self.model.parameters(), self.anchors):
            p.grad.add_(p - anchor, alpha=0.5)


@pytest.mark.parametrize("wrong, message", [
    (WrongSign, "points away"), (TwiceTooStrong, "too strong"), (StaleAnchor, "second"),
    (CurrentWeightsAsAnchor, "too weak"), (AlwaysOn, "mu = 0")])
def test_fedprox_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_fedprox(wrong)
