import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("MPLBACKEND", "Agg")
# the kernels and processes the tests start compute on one thread each, like the tests themselves (below): the
# smoke book's chapters run beside the tests, and more threads than cores would only wait on each other
os.environ.setdefault("OMP_NUM_THREADS", "1")

from fedlab_core import RunConfig  # noqa: E402

torch.set_num_threads(1)  # tests compare numbers, not speed; one thread keeps them stable and light


@pytest.fixture
def tiny():
    """A run small enough for a unit test: real 8x8 digits, an MLP, four clients, three rounds."""
    return RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=3, batch_size=32, lr=0.1, local_epochs=1,
                     seed=0)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING, logger="fedlab_core")


class TinyBN(nn.Module):
    """A model with batch norm, for checks on how running statistics travel (64 inputs, 10 classes)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 10)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x.flatten(1)))))


@pytest.fixture(autouse=True, scope="session")
def _the_repositorys_archive_is_never_written():
    """Only the book profile writes to the archive; a test that leaked FEDLAB_ARCHIVE=write would add its runs.
    Nor do the tests write the committed chapter timings (a book-profile execution of a test book would)."""
    from fedlab_core.book import TIMINGS
    from fedlab_core.store import ARCHIVE_DIR

    os.environ.pop("FEDLAB_ARCHIVE", None)
    before = set(os.listdir(ARCHIVE_DIR)) if ARCHIVE_DIR.exists() else set()
    timings = TIMINGS.read_bytes() if TIMINGS.exists() else None
    yield
    after = set(os.listdir(ARCHIVE_DIR)) if ARCHIVE_DIR.exists() else set()
    assert after == before, f"the tests wrote into the repository's archive: {sorted(after - before)[:5]}"
    assert (TIMINGS.read_bytes() if TIMINGS.exists() else None) == timings, f"the tests wrote {TIMINGS}"


# ------------------------------------------------------------------ the smoke book, built beside the other tests
# Executing every notebook with the smoke profile takes minutes, two chapters at a time, while most tests run
# on one core. So the book is built from the start of the session in a process of its own, with the
# environment the session started with (a test that sets a variable while it runs cannot reach the chapters),
# and the other tests run while its chapters execute; then come the tests that read the book, and last those
# marked `every_core`, which would only compete with the build for the cores.
BUILD_SMOKE_BOOK = """
import sys
from pathlib import Path
from fedlab_core import book
where, notebooks = Path(sys.argv[1]), Path(sys.argv[2])
book_dir = book.stage(where)
executed = book.execute("smoke", notebooks, book_dir / "chapters", book_dir / "_toc.yml", jobs=book.JOBS["smoke"])
missing = sorted({p.stem for p in notebooks.glob("*.ipynb")} - set(executed))
if missing:
    sys.exit(f"the smoke build executed no {missing}")
book.write_status(book_dir / "chapters", book_dir / "_toc.yml")
book.write_labs(book_dir)
print(book.build_html(book_dir, where / "_config.yml"))
"""
_SMOKE_BOOK: dict = {}


def _start_smoke_book() -> None:
    if not _SMOKE_BOOK:
        where = Path(tempfile.mkdtemp(prefix="fedlab-smoke-book-"))
        log = (where / "build.log").open("w")
        root = Path(__file__).resolve().parents[1]
        process = subprocess.Popen([sys.executable, "-c", BUILD_SMOKE_BOOK, str(where), str(root / "notebooks")],
                                   cwd=root, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        _SMOKE_BOOK.update(where=where, log=log, process=process)


@pytest.hookimpl(trylast=True)   # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config, items):
    def reads(item):
        return "smoke_book" in getattr(item, "fixturenames", ())
    if any(map(reads, items)) and not config.option.collectonly:
        def rank(item):
            return 2 if item.get_closest_marker("every_core") else 1 if reads(item) else 0
        items.sort(key=rank)     # stable: each group keeps its order
        _start_smoke_book()


def pytest_sessionfinish(session):
    if _SMOKE_BOOK:
        if _SMOKE_BOOK["process"].poll() is None:
            print("\nwaiting for the smoke book's build, started in the background, to end")
        _SMOKE_BOOK["process"].wait()
        _SMOKE_BOOK["log"].close()
        shutil.rmtree(_SMOKE_BOOK["where"], ignore_errors=True)


@pytest.fixture(scope="session")
def smoke_book():
    """Every notebook executed with the smoke profile, and the HTML book built from them: (the book, its HTML)."""
    _start_smoke_book()
    where, process = _SMOKE_BOOK["where"], _SMOKE_BOOK["process"]
    if process.wait() != 0:
        tail = (where / "build.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"the smoke book's build failed (exit {process.returncode}):\n{tail}", pytrace=False)
    index = Path((where / "build.log").read_text().strip().splitlines()[-1])
    return where / "book", index.parent
