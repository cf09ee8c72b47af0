"""DisTrans' communication overhead (the paper's Table 7): the function against hand counts and against the
bytes the engine moves; and the ResNet-50 builder it uses."""
import copy

import pytest
import torch
import torchvision
from torch import nn

from fedlab_core import RunConfig
from fedlab_core.algorithms.distrans import communication_overhead
from fedlab_core.models import ResNet50, build_model, count_parameters, state_nbytes
from fedlab_core.runs import run


class TinyCNN(nn.Module):
    """conv(2->3, k3) + batch norm + Linear(3*4*4 -> 5) features, Linear(5 -> 4) head, for 2x4x4 inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
        self.fc = nn.Linear(3 * 4 * 4, 5)
        self.feature_dim = 5
        self.head = nn.Linear(5, 4)

    def features(self, x):
        return torch.relu(self.fc(self.conv(x).flatten(1)))  # (B, 5)

    def forward(self, x):
        return self.head(self.features(x))


def test_overhead_of_a_small_backbone_equals_a_hand_count():
    backbone = TinyCNN()
    before = copy.deepcopy(backbone.state_dict())
    out = communication_overhead(backbone, (2, 4, 4))
    # by hand: conv 2*3*9 + 3, bn weight/bias + running mean/var 4*3, fc 48*5 + 5, head 5*4 + 4 (float32)
    single = (54 + 3) + 4 * 3 + (240 + 5) + (20 + 4)
    assert out["single_bytes"] == 4 * single == state_nbytes(backbone)
    assert out["double_bytes"] - out["single_bytes"] == 4 * 5 * 4        # the logits layer reads 2 x 5 features
    assert out["double_parameters"] - out["single_parameters"] == 5 * 4
    assert out["single_parameters"] == single - 2 * 3                     # running statistics are not parameters
    assert out["offset_bytes"] == 2 * 4 * 4 * 4                           # C*H*W float32
    assert out["extra_bytes"] == 80 + 128
    assert out["overhead"] == pytest.approx(208 / (4 * single))
    # the backbone is left as it was: same head, same state
    assert backbone.head.in_features == 5
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items())


def test_dense_head_adds_a_linear_layer_and_serialized_sizes_are_reported():
    out = communication_overhead(TinyCNN(), (2, 4, 4), head="dense", serialized=True)
    assert out["double_bytes"] - out["single_bytes"] == 4 * (10 * 5 + 5)  # Linear(2D, D); the head keeps D inputs
    assert out["single_file_bytes"] > out["single_bytes"]                  # a file adds names and headers
    assert out["double_file_bytes"] > out["single_file_bytes"]


def test_resnet18_at_64x64_rgb_adds_512_x_10_weights_and_a_12288_float_offset():
    out = communication_overhead(build_model("resnet18", (3, 64, 64), 10), (3, 64, 64))
    assert out["double_bytes"] - out["single_bytes"] == 512 * 10 * 4
    assert out["offset_bytes"] == 3 * 64 * 64 * 4 == 49_152
    # torchvision's ResNet-18 with 10 classes: 11,181,642 parameters plus 9,600 running statistics
    assert out["single_parameters"] == 11_181_642
    assert out["single_bytes"] == 4 * (11_181_642 + 9_600)


def test_resnet50_is_torchvisions_architecture_split_into_features_and_head():
    torch.manual_seed(0)
    model = build_model("resnet50", (3, 64, 64), 10)
    assert isinstance(model, ResNet50) and model.feature_dim == 2048
    reference = torchvision.models.resnet50(weights=None, num_classes=10)
    assert count_parameters(model) == count_parameters(reference) == 23_528_522
    assert state_nbytes(model) == state_nbytes(reference)
    model.eval()
    x = torch.rand(2, 3, 64, 64)
    z = model.features(x)
    assert z.shape == (2, 2048)
    assert torch.allclose(model(x), model.head(z))
    reference.load_state_dict({k.replace("head.", "fc."): v for k, v in model.state_dict().items()})
    assert torch.allclose(model(x), reference.eval()(x), atol=1e-5)   # same layers, same order
    gray = build_model("resnet50", (1, 32, 32), 7)
    assert gray(torch.rand(2, 1, 32, 32)).shape == (2, 7)
    out = communication_overhead(model, (3, 64, 64))
    assert out["double_bytes"] - out["single_bytes"] == 2048 * 10 * 4


def test_the_engine_moves_the_bytes_the_function_predicts():
    """Round 2 uploads: DisTrans (none) - FedAvg = the wider head; avg - none = the offset, per client."""
    base = RunConfig(dataset="digits", model="mlp", partition="iid", num_clients=3, num_rounds=2, lr=0.1, seed=0)
    up = {}
    for name, changes in {"fedavg": {}, "none": {"aggregation": "none"}, "avg": {"aggregation": "avg"},
                          "nn": {"aggregation": "nn"}}.items():
        config = base if name == "fedavg" else base.replace(algorithm="distrans", algorithm_params=changes)
        up[name] = run(config, use_cache=False, progress=False).rounds[1]["bytes_up"] / base.num_clients
    out = communication_overhead(build_model("mlp", (1, 8, 8), 10), (1, 8, 8))
    assert up["none"] - up["fedavg"] == out["double_bytes"] - out["single_bytes"] == 64 * 10 * 4
    assert up["avg"] - up["none"] == out["offset_bytes"] == 8 * 8 * 4
    assert up["nn"] - up["avg"] == 10 * 4                                   # nn also uploads the class counts
