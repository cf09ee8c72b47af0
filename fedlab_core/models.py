"""Classifiers used in the experiments, all split into a feature extractor and a linear head.

Every model exposes:
    features(x) -> z       (B, feature_dim)
    head(z)     -> logits  (B, num_classes)
    forward(x) = head(features(x))
an integer attribute `feature_dim`, and `blocks`: the names of the modules whose outputs end a
convolutional block (conv, batch norm, activation and, where there is one, pooling; a ResNet's stem
and residual stages), where feature-level methods such as FedFA act. No model uses dropout, so a run is
fully determined by its seed.
"""
from __future__ import annotations

import functools

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# helpers


def _flat_size(module: nn.Module, in_channels: int, image_size: int) -> int:
    """Number of features per sample that `module` produces for a (1, C, S, S) input."""
    was_training = module.training
    module.eval()  # eval mode so BatchNorm running stats are not touched by the dummy pass
    try:
        with torch.no_grad():
            out = module(torch.zeros(1, in_channels, image_size, image_size))
    except RuntimeError as err:  # a kernel larger than what is left of the image
        raise ValueError(f"{image_size}x{image_size} images are too small for this model's convolutions "
                         f"({str(err).splitlines()[0]})") from None
    finally:
        module.train(was_training)
    return out[0].numel()


def count_parameters(model: nn.Module) -> int:
    """Total number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())


def state_nbytes(model: nn.Module) -> int:
    """Bytes of every floating-point state-dict entry (parameters and BN running stats): the size of one model upload."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())


# -----------------------------------------------------------------------------
# models


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998), the common modern variant with ReLU and max-pooling.

    With ``batch_norm=True`` ("lenet5_bn") a BatchNorm2d follows each convolution: it trains much
    faster from few samples and gives FedBN-style methods batch-norm layers to act on. With
    ``dense_norm=True`` as well ("lenet5_bnfc") a BatchNorm1d also follows each hidden dense layer, before
    its ReLU, so the 84-d features end with batch norm and ReLU as the Digits CNN's (FedBN's, FRAug's) do.
    """

    blocks = ("conv.3", "conv.7")  # after each conv, (BN,) ReLU, max-pool

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, batch_norm: bool = False,
                 dense_norm: bool = False):
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2), norm(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5), norm(16), nn.ReLU(), nn.MaxPool2d(2),
        )
        n_flat = _flat_size(self.conv, in_channels, image_size)  # 16*5*5 = 400 for 28x28
        self.fc1 = nn.Linear(n_flat, 120)
        self.fc2 = nn.Linear(120, 84)
        dense = (lambda c: nn.BatchNorm1d(c)) if dense_norm else (lambda c: nn.Identity())
        self.bn1, self.bn2 = dense(120), dense(84)
        self.feature_dim = 84
        self.head = nn.Linear(84, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # (B, 16, 5, 5) for 28x28
        x = torch.flatten(x, 1)  # (B, 400)
        x = F.relu(self.bn1(self.fc1(x)))  # (B, 120)
        x = F.relu(self.bn2(self.fc2(x)))  # (B, 84)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


class DigitModel(nn.Module):
    """The Digits CNN of FedBN (Li et al. 2021), with BatchNorm after every conv and hidden dense layer."""

    blocks = ("conv.3", "conv.7", "conv.10")

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=5, padding=2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, kernel_size=5, padding=2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, kernel_size=5, padding=2), nn.BatchNorm2d(128), nn.ReLU(),
        )
        n_flat = _flat_size(self.conv, in_channels, image_size)  # 128*7*7 = 6272 for 28x28
        self.fc = nn.Sequential(
            nn.Linear(n_flat, 2048), nn.BatchNorm1d(2048), nn.ReLU(),
            nn.Linear(2048, 512), nn.BatchNorm1d(512), nn.ReLU(),
        )
        self.feature_dim = 512
        self.head = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # (B, 128, 7, 7) for 28x28
        x = torch.flatten(x, 1)  # (B, 6272)
        x = self.fc(x)  # (B, 512)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


class OTCNN(nn.Module):
    """The CNN of the OT-preprocessing federated-learning paper (Manella et al.)."""

    blocks = ("conv.2", "conv.5")

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
        )
        n_flat = _flat_size(self.conv, in_channels, image_size)  # 128*5*5 = 3200 for 32x32
        self.fc1 = nn.Linear(n_flat, 256)
        self.fc2 = nn.Linear(256, 128)
        self.feature_dim = 128
        self.head = nn.Linear(128, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # (B, 128, 5, 5) for 32x32
        x = torch.flatten(x, 1)  # (B, 3200)
        x = F.relu(self.fc1(x))  # (B, 256)
        x = F.relu(self.fc2(x))  # (B, 128)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


def _conv_bn(c_in: int, c_out: int, pool: bool = False) -> nn.Sequential:
    """A 3x3 convolution, batch norm and ReLU, then 2x2 max-pooling when `pool`."""
    layers = [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)


class _Residual(nn.Module):
    """x + body(x)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class OTResNet(nn.Module):
    """The ResNet of the OT-preprocessing paper's appendix (its Fig. 6): 8 convolutions and one linear layer.

    Every convolution is followed by batch norm and ReLU; two residual connections each span two
    convolutions, after the 128- and the 512-channel pooling stages: 3x3 convolutions of 64, 128 (pool),
    128, 128 (residual), 256 (pool), 512 (pool), 512, 512 (residual) channels, global max-pooling and a
    linear layer, 6.57M parameters for 3 input channels (the paper: "approximately 6.5M"). The figure gives
    the order of the blocks, not every kernel size; this is the ResNet-9 whose layout it draws.
    """

    blocks = ("prep", "layer1", "layer2", "layer3")

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        if image_size < 8:
            raise ValueError(f"{image_size}x{image_size} images are too small for the three poolings of ot_resnet")
        self.prep = _conv_bn(in_channels, 64)
        self.layer1 = nn.Sequential(_conv_bn(64, 128, pool=True), _Residual(nn.Sequential(_conv_bn(128, 128),
                                                                                          _conv_bn(128, 128))))
        self.layer2 = _conv_bn(128, 256, pool=True)
        self.layer3 = nn.Sequential(_conv_bn(256, 512, pool=True), _Residual(nn.Sequential(_conv_bn(512, 512),
                                                                                           _conv_bn(512, 512))))
        self.feature_dim = 512
        self.head = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.prep(x))))  # (B, 512, S/8, S/8)
        return torch.amax(x, dim=(2, 3))  # (B, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


def _alexnet_final_size(image_size: int) -> int:
    """Spatial size after AlexNet's conv/pool stack (0 or less means the stack collapses)."""
    s = (image_size + 2 * 2 - 11) // 4 + 1  # conv 11, stride 4, pad 2
    for _ in range(3):  # three max-pools 3/2; the convs in between keep the size
        if s < 3:
            return 0
        s = (s - 3) // 2 + 1
    return s


class AlexNetBN(nn.Module):
    """AlexNet with BatchNorm, as used by FedBN (Li et al. 2021) for Office-Caltech / DomainNet."""

    blocks = ("conv.3", "conv.7", "conv.10", "conv.13", "conv.17")  # FedFA's code: after each of the five stages

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 256):
        super().__init__()
        if _alexnet_final_size(image_size) < 1:
            min_size = next(s for s in range(1, 1024) if _alexnet_final_size(s) >= 1)
            raise ValueError(
                f"AlexNetBN needs image_size >= {min_size} (got {image_size}): "
                f"smaller inputs collapse below 1 pixel in the conv stack"
            )
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=11, stride=4, padding=2), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.BatchNorm2d(192), nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.BatchNorm2d(384), nn.ReLU(),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.fc = nn.Sequential(
            nn.Linear(256 * 6 * 6, 4096), nn.BatchNorm1d(4096), nn.ReLU(),
            nn.Linear(4096, 4096), nn.BatchNorm1d(4096), nn.ReLU(),
        )
        self.feature_dim = 4096
        self.head = nn.Linear(4096, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # (B, 256, 6, 6) for 256x256, (B, 256, 1, 1) for 64x64
        x = self.avgpool(x)  # (B, 256, 6, 6)
        x = torch.flatten(x, 1)  # (B, 9216)
        x = self.fc(x)  # (B, 4096)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


class _ResNet(nn.Module):
    """A torchvision ResNet split into ``features`` (through global average pooling) and ``head``.

    The stem is rebuilt for ``in_channels`` other than 3; any input size works (global pooling).
    """

    blocks = ("maxpool", "layer1", "layer2", "layer3", "layer4")  # the stem, then each residual stage

    def __init__(self, net: nn.Module, in_channels: int):
        super().__init__()
        if in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.avgpool = net.avgpool
        self.feature_dim = net.fc.in_features  # 512 (ResNet-18) or 2048 (ResNet-50)
        self.head = net.fc

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (B, 64, 56, 56) for 224x224
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, feature_dim, 7, 7)
        return torch.flatten(self.avgpool(x), 1)  # (B, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


class ResNet18(_ResNet):
    """ResNet-18 (He et al. 2016) from torchvision, optionally loading pretrained weights from a local file."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int = 224,  # unused: global average pooling handles any size
        weights_path: str | Path | None = None,
    ):
        import torchvision  # loaded for the ResNets only: it takes over a second to import

        net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
        super().__init__(net, in_channels)
        if weights_path is not None:  # net's modules are this model's, so loading into net loads here
            _load_resnet18_weights(net, Path(weights_path), in_channels)


IMAGENET_RESNET18 = "resnet18-f37072fd.pth"  # torchvision's file name for ResNet18_Weights.IMAGENET1K_V1


def imagenet_weights_path() -> Path:
    """Where ``resnet18_imagenet`` reads its ImageNet weights: ``<data root>/weights/resnet18-f37072fd.pth``
    (the data root as for datasets: ``$FEDLAB_DATA_DIR``, else ``data/`` of this checkout)."""
    from .data.base import data_root

    return data_root() / "weights" / IMAGENET_RESNET18


class ResNet18ImageNet(ResNet18):
    """ResNet-18 initialised with ImageNet weights read from :func:`imagenet_weights_path` (FRAug's and
    FedBN's backbone on PACS and OfficeHome); weights are never downloaded. A run's config is refused when
    the file is absent (:meth:`required_file`); a structural build on PyTorch's meta device reads nothing."""

    required_file = staticmethod(imagenet_weights_path)

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 224):
        meta = torch.empty(0).is_meta
        super().__init__(in_channels, num_classes, image_size, weights_path=None if meta else imagenet_weights_path())


class ResNet50(_ResNet):
    """ResNet-50 (He et al. 2016) from torchvision: bottleneck blocks, 2048 features; no pretrained weights."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 224):  # size unused
        import torchvision

        super().__init__(torchvision.models.resnet50(weights=None, num_classes=num_classes), in_channels)


def _load_resnet18_weights(net: nn.Module, path: Path, in_channels: int) -> None:
    """Load a torchvision-format ResNet-18 state dict from `path` into `net`, skipping mismatched fc / conv1."""
    if not path.is_file():
        raise FileNotFoundError(
            f"ResNet-18 weights not found at {path.resolve()}. Weights are never downloaded; "
            f"on a machine with internet run "
            f"`torch.save(torchvision.models.resnet18(weights=\"IMAGENET1K_V1\").state_dict(), \"{path.name}\")` "
            f"and copy the file to that path."
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    own = net.state_dict()
    skip = set()
    for key in ("fc.weight", "fc.bias"):
        if key in state and state[key].shape != own[key].shape:
            skip.add(key)
    if in_channels != 3:
        skip.add("conv1.weight")
    result = net.load_state_dict({k: v for k, v in state.items() if k not in skip}, strict=False)
    missing = set(result.missing_keys) - skip
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path} is not a torchvision ResNet-18 state dict: "
            f"missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}"
        )


class MLP(nn.Module):
    """A one-hidden-layer perceptron, for fast tests; with ``batch_norm=True`` ("mlp_bn") a BatchNorm1d
    follows the hidden layer, the smallest model batch-norm methods (FedBN, AdvProp) accept."""

    blocks = ()  # no convolutions

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, hidden: int = 64,
                 batch_norm: bool = False):
        super().__init__()
        self.fc = nn.Linear(in_channels * image_size * image_size, hidden)
        self.bn = nn.BatchNorm1d(hidden) if batch_norm else nn.Identity()
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)  # (B, C*H*W)
        x = F.relu(self.bn(self.fc(x)))  # (B, hidden)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


# -----------------------------------------------------------------------------
# registry

MODELS = {
    "lenet5": LeNet5,
    "lenet5_bn": functools.partial(LeNet5, batch_norm=True),
    "lenet5_bnfc": functools.partial(LeNet5, batch_norm=True, dense_norm=True),
    "digit": DigitModel,
    "ot_cnn": OTCNN,
    "ot_resnet": OTResNet,
    "alexnet_bn": AlexNetBN,
    "resnet18": ResNet18,
    "resnet18_imagenet": ResNet18ImageNet,
    "resnet50": ResNet50,
    "mlp": MLP,
    "mlp_bn": functools.partial(MLP, batch_norm=True),
}


@functools.lru_cache(maxsize=64)
def meta_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The model `name` built on PyTorch's meta device: its structure, with no memory and no data.

    What validation inspects (its layers, whether it takes `input_shape`) before anything is loaded.
    Shared between callers: do not modify it.
    """
    with torch.device("meta"):
        return build_model(name, input_shape, num_classes)


BATCH_NORM = (nn.modules.batchnorm._BatchNorm,)  # 1-D, 2-D and 3-D batch norm


def models_with(kinds: tuple[type, ...]) -> list[str]:
    """Registry names of the models that have a layer of one of these kinds."""
    return sorted(n for n in MODELS if any(isinstance(m, kinds) for m in meta_model(n, (3, 64, 64), 10).modules()))


def require_layers(model: nn.Module, kinds: tuple[type, ...], method: str, why: str,
                   what: str = "batch-norm layer") -> None:
    """Raise ValueError unless `model` has a layer of one of these kinds; `why` says what `method` does
    with them, `what` names them."""
    if not any(isinstance(m, kinds) for m in model.modules()):
        raise ValueError(f"{method!r} {why}, and {type(model).__name__} has no {what}; use a model that has "
                         f"one ({', '.join(models_with(kinds))})")


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int, **kwargs) -> nn.Module:
    """Build the model registered as `name` for inputs of shape (C, H, W); extra kwargs go to its constructor."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {sorted(MODELS)}")
    in_channels, height, width = input_shape
    if height != width:
        raise ValueError(f"models expect square images, got input_shape {tuple(input_shape)}")
    return MODELS[name](in_channels=in_channels, num_classes=num_classes, image_size=height, **kwargs)
