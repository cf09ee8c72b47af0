"""Tests for fedlab_core.models: shapes, the features/head split, parameter counts, BN state, weights loading."""
import pytest
import torch
import torch.nn as nn
import torchvision

from fedlab_core.models import (
    MODELS,
    AlexNetBN,
    DigitModel,
    LeNet5,
    OTCNN,
    OTResNet,
    ResNet18,
    build_model,
    count_parameters,
    state_nbytes,
)

SMALL_SHAPES = [(1, 28, 28), (3, 28, 28), (3, 32, 32)]
BIG_SHAPES = [(3, 64, 64), (1, 64, 64)]
CASES = [(name, shape) for name in ("lenet5", "lenet5_bnfc", "digit", "ot_cnn", "ot_resnet", "mlp", "resnet18") for shape in SMALL_SHAPES]
CASES += [("alexnet_bn", shape) for shape in BIG_SHAPES] + [("resnet18", (3, 64, 64))]
NUM_CLASSES = 7


@pytest.mark.parametrize("name,shape", CASES)
def test_forward_shapes_and_split(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, NUM_CLASSES)
    x = torch.randn(2, *shape)
    with torch.no_grad():
        z = model.features(x)
        logits = model(x)
        logits_split = model.head(z)
    assert isinstance(model.feature_dim, int)
    assert z.shape == (2, model.feature_dim)
    assert logits.shape == (2, NUM_CLASSES)
    assert torch.equal(logits_split, logits)


def test_lenet5_parameter_count():
    assert count_parameters(LeNet5(in_channels=1, num_classes=10, image_size=28)) == 61_706


def test_lenet5_bnfc_features_end_with_batch_norm_and_relu_and_the_plain_variants_keep_their_weights():
    torch.manual_seed(0)
    model = build_model("lenet5_bnfc", (1, 28, 28), 10).train()
    z = model.features(torch.randn(64, 1, 28, 28))
    assert (z >= 0).all()
    # batch norm before the last ReLU: each feature's pre-activation is standardised over the batch
    pre = model.bn2(model.fc2(torch.relu(model.bn1(model.fc1(model.conv(torch.randn(64, 1, 28, 28)).flatten(1))))))
    assert pre.mean(0).abs().max() < 1e-5
    assert count_parameters(model) == count_parameters(build_model("lenet5_bn", (1, 28, 28), 10)) + 2 * (120 + 84)
    torch.manual_seed(3)
    plain = LeNet5()
    torch.manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), LeNet5(dense_norm=False).state_dict().values()))
    assert list(plain.state_dict()) == list(LeNet5().state_dict())  # no new entries in the plain model


def test_otcnn_parameter_count():
    assert count_parameters(OTCNN(in_channels=3, num_classes=10, image_size=32)) == 1_063_434


def test_ot_resnet_is_the_appendix_resnet():
    # 8 convolutions, each followed by batch norm and ReLU, one linear layer, two residual connections and
    # "approximately 6.5M" parameters, about 6.2 times the CNN's
    model = OTResNet(in_channels=3, num_classes=10, image_size=32)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 8 and len([m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]) == 8
    assert len([m for m in model.modules() if isinstance(m, nn.Linear)]) == 1
    assert count_parameters(model) == 6_573_130
    assert count_parameters(model) / count_parameters(OTCNN(in_channels=3, num_classes=10, image_size=32)) == pytest.approx(6.2, abs=0.05)
    # the residual branch is added: zeroing its last batch norm's scale and shift makes the block the identity
    residual = model.layer1[1]
    nn.init.zeros_(residual.body[1][1].weight), nn.init.zeros_(residual.body[1][1].bias)
    x = torch.randn(2, 128, 8, 8)
    assert torch.equal(residual(x), x)
    with pytest.raises(ValueError, match="too small"):
        OTResNet(in_channels=1, num_classes=10, image_size=7)


def test_digit_model_flatten_size():
    model = DigitModel(in_channels=3, num_classes=10, image_size=28)
    assert model.fc[0].in_features == 6272
    assert model.feature_dim == 512


@pytest.mark.parametrize("name,shape", [("digit", (3, 28, 28)), ("alexnet_bn", (3, 64, 64)), ("resnet18", (3, 32, 32))])
def test_bn_running_stats_in_state_dict(name, shape):
    model = build_model(name, shape, 10)
    bns = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert bns
    sd = model.state_dict()
    for n, _ in bns:
        assert f"{n}.running_mean" in sd and f"{n}.running_var" in sd
    # the dummy forward in __init__ must not have touched the running stats
    for n, m in bns:
        assert int(m.num_batches_tracked) == 0
        assert torch.equal(m.running_mean, torch.zeros_like(m.running_mean))


def test_state_nbytes_counts_bn_buffers():
    model = DigitModel(in_channels=3, num_classes=10, image_size=28)
    n_bn_stats = sum(
        m.running_mean.numel() + m.running_var.numel()
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )
    assert state_nbytes(model) == 4 * (count_parameters(model) + n_bn_stats)
    assert state_nbytes(LeNet5()) == 4 * 61_706


def test_resnet18_loads_local_weights(tmp_path):
    torch.manual_seed(1)
    saved = torchvision.models.resnet18(weights=None, num_classes=1000).state_dict()
    path = tmp_path / "resnet18.pt"
    torch.save(saved, path)
    torch.manual_seed(2)
    model = ResNet18(in_channels=3, num_classes=10, weights_path=path)
    assert torch.equal(model.conv1.weight, saved["conv1.weight"])
    assert torch.equal(model.layer3[0].conv2.weight, saved["layer3.0.conv2.weight"])
    assert torch.equal(model.bn1.running_var, saved["bn1.running_var"])
    assert model.head.out_features == 10
    # a 1-channel model keeps everything but conv1 and fc
    gray = ResNet18(in_channels=1, num_classes=10, weights_path=str(path))
    assert gray.conv1.weight.shape == (64, 1, 7, 7)
    assert torch.equal(gray.layer1[0].conv1.weight, saved["layer1.0.conv1.weight"])


def test_resnet18_missing_weights_file(tmp_path):
    path = tmp_path / "nope" / "resnet18.pt"
    with pytest.raises(FileNotFoundError) as err:
        ResNet18(num_classes=10, weights_path=path)
    msg = str(err.value)
    assert str(path) in msg
    assert "never downloaded" in msg
    assert "IMAGENET1K_V1" in msg


def test_unknown_model_name():
    with pytest.raises(ValueError) as err:
        build_model("vgg16", (3, 32, 32), 10)
    for name in MODELS:
        assert name in str(err.value)


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"resnet18_imagenet"}))  # it needs its weights file: below
def test_same_seed_same_weights(name):
    shape = (3, 64, 64) if name == "alexnet_bn" else (3, 32, 32)
    torch.manual_seed(123)
    a = build_model(name, shape, 10).state_dict()
    torch.manual_seed(123)
    b = build_model(name, shape, 10).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_alexnet_minimum_size():
    with pytest.raises(ValueError, match="image_size >= 63"):
        AlexNetBN(in_channels=3, num_classes=10, image_size=32)
    AlexNetBN(in_channels=3, num_classes=10, image_size=63)  # the smallest size that works


def test_models_have_no_dropout():
    for name in ("lenet5", "lenet5_bnfc", "digit", "ot_cnn", "ot_resnet", "mlp"):
        model = build_model(name, (3, 32, 32), 10)
        assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_resnet18_imagenet_reads_its_weights_from_the_data_root_and_names_the_file_when_absent(tmp_path, monkeypatch):
    from fedlab_core import RunConfig
    from fedlab_core.models import IMAGENET_RESNET18, meta_model

    monkeypatch.setenv("FEDLAB_DATA_DIR", str(tmp_path))
    meta_model.cache_clear()
    path = tmp_path / "weights" / IMAGENET_RESNET18
    with pytest.raises(FileNotFoundError, match=IMAGENET_RESNET18):   # refused when the config is made
        RunConfig(dataset="digits", model="resnet18_imagenet", algorithm="fraug")
    path.parent.mkdir()
    torch.manual_seed(3)
    saved = torchvision.models.resnet18(weights=None, num_classes=1000).state_dict()
    torch.save(saved, path)
    meta_model.cache_clear()
    RunConfig(dataset="digits", model="resnet18_imagenet", algorithm="fraug")   # accepted: FRAug needs its BN
    model = build_model("resnet18_imagenet", (3, 32, 32), 7)
    assert torch.equal(model.layer2[1].conv1.weight, saved["layer2.1.conv1.weight"]) and model.head.out_features == 7
    meta_model.cache_clear()
