"""Tests of fedlab_core.data.sources: each loader reads tiny files written here in the real on-disk format."""
from __future__ import annotations

import bz2
import gzip
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedlab_core.data import check_dataset_params, sources
from fedlab_core.data.base import DataFileError, Dataset, DatasetNotFoundError

IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
REAL_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def no_system_dirs(monkeypatch, tmp_path):
    """Keep the machine's installed datasets out of every test unless a test puts them back."""
    monkeypatch.setattr(sources, "SYSTEM_DIRS", {"fashion_mnist": [tmp_path / "no-system-dir"]})
    monkeypatch.delenv("FEDLAB_DATA_DIR", raising=False)


# ------------------------------------------------------------------------------------------ writers

def write_idx(path: Path, arr: np.ndarray, gz: bool = False) -> Path:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
             np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}
    header = bytes([0, 0, codes[arr.dtype], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    payload = header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def make_idx_set(folder: Path, n_train=12, n_test=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    x_tr = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    x_tr[0, 0, 0], x_tr[0, 0, 1] = 255, 0
    x_te = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    y_tr = (np.arange(n_train) % 10).astype(np.uint8)
    y_te = (np.arange(n_test)[::-1] % 10).astype(np.uint8)
    for stem, arr in zip(IDX_STEMS, (x_tr, y_tr, x_te, y_te)):
        write_idx(folder / stem, arr, gz)
    return x_tr, y_tr, x_te, y_te


def write_png(path: Path, rgb, size=(10, 10), fmt="PNG", mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new(mode, size, tuple(rgb) if mode == "RGB" else rgb)
    img.save(path, format=fmt)


def assert_valid(ds: Dataset, shape):
    assert isinstance(ds, Dataset)
    for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert tuple(x.shape[1:]) == shape
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
        assert int(y.min()) >= 0 and int(y.max()) < ds.num_classes


# --------------------------------------------------------------------------------------------- IDX

@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name,subdir", [("fashion_mnist", "FashionMNIST/raw"), ("fashion_mnist", "fashion-mnist"),
                                         ("mnist", "MNIST/raw"), ("mnist", "mnist")])
def test_idx_loaders_read_real_format(tmp_path, name, subdir, gz):
    x_tr, y_tr, x_te, y_te = make_idx_set(tmp_path / subdir, gz=gz)
    ds = sources.load(name, tmp_path)
    assert_valid(ds, (1, 28, 28))
    assert len(ds.y_train) == 12 and len(ds.y_test) == 5
    assert torch.equal(ds.x_train[:, 0], torch.from_numpy(x_tr).float() / 255)
    assert torch.equal(ds.x_test[:, 0], torch.from_numpy(x_te).float() / 255)
    assert ds.x_train[0, 0, 0, 0].item() == 1.0 and ds.x_train[0, 0, 0, 1].item() == 0.0
    assert ds.y_train.tolist() == y_tr.tolist() and ds.y_test.tolist() == y_te.tolist()
    assert ds.num_classes == 10
    if name == "fashion_mnist":
        assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"


def test_fashion_mnist_search_order_and_system_dir(tmp_path, monkeypatch):
    system = tmp_path / "system"
    make_idx_set(system, n_train=3, n_test=2, gz=True)
    monkeypatch.setattr(sources, "SYSTEM_DIRS", {"fashion_mnist": [system]})
    assert len(sources.load_fashion_mnist(tmp_path / "root").y_train) == 3  # falls back to the system dir
    make_idx_set(tmp_path / "root" / "fashion-mnist", n_train=4)
    assert len(sources.load_fashion_mnist(tmp_path / "root").y_train) == 4
    make_idx_set(tmp_path / "root" / "FashionMNIST" / "raw", n_train=6)
    assert len(sources.load_fashion_mnist(tmp_path / "root").y_train) == 6


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_dtypes_round_trip(tmp_path, dtype):
    arr = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    back = sources.read_idx(write_idx(tmp_path / "a", arr, gz=True))
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    assert np.array_equal(back, arr)


def test_corrupt_idx_raises_value_error(tmp_path):
    bad_magic = tmp_path / "bad"
    bad_magic.write_bytes(bytes([0, 0, 0x42, 1, 0, 0, 0, 1, 7]))
    with pytest.raises(ValueError, match="magic"):
        sources.read_idx(bad_magic)
    truncated = write_idx(tmp_path / "trunc", np.zeros((3, 28, 28), np.uint8))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with pytest.raises(ValueError, match="bytes"):
        sources.read_idx(truncated)
    make_idx_set(tmp_path / "mnist")
    (tmp_path / "mnist" / IDX_STEMS[1]).write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x0c\x01")  # 12 labels promised, 1 given
    with pytest.raises(ValueError):
        sources.load_mnist(tmp_path)


def test_idx_label_count_mismatch_raises(tmp_path):
    make_idx_set(tmp_path / "mnist")
    write_idx(tmp_path / "mnist" / IDX_STEMS[1], np.zeros(7, np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        sources.load_mnist(tmp_path)


# ------------------------------------------------------------------------------------------ CIFAR

def test_cifar10_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(1)
    batches = []
    for i in range(1, 6):
        data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        batch = {b"data": data, b"labels": [i, (i + 3) % 10], b"batch_label": b"x"}
        batches.append(batch)
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch, f)
    test = {b"data": np.full((3, 3072), 255, np.uint8), b"labels": [9, 0, 4]}
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(test, f)
    names = [n.encode() for n in ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names, b"num_vis": 3072}, f)

    ds = sources.load("cifar10", tmp_path)
    assert_valid(ds, (3, 32, 32))
    assert len(ds.y_train) == 10 and ds.y_test.tolist() == [9, 0, 4]
    assert ds.y_train.tolist() == [lab for b in batches for lab in b[b"labels"]]
    # Rows are three 1024-byte planes (R, G, B), each row-major 32x32.
    row = batches[2][b"data"][1]
    for c, h, w in [(0, 0, 0), (1, 5, 7), (2, 31, 31)]:
        assert ds.x_train[5, c, h, w].item() == pytest.approx(row[c * 1024 + h * 32 + w] / 255, abs=1e-7)
    assert torch.all(ds.x_test == 1.0)
    assert ds.classes[0] == "airplane" and ds.classes[9] == "truck"

    (folder / "batches.meta").unlink()
    assert sources.load_cifar10(tmp_path).classes is None


def test_cifar100_pickles(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    data = np.zeros((4, 3072), np.uint8)
    data[:, 1024] = 255  # first green pixel
    for name, labels in (("train", [0, 99, 50, 7]), ("test", [3, 4, 5, 6])):
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"fine_labels": labels, b"coarse_labels": [0] * 4}, f)
    with open(folder / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}, f)
    ds = sources.load_cifar100(tmp_path)
    assert_valid(ds, (3, 32, 32))
    assert ds.num_classes == 100 and ds.y_train.tolist() == [0, 99, 50, 7]
    assert torch.all(ds.x_train[:, 1, 0, 0] == 1.0) and ds.x_train[:, 0].sum() == 0
    assert ds.classes[99] == "c99"


# --------------------------------------------------------------------------------------- SVHN, USPS

@pytest.mark.parametrize("subdir", ["svhn", "SVHN", "."])
def test_svhn_mat(tmp_path, subdir):
    from scipy.io import savemat

    rng = np.random.default_rng(2)
    folder = tmp_path / subdir
    folder.mkdir(exist_ok=True)
    X = rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8)
    X[3, 4, 2, 1] = 255
    savemat(folder / "train_32x32.mat", {"X": X, "y": np.array([[10], [1], [9], [10]], np.uint8)})
    savemat(folder / "test_32x32.mat", {"X": X[..., :2], "y": np.array([[5], [10]], np.uint8)})
    ds = sources.load_svhn(tmp_path)
    assert_valid(ds, (3, 32, 32))
    assert ds.y_train.tolist() == [0, 1, 9, 0] and ds.y_test.tolist() == [5, 0]
    assert ds.x_train[1, 2, 3, 4].item() == 1.0
    assert torch.equal(ds.x_train, torch.from_numpy(X.transpose(3, 2, 0, 1).copy()).float() / 255)


def write_usps(path: Path, labels, images):
    lines = []
    for lab, img in zip(labels, images):
        lines.append(f"{lab} " + " ".join(f"{k + 1}:{v:.6g}" for k, v in enumerate(img) if v != 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    with bz2.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")


@pytest.mark.parametrize("subdir", ["usps", "USPS", "."])
def test_usps_bz2_libsvm(tmp_path, subdir):
    rng = np.random.default_rng(3)
    train = rng.uniform(-1, 1, (5, 256)).round(4)
    train[0, 0], train[0, 1], train[0, 17] = -1.0, 1.0, 0.0  # 0.0 is omitted from the line (sparse LIBSVM)
    test = np.zeros((2, 256))
    write_usps(tmp_path / subdir / "usps.bz2", [1, 10, 5, 3, 2], train)
    write_usps(tmp_path / subdir / "usps.t.bz2", [10, 1], test)
    ds = sources.load("usps", tmp_path)
    assert_valid(ds, (1, 16, 16))
    assert ds.y_train.tolist() == [0, 9, 4, 2, 1] and ds.y_test.tolist() == [9, 0]
    assert ds.x_train[0, 0, 0, 0].item() == 0.0 and ds.x_train[0, 0, 0, 1].item() == 1.0
    assert ds.x_train[0, 0, 1, 1].item() == 0.5  # feature 18 -> row 1, column 1
    assert torch.all(ds.x_test == 0.5)
    expected = torch.from_numpy(((train + 1) / 2).reshape(5, 1, 16, 16)).float()
    assert torch.allclose(ds.x_train, expected, atol=1e-6)


# ------------------------------------------------------------------------------------- damaged files

def _cifar10_folder(root: Path) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, f)
    return folder


@pytest.mark.parametrize("case", ["idx truncated gz", "idx not gzip", "idx bad magic", "cifar truncated pickle",
                                  "svhn not a mat file", "usps not bz2", "pacs broken png"])
def test_a_damaged_file_raises_one_line_naming_it(tmp_path, case):
    if case.startswith("idx"):
        make_idx_set(tmp_path / "mnist", gz=True)
        bad = tmp_path / "mnist" / f"{IDX_STEMS[2]}.gz"
        raw = bad.read_bytes()
        bad.write_bytes({"idx truncated gz": raw[: len(raw) // 2], "idx not gzip": b"plain text",
                         "idx bad magic": gzip.compress(b"\x01\x02\x03\x04")}[case])
        load = lambda: sources.load_mnist(tmp_path)
    elif case.startswith("cifar"):
        bad = _cifar10_folder(tmp_path) / "data_batch_3"
        bad.write_bytes(bad.read_bytes()[:100])
        load = lambda: sources.load_cifar10(tmp_path)
    elif case.startswith("svhn"):
        for name in ("train_32x32.mat", "test_32x32.mat"):
            (tmp_path / "svhn").mkdir(exist_ok=True)
            (tmp_path / "svhn" / name).write_bytes(b"MATLAB? no")
        bad = tmp_path / "svhn" / "train_32x32.mat"
        load = lambda: sources.load_svhn(tmp_path)
    elif case.startswith("usps"):
        write_usps(tmp_path / "usps" / "usps.t.bz2", [1], np.zeros((1, 256)))
        bad = tmp_path / "usps" / "usps.bz2"
        bad.write_bytes(b"BZh9 and then nothing")
        load = lambda: sources.load_usps(tmp_path)
    else:
        make_pacs(tmp_path, per_class=2)
        bad = tmp_path / "PACS" / "cartoon" / "dog" / "001.png"
        bad.write_bytes(bad.read_bytes()[:30])
        load = lambda: sources.load("pacs", tmp_path, image_size=8)
    with pytest.raises(DataFileError) as info:
        load()
    message = str(info.value)
    assert message.startswith(f"{bad}: ") and "\n" not in message and "replace it with a good copy" in message
    back = pickle.loads(pickle.dumps(info.value))  # survives the trip back from a sweep's worker
    assert type(back) is DataFileError and str(back) == message


# -------------------------------------------------------------------------------------------- digits

def test_digits_split_is_stratified_and_seeded():
    ds = sources.load_digits()
    assert_valid(ds, (1, 8, 8))
    assert len(ds.y_train) + len(ds.y_test) == 1797 and ds.x_train.max().item() == 1.0
    counts_all = torch.bincount(torch.cat([ds.y_train, ds.y_test]), minlength=10)
    counts_test = torch.bincount(ds.y_test, minlength=10)
    assert torch.all((counts_test - counts_all * 0.25).abs() <= 1)
    again = sources.load("digits", seed=0)
    assert torch.equal(ds.x_test, again.x_test) and torch.equal(ds.y_test, again.y_test)
    other = sources.load("digits", seed=1, test_fraction=0.5)
    assert abs(len(other.y_test) - 1797 / 2) <= 10
    assert not torch.equal(sources.load_digits(seed=1).x_test, ds.x_test)


# ------------------------------------------------------------------------------------------- MNIST-M

def tiny_mnist(root: Path):
    x_tr, y_tr, x_te, y_te = make_idx_set(root / "MNIST" / "raw", n_train=6, n_test=3)
    for x in (x_tr, x_te):  # a digit-like image: half background (0), half ink
        x[:, :, :14] = 0
        x[:, :, 14:] = np.maximum(x[:, :, 14:], 1)
    for stem, arr in zip(IDX_STEMS, (x_tr, y_tr, x_te, y_te)):
        write_idx(root / "MNIST" / "raw" / stem, arr)
    return x_tr, y_tr


def find_crop(patch: np.ndarray, photos: np.ndarray):
    """(photo, top, left) of the crop of `photos` (uint8 HxWx3) equal to `patch` (28x28x3 uint8), or None."""
    for p, photo in enumerate(photos):
        tops, lefts = np.nonzero(np.all(photo[: photo.shape[0] - 27, : photo.shape[1] - 27] == patch[0, 0], axis=-1))
        for t, l in zip(tops, lefts):
            if np.array_equal(photo[t:t + 28, l:l + 28], patch):
                return p, t, l
    return None


def test_mnist_m_built_from_mnist(tmp_path):
    from sklearn.datasets import load_sample_images

    x_tr, y_tr = tiny_mnist(tmp_path)
    a = sources.load_mnist_m(tmp_path, seed=0)
    assert_valid(a, (3, 28, 28))
    assert a.y_train.tolist() == y_tr.tolist()
    assert "china.jpg" in a.notes["source"] and "BSDS500" in a.notes["source"]
    b = sources.load("mnist_m", tmp_path, seed=0)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.x_test, b.x_test)
    assert not torch.equal(a.x_train, sources.load_mnist_m(tmp_path, seed=1).x_train)

    photos = np.stack(load_sample_images().images)
    digit = (x_tr[0] > 0).astype(np.float64)
    out = a.x_train[0].permute(1, 2, 0).numpy().astype(np.float64)
    # Undo |patch - digit| with the known digit, then the patch must be a real crop of a sample photo.
    patch = np.where(digit[..., None] == 1, 1 - out, out)
    found = find_crop(np.rint(patch * 255).astype(np.uint8), photos)
    assert found is not None
    p, t, l = found
    for i, j, c in [(0, 0, 0), (5, 20, 1), (27, 27, 2), (10, 3, 2)]:
        expected = abs(photos[p, t + i, l + j, c] / 255 - digit[i, j])
        assert a.x_train[0, c, i, j].item() == pytest.approx(expected, abs=1e-6)
    assert digit[:, :14].sum() == 0 and digit[:, 14:].min() == 1  # both branches were checked above


def test_mnist_m_image_folder(tmp_path):
    folder = tmp_path / "mnist_m"
    write_png(folder / "train" / "3" / "a.png", (255, 0, 10), size=(28, 28))
    write_png(folder / "train" / "3" / "b.png", (0, 255, 20), size=(28, 28))
    write_png(folder / "train" / "7" / "c.png", (1, 2, 3), size=(28, 28))
    write_png(folder / "test" / "0" / "d.png", (9, 9, 9), size=(32, 32))
    ds = sources.load_mnist_m(tmp_path)
    assert_valid(ds, (3, 28, 28))
    assert ds.y_train.tolist() == [3, 3, 7] and ds.y_test.tolist() == [0]
    assert ds.x_train[0, :, 5, 5].tolist() == [1.0, 0.0, pytest.approx(10 / 255)]
    assert "image folder" in ds.notes["source"]


# ------------------------------------------------------------------------------- missing data / registry

@pytest.mark.parametrize("name,fragment", [
    ("fashion_mnist", "apt-get install dataset-fashion-mnist"), ("mnist", "torchvision.datasets.MNIST"),
    ("cifar10", "torchvision.datasets.CIFAR10"), ("cifar100", "torchvision.datasets.CIFAR100"),
    ("svhn", "torchvision.datasets.SVHN"), ("usps", "torchvision.datasets.USPS"),
    ("mnist_m", "torchvision.datasets.MNIST"), ("pacs", "<domain>/<class_name>"),
    ("officehome", "Real_World"), ("office_caltech10", "webcam"), ("domainnet", "quickdraw"),
])
def test_missing_dataset_error(tmp_path, name, fragment):
    with pytest.raises(DatasetNotFoundError) as info:
        sources.load(name, tmp_path)
    err = info.value
    assert isinstance(err, FileNotFoundError) and err.looked_in
    message = str(err)
    for path in err.looked_in:
        assert path in message
    assert str(tmp_path) in message and "How to get it" in message and fragment in message


def test_missing_fashion_mnist_lists_every_path(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        sources.load_fashion_mnist(tmp_path)
    assert info.value.looked_in == [str(tmp_path / "FashionMNIST" / "raw"), str(tmp_path / "fashion-mnist"),
                                    str(tmp_path / "no-system-dir")]


def test_missing_dataset_error_survives_pickling(tmp_path):
    """A sweep's worker sends its exception back pickled; the user must still see the real message."""
    import pickle

    with pytest.raises(DatasetNotFoundError) as info:
        sources.load_fashion_mnist(tmp_path)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is DatasetNotFoundError and str(back) == str(info.value)
    assert back.looked_in == info.value.looked_in and back.name == info.value.name


def test_missing_mnist_m_names_both_routes(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        sources.load_mnist_m(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "mnist_m" / "train") in message and str(tmp_path / "MNIST" / "raw") in message
    assert "either" in message and "built from it" in message


def test_unknown_name_and_registry():
    with pytest.raises(ValueError) as info:
        sources.load("imagenet")
    for name in ("fashion_mnist", "mnist_m", "pacs", "domainnet"):
        assert name in str(info.value)
    assert sources.dataset_names() == sorted(sources.LOADERS)
    assert len(sources.dataset_names()) == 13
    for name, fn in sources.LOADERS.items():
        assert fn.__name__ == f"load_{name}" and fn.__doc__


# --------------------------------------------------------------------------------------- domain folders

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")


def make_pacs(root: Path, per_class=10, dirname="PACS"):
    """Colour encodes (domain, class, image): red = 40 * domain, green = 30 * class id, blue = index."""
    classes = ["dog", "elephant", "horse"]
    for d, dom in enumerate(PACS_DOMAINS):
        for c, cls in enumerate(classes):
            if dom == "sketch" and cls == "horse":
                continue  # a class missing from one domain
            for i in range(per_class):
                write_png(root / dirname / dom / cls / f"{i:03d}.png", (40 * d, 30 * c, i))
    return classes


def decode_ids(x: torch.Tensor):
    rgb = torch.round(x[:, :, 0, 0] * 255).long()
    return rgb[:, 0] // 40, rgb[:, 1] // 30, rgb[:, 2]


def test_domain_loader_split_is_stratified_deterministic_and_ids_match(tmp_path):
    classes = make_pacs(tmp_path)
    ds = sources.load("pacs", tmp_path, image_size=8)
    assert_valid(ds, (3, 8, 8))
    assert ds.classes == classes and ds.num_classes == 3 and list(ds.domains) == list(PACS_DOMAINS)
    assert ds.domain_train.dtype == torch.int64 and ds.domain_test.dtype == torch.int64
    for x, y, dom in ((ds.x_train, ds.y_train, ds.domain_train), (ds.x_test, ds.y_test, ds.domain_test)):
        d_id, c_id, _ = decode_ids(x)
        assert torch.equal(d_id, dom) and torch.equal(c_id, y)
    # 10 images per (domain, class): 2 in test, 8 in train; sketch has no horse.
    for d in range(4):
        n_cls = 2 if PACS_DOMAINS[d] == "sketch" else 3
        assert torch.bincount(ds.y_test[ds.domain_test == d], minlength=3).tolist() == [2, 2, 2][:n_cls] + [0] * (3 - n_cls)
        assert torch.bincount(ds.y_train[ds.domain_train == d], minlength=3).tolist() == [8, 8, 8][:n_cls] + [0] * (3 - n_cls)
    again = sources.load_pacs(tmp_path, image_size=8)
    assert torch.equal(ds.x_test, again.x_test) and torch.equal(ds.domain_test, again.domain_test)
    other = sources.load_pacs(tmp_path, image_size=8, seed=1)
    assert not torch.equal(decode_ids(ds.x_test)[2], decode_ids(other.x_test)[2])


def test_domain_loader_shares_keep_a_stratified_subset_of_each_side(tmp_path):
    make_pacs(tmp_path, per_class=20)   # per (domain, class): 16 train, 4 test
    full = sources.load_pacs(tmp_path, image_size=8)
    part = sources.load_pacs(tmp_path, image_size=8, train_share=0.25, test_share=0.5)
    for d in range(4):
        n_cls = 2 if PACS_DOMAINS[d] == "sketch" else 3
        assert torch.bincount(part.y_train[part.domain_train == d], minlength=3).tolist()[:n_cls] == [4] * n_cls
        assert torch.bincount(part.y_test[part.domain_test == d], minlength=3).tolist()[:n_cls] == [2] * n_cls
    # a subset of the same split: every kept image is one the full load has on the same side
    for kept, every in ((part.x_train, full.x_train), (part.x_test, full.x_test)):
        ids = lambda x: set(zip(*(t.tolist() for t in decode_ids(x))))
        assert ids(kept) <= ids(every)
    again = sources.load_pacs(tmp_path, image_size=8, train_share=0.25, test_share=0.5)
    assert torch.equal(part.x_train, again.x_train) and torch.equal(part.x_test, again.x_test)
    tiny = sources.load_pacs(tmp_path, image_size=8, train_share=0.01)
    assert (torch.bincount(tiny.y_train[tiny.domain_train == 0], minlength=3) == 1).all()  # every class kept once
    with pytest.raises(ValueError, match="train_share"):
        check_dataset_params("pacs", {"train_share": 0.0})


def test_domain_loader_options(tmp_path):
    make_pacs(tmp_path, per_class=4, dirname="pacs")  # lowercase dataset folder is accepted
    ds = sources.load_pacs(tmp_path, image_size=16, domains=["sketch", "cartoon"])
    assert tuple(ds.x_train.shape[1:]) == (3, 16, 16)
    assert list(ds.domains) == ["sketch", "cartoon"] and ds.num_classes == 3  # class ids stay global
    d_id, _, _ = decode_ids(ds.x_train)
    assert torch.equal(torch.tensor([3, 1])[ds.domain_train], d_id)
    capped = sources.load_pacs(tmp_path, image_size=8, max_per_domain=5)
    per_domain = torch.bincount(torch.cat([capped.domain_train, capped.domain_test]), minlength=4)
    assert per_domain.tolist() == [5, 5, 5, 5]
    assert torch.equal(capped.x_train, sources.load_pacs(tmp_path, image_size=8, max_per_domain=5).x_train)
    with pytest.raises(ValueError, match="unknown domains"):
        sources.load_pacs(tmp_path, domains=["clipart"])


def test_domain_loader_train_test_folders_and_formats(tmp_path):
    base = tmp_path / "office_caltech_10"
    for dom in ("amazon", "caltech", "dslr"):
        write_png(base / dom / "bike" / "a.png", (10, 20, 30), size=(40, 30))
        write_png(base / dom / "bike" / "b.png", (10, 20, 30))
    write_png(base / "webcam" / "train" / "mug" / "1.jpg", (200, 100, 50), size=(50, 50), fmt="JPEG")
    write_png(base / "webcam" / "train" / "bike" / "2.png", 128, mode="L")
    write_png(base / "webcam" / "test" / "mug" / "3.png", (0, 0, 0))
    ds = sources.load_office_caltech10(tmp_path, image_size=12)
    assert_valid(ds, (3, 12, 12))
    assert ds.classes == ["bike", "mug"]
    web_train = ds.domain_train == 3
    assert ds.y_train[web_train].tolist() == [0, 1] and ds.y_test[ds.domain_test == 3].tolist() == [1]
    grey = ds.x_train[web_train][0]
    assert torch.all(grey == 128 / 255)  # grey PNG becomes equal RGB channels
    assert ds.x_train[web_train][1, 0].mean().item() == pytest.approx(200 / 255, abs=0.03)  # JPEG is lossy


def test_domain_loader_missing_and_empty_domain(tmp_path):
    make_pacs(tmp_path, per_class=2)
    shutil.rmtree(tmp_path / "PACS" / "photo")
    with pytest.raises(DatasetNotFoundError) as info:
        sources.load_pacs(tmp_path)
    assert str(tmp_path / "PACS" / "photo") in str(info.value) and "<domain>/<class_name>" in str(info.value)
    assert sources.load_pacs(tmp_path, domains=["cartoon"], image_size=8).domains == ["cartoon"]
    (tmp_path / "PACS" / "photo" / "dog").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images"):
        sources.load_pacs(tmp_path)


# ------------------------------------------------------------------------------------- real Fashion-MNIST

@pytest.mark.skipif(not REAL_FASHION.is_dir(), reason=f"{REAL_FASHION} absent (apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "SYSTEM_DIRS", {"fashion_mnist": [REAL_FASHION]})
    ds = sources.load_fashion_mnist(tmp_path)
    assert len(ds.y_train) == 60_000 and len(ds.y_test) == 10_000
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10 and len(ds.classes) == 10
    assert torch.bincount(ds.y_train).tolist() == [6000] * 10
    assert ds.x_train.dtype == torch.float32 and ds.x_train.max().item() == 1.0 and ds.x_train.min().item() == 0.0


def test_digits4_reads_the_four_loaders_as_three_channel_domains(tmp_path):
    from scipy.io import savemat

    make_idx_set(tmp_path / "mnist", n_train=40, n_test=20)                  # MNIST; MNIST-M is built from it
    rng = np.random.default_rng(4)
    (tmp_path / "svhn").mkdir()
    X = rng.integers(0, 256, (32, 32, 3, 40), dtype=np.uint8)
    savemat(tmp_path / "svhn" / "train_32x32.mat", {"X": X, "y": (np.arange(40) % 10 + 1).reshape(-1, 1)})
    savemat(tmp_path / "svhn" / "test_32x32.mat", {"X": X[..., :10], "y": (np.arange(10) + 1).reshape(-1, 1)})
    write_usps(tmp_path / "usps" / "usps.bz2", np.arange(20) % 10 + 1, rng.uniform(-1, 1, (20, 256)))
    write_usps(tmp_path / "usps" / "usps.t.bz2", np.arange(10) + 1, rng.uniform(-1, 1, (10, 256)))
    ds = sources.load("digits4", tmp_path, train_share=0.5, seed=0)
    assert_valid(ds, (3, 28, 28))
    assert ds.domains == ["mnist", "mnist_m", "svhn", "usps"]
    # half of each domain's training images, class-stratified; every test image
    assert torch.bincount(ds.domain_train).tolist() == [20, 20, 20, 10]
    assert torch.bincount(ds.domain_test).tolist() == [20, 20, 10, 10]
    for d in range(4):
        assert torch.bincount(ds.y_train[ds.domain_train == d], minlength=10).max() - \
            torch.bincount(ds.y_train[ds.domain_train == d], minlength=10).min() <= 1
    # grey MNIST is repeated over the channels; SVHN's 32x32 images are resized
    mnist = ds.x_test[ds.domain_test == 0]
    assert torch.equal(mnist[:, 0], mnist[:, 1]) and torch.equal(mnist[:, 1], mnist[:, 2])
    assert torch.allclose(mnist[:, 0], sources.load("mnist", tmp_path).x_test[:, 0])
    again = sources.load("digits4", tmp_path, train_share=0.5, seed=0)
    assert torch.equal(again.x_train, ds.x_train)
    assert not torch.equal(sources.load("digits4", tmp_path, train_share=0.5, seed=1).y_train, ds.y_train) or \
        not torch.equal(sources.load("digits4", tmp_path, train_share=0.5, seed=1).x_train, ds.x_train)


def test_digits4_without_a_domain_names_the_missing_files(tmp_path):
    make_idx_set(tmp_path / "mnist", n_train=12, n_test=5)
    with pytest.raises(DatasetNotFoundError, match="svhn"):
        sources.load("digits4", tmp_path)
