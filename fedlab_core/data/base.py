"""The in-memory dataset record every loader returns, and the one error a missing dataset raises."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch


@dataclass
class Dataset:
    """A labelled image dataset held as tensors.

    Attributes
    ----------
    x_train, x_test : float32 tensors of shape (N, C, H, W), values in [0, 1].
    y_train, y_test : int64 tensors of shape (N,), class ids in [0, num_classes).
    num_classes : number of classes.
    name : registry name of the dataset.
    classes : human-readable class names, when known.
    domains : domain names for multi-domain datasets (one domain per client), else None.
    domain_train, domain_test : int64 tensors (N,) giving each sample's domain id, or None.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    name: str
    classes: Sequence[str] | None = None
    domains: Sequence[str] | None = None
    domain_train: torch.Tensor | None = None
    domain_test: torch.Tensor | None = None
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dtype != torch.float32 or x.dim() != 4:
                raise TypeError(f"x_{split} must be a float32 (N, C, H, W) tensor, got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise TypeError(f"y_{split} must be an int64 tensor of shape ({x.shape[0]},), got {y.dtype} {tuple(y.shape)}")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    def __repr__(self) -> str:
        dom = f", domains={list(self.domains)}" if self.domains else ""
        return (f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
                f"shape={self.input_shape}, classes={self.num_classes}{dom})")


def digest(*tensors: torch.Tensor) -> str:
    """A short SHA-256 hex digest of tensors' dtypes, shapes and bytes (in order): the same data, the same
    digest, on any machine."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        a = t.detach().cpu().contiguous().numpy()
        h.update(f"{a.dtype}{a.shape}".encode())
        if a.size:  # an empty tensor has no bytes (and a view with a zero in its shape cannot be cast)
            h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:16]


class DatasetNotFoundError(FileNotFoundError):
    """Raised when a dataset's files are not on disk; the one-line message says what, where and how to get it."""

    def __init__(self, name: str, looked_in: Sequence[Path | str], how_to_get: str):
        super().__init__(f"Dataset {name!r} was not found; looked for its files in {', '.join(map(str, looked_in))}. "
                         f"How to get it: {how_to_get}")
        self.name = name
        self.looked_in = [str(p) for p in looked_in]
        self.how_to_get = how_to_get

    def __reduce__(self):
        """Rebuilt from its arguments, so the error survives the trip back from a sweep's worker process."""
        return type(self), (self.name, self.looked_in, self.how_to_get)


class DataFileError(ValueError):
    """A dataset file is there but cannot be read (truncated, damaged, or in another format); the message
    names the file and says what to do."""

    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}; the file is damaged or not in its expected format: replace it "
                         f"with a good copy")
        self.path, self.reason = str(path), reason

    def __reduce__(self):
        """Rebuilt from its arguments, so the error survives the trip back from a sweep's worker process."""
        return type(self), (self.path, self.reason)


def data_root(root: str | Path | None = None) -> Path:
    """The folder datasets are looked for in.

    `root` if given; else the environment variable ``FEDLAB_DATA_DIR``; else the ``data/`` folder of the
    source checkout this package runs from; else ``~/.cache/fedlab_core/data``.
    """
    import os

    if root is not None:
        return Path(root).expanduser()
    if os.environ.get("FEDLAB_DATA_DIR"):
        return Path(os.environ["FEDLAB_DATA_DIR"]).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and (checkout / "fedlab_core").is_dir():
        return checkout / "data"
    return Path.home() / ".cache" / "fedlab_core" / "data"
