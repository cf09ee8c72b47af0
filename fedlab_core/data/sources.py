"""Loaders that read image datasets from their real on-disk formats into a :class:`Dataset`.

Every loader is ``load_<name>(root=None, **options) -> Dataset``; ``root`` is resolved with
:func:`fedlab_core.data.base.data_root`. Nothing is ever downloaded: a dataset whose files are absent
raises one :class:`DatasetNotFoundError` that lists every place looked in and says how to get the files.
"""
from __future__ import annotations

import bz2
import functools
import gzip
import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from fedlab_core.data.base import DataFileError, Dataset, DatasetNotFoundError, data_root
from fedlab_core.data.partition import stratified_split

# Folders outside the data root where distributions install datasets (looked in last). A module
# constant so tests can point it elsewhere and exercise the "missing" path on a machine that has them.
SYSTEM_DIRS: dict[str, list[Path]] = {
    "fashion_mnist": [Path("/usr/share/datasets/fashion-mnist")],
}

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
DIGIT_CLASSES = tuple(str(i) for i in range(10))
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})


# ----------------------------------------------------------------------------------------------- helpers

def _to_x(images_u8: np.ndarray) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 in [0, 1]; dividing by 255 keeps 0 and 255 exact."""
    return torch.from_numpy(np.ascontiguousarray(images_u8)).to(torch.float32).div_(255.0)


def _to_y(labels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))


def _reads_a_file(read: Callable) -> Callable:
    """Wrap a reader whose first argument is a file: a file it cannot read (truncated, not gzip, not the
    format) raises one :class:`DataFileError` naming that file, not the decoder's own error."""
    @functools.wraps(read)
    def wrapper(path, *args, **kwargs):
        try:
            return read(path, *args, **kwargs)
        except DataFileError:
            raise
        except (OSError, EOFError, ValueError, KeyError, IndexError, pickle.UnpicklingError, zlib.error) as err:
            reason = str(err).removeprefix(f"{path}: ") or type(err).__name__
            raise DataFileError(path, reason) from None
    return wrapper


def _open_maybe_gz(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _first_dir_with(dirs: Sequence[Path], find: Callable[[Path], object]):
    """The first ``find(d)`` that is not None over ``dirs``, else None."""
    for d in dirs:
        if d.is_dir():
            found = find(d)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------------------------------- IDX

# IDX type code (third magic byte) -> big-endian numpy dtype.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@_reads_a_file
def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (the MNIST format), gzip-compressed when its name ends in ``.gz``.

    Parameters
    ----------
    path : str or Path
        The file.

    Returns
    -------
    numpy.ndarray
        Array with the file's shape, in native byte order.

    Raises
    ------
    DataFileError (a ValueError)
        If the file is not gzip where its name says so, is truncated, its magic number is unknown or its
        payload length does not match the header.
    """
    path = Path(path)
    with _open_maybe_gz(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: IDX payload has {len(raw) - header} bytes, header {dims} "
                         f"of {dtype} implies {expected - header}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def _idx_files(d: Path) -> list[Path] | None:
    """The four MNIST-style IDX files in ``d`` (plain preferred over .gz: no decompression), or None."""
    found = []
    for stem in _IDX_STEMS:
        candidates = [p for p in (d / stem, d / f"{stem}.gz") if p.is_file()]
        if not candidates:
            return None
        found.append(candidates[0])
    return found


def _load_idx_dataset(name: str, dirs: list[Path], classes: Sequence[str], how_to_get: str) -> Dataset:
    files = _first_dir_with(dirs, _idx_files)
    if files is None:
        raise DatasetNotFoundError(name, dirs, how_to_get)
    x_tr, y_tr, x_te, y_te = (read_idx(p) for p in files)
    for x, y, split in ((x_tr, y_tr, "train"), (x_te, y_te, "test")):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{name} {split}: images {x.shape} and labels {y.shape} do not match "
                             f"(in {files[0].parent})")
    return Dataset(_to_x(x_tr[:, None]), _to_y(y_tr), _to_x(x_te[:, None]), _to_y(y_te),
                   num_classes=len(classes), name=name, classes=list(classes),
                   notes={"path": str(files[0].parent)})


def load_fashion_mnist(root: str | Path | None = None) -> Dataset:
    """Fashion-MNIST: 60,000 train + 10,000 test grey 28x28 images, 10 classes.

    Parameters
    ----------
    root : str or Path, optional
        Data root; searched in ``<root>/FashionMNIST/raw``, ``<root>/fashion-mnist``, then
        ``SYSTEM_DIRS["fashion_mnist"]`` (Debian's ``/usr/share/datasets/fashion-mnist``).

    Returns
    -------
    Dataset
        x of shape (N, 1, 28, 28).
    """
    root = data_root(root)
    dirs = [root / "FashionMNIST" / "raw", root / "fashion-mnist", *SYSTEM_DIRS.get("fashion_mnist", [])]
    how = (f"`apt-get install dataset-fashion-mnist` (Debian), or on a machine with internet run "
           f"torchvision.datasets.FashionMNIST('{root}', download=True) and copy {root}/FashionMNIST/raw; "
           f"the four files {', '.join(_IDX_STEMS)} (plain or .gz) are needed")
    return _load_idx_dataset("fashion_mnist", dirs, FASHION_MNIST_CLASSES, how)


def load_mnist(root: str | Path | None = None) -> Dataset:
    """MNIST: 60,000 train + 10,000 test grey 28x28 digits.

    Parameters
    ----------
    root : str or Path, optional
        Data root; searched in ``<root>/MNIST/raw`` then ``<root>/mnist``.

    Returns
    -------
    Dataset
        x of shape (N, 1, 28, 28).
    """
    root = data_root(root)
    dirs = [root / "MNIST" / "raw", root / "mnist", *SYSTEM_DIRS.get("mnist", [])]
    how = (f"on a machine with internet run torchvision.datasets.MNIST('{root}', download=True) and copy "
           f"{root}/MNIST/raw; the four files {', '.join(_IDX_STEMS)} (plain or .gz) are needed")
    return _load_idx_dataset("mnist", dirs, DIGIT_CLASSES, how)


# ------------------------------------------------------------------------------------------------- CIFAR

@_reads_a_file
def _unpickle(path: Path) -> dict:
    # The batches are pickles written by Python 2; latin-1/bytes decoding is the only way to read them.
    # Keys are normalised to str so both bytes-keyed and str-keyed dumps are accepted.
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}


def _load_cifar(name: str, folder: Path, train_files: list[str], test_file: str, label_key: str,
                meta_file: str, names_key: str, num_classes: int, how_to_get: str) -> Dataset:
    needed = [folder / f for f in [*train_files, test_file]]
    if not all(p.is_file() for p in needed):
        raise DatasetNotFoundError(name, [folder], how_to_get)

    def read(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
        batches = [_unpickle(p) for p in paths]
        x = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches])
        y = np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])
        return x.reshape(-1, 3, 32, 32), y

    x_tr, y_tr = read(needed[:-1])
    x_te, y_te = read(needed[-1:])
    classes = None
    if (folder / meta_file).is_file():
        classes = [c.decode() if isinstance(c, bytes) else c for c in _unpickle(folder / meta_file)[names_key]]
    return Dataset(_to_x(x_tr), _to_y(y_tr), _to_x(x_te), _to_y(y_te), num_classes=num_classes,
                   name=name, classes=classes, notes={"path": str(folder)})


def load_cifar10(root: str | Path | None = None) -> Dataset:
    """CIFAR-10 from torchvision's python layout ``<root>/cifar-10-batches-py``.

    Parameters
    ----------
    root : str or Path, optional
        Data root containing ``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``.

    Returns
    -------
    Dataset
        x of shape (N, 3, 32, 32); class names from ``batches.meta`` when present.
    """
    root = data_root(root)
    how = (f"on a machine with internet run torchvision.datasets.CIFAR10('{root}', download=True) and copy "
           f"{root}/cifar-10-batches-py (data_batch_1..5, test_batch, batches.meta)")
    return _load_cifar("cifar10", root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)],
                       "test_batch", "labels", "batches.meta", "label_names", 10, how)


def load_cifar100(root: str | Path | None = None) -> Dataset:
    """CIFAR-100 (fine labels) from torchvision's python layout ``<root>/cifar-100-python``.

    Parameters
    ----------
    root : str or Path, optional
        Data root containing ``cifar-100-python/{train, test, meta}``.

    Returns
    -------
    Dataset
        x of shape (N, 3, 32, 32), 100 classes; names from ``meta`` when present.
    """
    root = data_root(root)
    how = (f"on a machine with internet run torchvision.datasets.CIFAR100('{root}', download=True) and copy "
           f"{root}/cifar-100-python (train, test, meta)")
    return _load_cifar("cifar100", root / "cifar-100-python", ["train"], "test", "fine_labels",
                       "meta", "fine_label_names", 100, how)


# ------------------------------------------------------------------------------------------ SVHN, USPS

def _files_in(names: Sequence[str]) -> Callable[[Path], list[Path] | None]:
    def find(d: Path) -> list[Path] | None:
        paths = [d / n for n in names]
        return paths if all(p.is_file() for p in paths) else None
    return find


def load_svhn(root: str | Path | None = None) -> Dataset:
    """SVHN cropped digits from torchvision's ``train_32x32.mat`` and ``test_32x32.mat``.

    Parameters
    ----------
    root : str or Path, optional
        Data root; the two files are looked for in ``<root>/svhn``, ``<root>/SVHN``, then ``<root>``.

    Returns
    -------
    Dataset
        x of shape (N, 3, 32, 32); the file's label 10 (digit 0) becomes 0.
    """
    from scipy.io import loadmat
    from scipy.io.matlab import MatReadError

    root = data_root(root)
    dirs = [root / "svhn", root / "SVHN", root]
    files = _first_dir_with(dirs, _files_in(["train_32x32.mat", "test_32x32.mat"]))
    if files is None:
        raise DatasetNotFoundError("svhn", dirs, (
            f"on a machine with internet run torchvision.datasets.SVHN('{root}', split='train', download=True) "
            f"and split='test', then copy train_32x32.mat and test_32x32.mat into {root}/svhn"))

    @_reads_a_file
    def read(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            m = loadmat(path)
        except MatReadError as err:  # scipy's own error class: a ValueError for the wrapper to name the file
            raise ValueError(str(err)) from None
        y = np.asarray(m["y"], dtype=np.int64).ravel()
        y[y == 10] = 0
        return _to_x(np.transpose(m["X"], (3, 2, 0, 1))), _to_y(y)

    (x_tr, y_tr), (x_te, y_te) = read(files[0]), read(files[1])
    return Dataset(x_tr, y_tr, x_te, y_te, num_classes=10, name="svhn", classes=list(DIGIT_CLASSES),
                   notes={"path": str(files[0].parent)})


@_reads_a_file
def _read_usps(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse bz2 LIBSVM lines ``label i:v ...`` into float (N, 256) in [-1, 1] and labels 0..9."""
    with bz2.open(path, "rb") as f:
        raw = f.read()
    # One float parse of the whole file with ':' turned into a separator gives the stream
    # "label i v i v ... label i v ...". Counting ':' per line (on the raw bytes) tells how many (i, v)
    # pairs each line has, which locates every label and pair without a per-line Python loop and copes
    # with sparse lines (LIBSVM omits zero values).
    values = np.array(raw.replace(b":", b" ").split(), dtype=np.float64)
    buf = np.frombuffer(raw, dtype=np.uint8)
    line_of = np.cumsum(buf == ord("\n"))
    n_lines = int(line_of[-1]) + 1 if len(buf) else 0
    has_token = np.bincount(line_of[~np.isin(buf, list(b" \t\r\n"))], minlength=n_lines) > 0
    pairs = np.bincount(line_of[buf == ord(":")], minlength=n_lines)[has_token]
    if len(values) != int(np.sum(1 + 2 * pairs)):
        raise ValueError(f"{path}: not LIBSVM lines of the form 'label index:value ...'")
    starts = np.cumsum(1 + 2 * pairs) - (1 + 2 * pairs)
    labels = values[starts].astype(np.int64) - 1
    rows = np.repeat(np.arange(len(pairs)), pairs)
    k = np.arange(len(rows)) - np.repeat(np.cumsum(pairs) - pairs, pairs)
    index_pos = np.repeat(starts + 1, pairs) + 2 * k
    cols = values[index_pos].astype(np.int64) - 1
    if len(cols) and (cols.min() < 0 or cols.max() >= 256):
        raise ValueError(f"{path}: feature index outside 1..256")
    x = np.zeros((len(labels), 256), dtype=np.float64)
    x[rows, cols] = values[index_pos + 1]
    return x, labels


def load_usps(root: str | Path | None = None) -> Dataset:
    """USPS handwritten digits from torchvision's ``usps.bz2`` (train) and ``usps.t.bz2`` (test).

    Parameters
    ----------
    root : str or Path, optional
        Data root; the files are looked for in ``<root>/usps``, ``<root>/USPS``, then ``<root>``.

    Returns
    -------
    Dataset
        x of shape (N, 1, 16, 16), values ``(v + 1) / 2`` of the file's [-1, 1] values; labels 1..10
        become 0..9.
    """
    root = data_root(root)
    dirs = [root / "usps", root / "USPS", root]
    files = _first_dir_with(dirs, _files_in(["usps.bz2", "usps.t.bz2"]))
    if files is None:
        raise DatasetNotFoundError("usps", dirs, (
            f"on a machine with internet run torchvision.datasets.USPS('{root}', train=True, download=True) "
            f"and train=False, then copy usps.bz2 and usps.t.bz2 into {root}/usps"))
    out = []
    for path in files:
        x, y = _read_usps(path)
        x = np.clip((x + 1.0) / 2.0, 0.0, 1.0).astype(np.float32).reshape(-1, 1, 16, 16)
        out += [torch.from_numpy(x), _to_y(y)]
    return Dataset(*out, num_classes=10, name="usps", classes=list(DIGIT_CLASSES),
                   notes={"path": str(files[0].parent)})


def load_digits(root: str | Path | None = None, test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 real images), split stratified and deterministically.

    Parameters
    ----------
    root : ignored
        Accepted for a uniform loader signature; the data ships with scikit-learn.
    test_fraction : float
        Share of each class put in the test split.
    seed : int
        Seed of the split.

    Returns
    -------
    Dataset
        x of shape (N, 1, 8, 8), the 0..16 intensities divided by 16.
    """
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None]
    y = bunch.target.astype(np.int64)
    tr, te = stratified_split(y, test_fraction, seed)
    return Dataset(torch.from_numpy(x[tr]), _to_y(y[tr]), torch.from_numpy(x[te]), _to_y(y[te]),
                   num_classes=10, name="digits", classes=list(DIGIT_CLASSES),
                   notes={"source": "sklearn.datasets.load_digits", "test_fraction": test_fraction, "seed": seed})


# ------------------------------------------------------------------------------------- image folders

def _list_images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS)


def _class_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _scan_folder(folder: Path, class_index: dict[str, int]) -> tuple[list[Path], np.ndarray]:
    """Image paths and labels of an ImageFolder-style ``folder/<class>/<images>``."""
    paths, labels = [], []
    for cls in _class_dirs(folder):
        if cls not in class_index:
            raise ValueError(f"{folder / cls}: class folder not in the expected classes {sorted(class_index)}")
        files = _list_images(folder / cls)
        paths += files
        labels += [class_index[cls]] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


@_reads_a_file
def _decode(path: Path, size: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        # Lets JPEG decode at a reduced scale (still >= size) - large DomainNet photos decode far faster.
        img.draft("RGB", (size, size))
        img = img.convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(img, dtype=np.uint8)


def _decode_all(paths: Sequence[Path], size: int) -> torch.Tensor:
    """Decode images to float32 (N, 3, size, size); PIL releases the GIL while decoding, so threads help."""
    if not paths:
        return torch.zeros((0, 3, size, size), dtype=torch.float32)
    with ThreadPoolExecutor(max_workers=8) as pool:
        images = np.stack(list(pool.map(lambda p: _decode(p, size), paths)))
    return _to_x(images.transpose(0, 3, 1, 2))


# ------------------------------------------------------------------------------------------------ MNIST-M

def _mnist_m_blend(digits: np.ndarray, photos: np.ndarray, rng: np.random.Generator,
                   threshold: float) -> np.ndarray:
    """MNIST-M recipe ``|patch - digit|`` for grey digits (N, 28, 28) in [0, 1]; returns uint8 (N, 3, 28, 28).

    Working in uint8 keeps the 60,000-image gather at a quarter of the float memory: with the digit
    binarised to {0, 255}, ``|patch - digit|`` is ``255 - patch`` on strokes and ``patch`` elsewhere.
    """
    n, h, w = digits.shape
    p_idx = rng.integers(0, photos.shape[0], size=n)
    top = rng.integers(0, photos.shape[1] - h + 1, size=n)
    left = rng.integers(0, photos.shape[2] - w + 1, size=n)
    rows = top[:, None, None] + np.arange(h)[None, :, None]
    cols = left[:, None, None] + np.arange(w)[None, None, :]
    patches = photos[p_idx[:, None, None], rows, cols]  # (N, 28, 28, 3)
    strokes = (digits > threshold)[..., None]
    return np.where(strokes, 255 - patches, patches).transpose(0, 3, 1, 2)


def load_mnist_m(root: str | Path | None = None, seed: int = 0, threshold: float = 0.0,
                 image_size: int = 28) -> Dataset:
    """MNIST-M: MNIST digits blended over colour photo patches, (N, 3, 28, 28).

    Read from ``<root>/mnist_m/{train,test}/<0..9>/*.png`` when that folder exists; otherwise built from
    MNIST (see :func:`load_mnist`) with the MNIST-M recipe ``out = |patch - digit|`` per pixel and channel,
    where ``digit`` is the MNIST image binarised (``pixel > threshold``) to {0, 1} on 3 channels and
    ``patch`` a random 28x28 crop of a colour photo. The original uses BSDS500 photos, which are not
    available offline; this build crops scikit-learn's bundled ``load_sample_images()`` photos
    (china.jpg, flower.jpg) instead, so it is an MNIST-M-style dataset, not the published files.

    Parameters
    ----------
    root : str or Path, optional
        Data root.
    seed : int
        Seed of the crop positions and photo choice (built route only); train is drawn before test.
    threshold : float
        Binarisation threshold on MNIST in [0, 1]; 0.0 (any ink) follows the widely used build script.
    image_size : int
        Side images from the folder route are resized to when they are not already that size.

    Returns
    -------
    Dataset
        ``notes["source"]`` says which route produced it.
    """
    root = data_root(root)
    folder = root / "mnist_m"
    if (folder / "train").is_dir() and (folder / "test").is_dir():
        index = {c: i for i, c in enumerate(DIGIT_CLASSES)}
        (p_tr, y_tr), (p_te, y_te) = _scan_folder(folder / "train", index), _scan_folder(folder / "test", index)
        return Dataset(_decode_all(p_tr, image_size), _to_y(y_tr), _decode_all(p_te, image_size), _to_y(y_te),
                       num_classes=10, name="mnist_m", classes=list(DIGIT_CLASSES),
                       notes={"source": f"image folder {folder}"})
    try:
        mnist = load_mnist(root)
    except DatasetNotFoundError as err:
        raise DatasetNotFoundError("mnist_m", [folder / "train", folder / "test", *err.looked_in], (
            f"either put MNIST-M images in {folder}/train/<0..9>/*.png and {folder}/test/<0..9>/*.png, "
            f"or provide MNIST (on a machine with internet run torchvision.datasets.MNIST('{root}', "
            f"download=True) and copy {root}/MNIST/raw) so MNIST-M is built from it")) from None

    from sklearn.datasets import load_sample_images

    pictures = load_sample_images().images
    h, w = min(p.shape[0] for p in pictures), min(p.shape[1] for p in pictures)
    photos = np.stack([p[:h, :w, :3] for p in pictures]).astype(np.uint8)
    rng = np.random.default_rng(seed)
    x_tr = _mnist_m_blend(mnist.x_train[:, 0].numpy(), photos, rng, threshold)
    x_te = _mnist_m_blend(mnist.x_test[:, 0].numpy(), photos, rng, threshold)
    return Dataset(_to_x(x_tr), mnist.y_train.clone(), _to_x(x_te), mnist.y_test.clone(),
                   num_classes=10, name="mnist_m", classes=list(DIGIT_CLASSES),
                   notes={"source": "built from MNIST with |patch - digit| over crops of scikit-learn's "
                                    "sample photos (china.jpg, flower.jpg), not BSDS500",
                          "seed": seed, "threshold": threshold})


# ------------------------------------------------------------------------------------ domain datasets

DOMAIN_DATASETS = {
    "pacs": ("PACS", ("art_painting", "cartoon", "photo", "sketch")),
    "officehome": ("OfficeHome", ("Art", "Clipart", "Product", "Real_World")),
    "office_caltech10": ("office_caltech_10", ("amazon", "caltech", "dslr", "webcam")),
    "domainnet": ("DomainNet", ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")),
}


def _share(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a class-stratified, seeded `fraction` of `labels` (all of them when fraction is 1;
    every class keeps at least one sample)."""
    if fraction >= 1.0:
        return np.arange(len(labels))
    keep, _ = stratified_split(labels, 1.0 - fraction, seed)
    return keep


def _domain_class_root(domain_dir: Path) -> list[Path]:
    """Folders holding ``<class>/`` subfolders: ``train`` and ``test`` when both exist, else the domain."""
    if (domain_dir / "train").is_dir() and (domain_dir / "test").is_dir():
        return [domain_dir / "train", domain_dir / "test"]
    return [domain_dir]


def _load_domains(name: str, root: str | Path | None, image_size: int = 64,
                  domains: Sequence[str] | None = None, max_per_domain: int | None = None,
                  test_fraction: float = 0.2, train_share: float = 1.0, test_share: float = 1.0,
                  seed: int = 0) -> Dataset:
    dir_name, all_domains = DOMAIN_DATASETS[name]
    root = data_root(root)
    candidates = [root / dir_name] + ([root / dir_name.lower()] if dir_name.lower() != dir_name else [])
    layout = (f"the layout {root}/{dir_name}/<domain>/<class_name>/<images> (or "
              f"<domain>/train/<class_name>/... and <domain>/test/<class_name>/...) with domains "
              f"{', '.join(all_domains)}; download {name} from its authors' page and unpack it there")
    base = next((c for c in candidates if c.is_dir()), None)
    if base is None:
        raise DatasetNotFoundError(name, candidates, layout)
    selected = list(all_domains if domains is None else domains)
    unknown = [d for d in selected if d not in all_domains]
    if unknown:
        raise ValueError(f"{name}: unknown domains {unknown}; allowed: {list(all_domains)}")
    missing = [base / d for d in selected if not (base / d).is_dir()]
    if missing:
        raise DatasetNotFoundError(name, missing, layout)

    # Classes are taken over every domain on disk, not just the selected ones, so a class keeps its id
    # whichever subset of domains a run asks for.
    classes = sorted({c for d in all_domains if (base / d).is_dir()
                      for sub in _domain_class_root(base / d) for c in _class_dirs(sub)})
    index = {c: i for i, c in enumerate(classes)}
    parts: dict[str, list] = {"p_tr": [], "y_tr": [], "d_tr": [], "p_te": [], "y_te": [], "d_te": []}
    for dom_id, dom in enumerate(selected):
        subs = _domain_class_root(base / dom)
        scans = [_scan_folder(s, index) for s in subs]
        paths = [p for ps, _ in scans for p in ps]
        labels = np.concatenate([ys for _, ys in scans])
        is_test = np.concatenate([np.full(len(ys), k == 1) for k, (_, ys) in enumerate(scans)])
        if not paths:
            raise ValueError(f"{name}: domain {dom!r} has no images under {base / dom} "
                             f"(expected <class_name>/<image files>)")
        # Seeding per domain keeps one domain's subset and split unchanged when others are added.
        rng = np.random.default_rng([seed, all_domains.index(dom)])
        keep = np.arange(len(paths))
        if max_per_domain is not None and len(paths) > max_per_domain:
            keep = np.sort(rng.choice(len(paths), size=max_per_domain, replace=False))
        labels, is_test = labels[keep], is_test[keep]
        if len(subs) == 1:
            _, te = stratified_split(labels, test_fraction, int(rng.integers(2**31)))
            is_test = np.zeros(len(keep), dtype=bool)
            is_test[te] = True
        for side, mask, share in (("tr", ~is_test, train_share), ("te", is_test, test_share)):
            chosen = np.flatnonzero(mask)
            chosen = chosen[_share(labels[chosen], share, int(rng.integers(2**31)))]
            parts[f"p_{side}"] += [paths[i] for i in keep[chosen]]
            parts[f"y_{side}"].append(labels[chosen])
            parts[f"d_{side}"].append(np.full(len(chosen), dom_id, dtype=np.int64))

    cat = {k: np.concatenate(v) for k, v in parts.items() if k[0] != "p"}
    return Dataset(_decode_all(parts["p_tr"], image_size), _to_y(cat["y_tr"]),
                   _decode_all(parts["p_te"], image_size), _to_y(cat["y_te"]),
                   num_classes=len(classes), name=name, classes=classes, domains=selected,
                   domain_train=_to_y(cat["d_tr"]), domain_test=_to_y(cat["d_te"]),
                   notes={"path": str(base), "image_size": image_size, "seed": seed,
                          "test_fraction": test_fraction, "max_per_domain": max_per_domain,
                          "train_share": train_share, "test_share": test_share})


_DOMAIN_DOC = """{title} in ImageFolder layout, one domain per client.

    Expected layout: ``<root>/{dir_name}/<domain>/<class_name>/<images>`` (``<root>/{lower}`` also
    accepted), domains {domains}. A domain with ``train/`` and ``test/`` subfolders uses them; otherwise
    each domain is split per class, deterministically by ``seed``.

    Parameters
    ----------
    root : str or Path, optional
        Data root.
    image_size : int
        Every image is converted to RGB and resized to ``image_size`` x ``image_size``.
    domains : sequence of str, optional
        Subset of domains to load (default all); ``Dataset.domains`` lists them in this order.
    max_per_domain : int, optional
        Cap on images per domain (train + test), a seeded random subset.
    test_fraction : float
        Share of each class put in test when a domain has no ``train/``/``test/`` folders.
    train_share, test_share : float
        Class-stratified, seeded share of each domain's training (test) images kept, after the split and
        before any image is decoded (FRAug's clients hold 10% of a PACS or Office-Home domain); every class
        keeps at least one image.
    seed : int
        Seed of the subset and the split.

    Returns
    -------
    Dataset
        x of shape (N, 3, image_size, image_size); classes are the sorted union of class folders over
        the domains on disk; ``domain_train``/``domain_test`` give each sample's index into ``domains``.
    """


def _domain_loader(name: str, title: str) -> Callable[..., Dataset]:
    def loader(root: str | Path | None = None, image_size: int = 64, domains: Sequence[str] | None = None,
               max_per_domain: int | None = None, test_fraction: float = 0.2, train_share: float = 1.0,
               test_share: float = 1.0, seed: int = 0) -> Dataset:
        return _load_domains(name, root, image_size=image_size, domains=domains, max_per_domain=max_per_domain,
                             test_fraction=test_fraction, train_share=train_share, test_share=test_share, seed=seed)

    dir_name, doms = DOMAIN_DATASETS[name]
    loader.__name__ = loader.__qualname__ = f"load_{name}"
    loader.__doc__ = _DOMAIN_DOC.format(title=title, dir_name=dir_name, lower=dir_name.lower(),
                                        domains=", ".join(doms))
    return loader


load_pacs = _domain_loader("pacs", "PACS (7 classes)")
load_officehome = _domain_loader("officehome", "Office-Home (65 classes)")
load_office_caltech10 = _domain_loader("office_caltech10", "Office-Caltech-10 (10 classes)")
load_domainnet = _domain_loader("domainnet", "DomainNet (345 classes)")


# ------------------------------------------------------------------------------ Digits, four domains

DIGIT_DOMAINS = ("mnist", "mnist_m", "svhn", "usps")


def load_digits4(root: str | Path | None = None, domains: Sequence[str] = DIGIT_DOMAINS, image_size: int = 28,
                 train_share: float = 1.0, test_share: float = 1.0, seed: int = 0) -> Dataset:
    """The Digits benchmark of FedBN and FRAug: MNIST, MNIST-M, SVHN and USPS, one domain each, read by their
    own loaders (each needs its files; MNIST-M is built from MNIST when its folder is absent).

    Every image becomes 3 x `image_size` x `image_size` (grey images repeated over the channels, then a
    bilinear resize with antialiasing). `train_share` keeps a class-stratified share of each domain's training
    images (FRAug: 1%), `test_share` of its test images; both seeded by `seed` and the domain.
    """
    xs, ys, dom, xt, yt, domt = [], [], [], [], [], []
    for d, name in enumerate(domains):
        ds = LOADERS[name](root)
        for x, y, xo, yo, do, share in ((ds.x_train, ds.y_train, xs, ys, dom, train_share),
                                         (ds.x_test, ds.y_test, xt, yt, domt, test_share)):
            keep = torch.as_tensor(_share(y.numpy(), share, seed * 1_000 + d))
            x = x[keep]
            x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
            if x.shape[-1] != image_size:
                x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear",
                                                    antialias=True, align_corners=False).clamp(0, 1)
            xo.append(x.contiguous())
            yo.append(y[keep])
            do.append(torch.full((len(keep),), d, dtype=torch.int64))
    return Dataset(torch.cat(xs), torch.cat(ys), torch.cat(xt), torch.cat(yt), num_classes=10, name="digits4",
                   classes=list(DIGIT_CLASSES), domains=list(domains), domain_train=torch.cat(dom),
                   domain_test=torch.cat(domt))


# ----------------------------------------------------------------------------------------------- registry

LOADERS: dict[str, Callable[..., Dataset]] = {
    "fashion_mnist": load_fashion_mnist,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "svhn": load_svhn,
    "usps": load_usps,
    "digits": load_digits,
    "mnist_m": load_mnist_m,
    "digits4": load_digits4,
    "pacs": load_pacs,
    "officehome": load_officehome,
    "office_caltech10": load_office_caltech10,
    "domainnet": load_domainnet,
}


def dataset_names() -> list[str]:
    """Sorted names accepted by :func:`load`."""
    return sorted(LOADERS)


def load(name: str, root: str | Path | None = None, **options) -> Dataset:
    """Load a dataset by registry name.

    Parameters
    ----------
    name : str
        One of :func:`dataset_names`.
    root : str or Path, optional
        Data root (see :func:`fedlab_core.data.base.data_root`).
    **options
        Passed to the loader (e.g. ``seed``, ``image_size``, ``domains``).

    Returns
    -------
    Dataset

    Raises
    ------
    ValueError
        If ``name`` is not a known dataset.
    DatasetNotFoundError
        If the dataset's files are not on disk.
    """
    if name not in LOADERS:
        raise ValueError(f"unknown dataset {name!r}; allowed names: {', '.join(dataset_names())}")
    return LOADERS[name](root, **options)
