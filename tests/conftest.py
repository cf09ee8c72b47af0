import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
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
# Executing every notebook with the smoke profile takes minutes, two chapters at a time, while the other tests
# run. So the book is built from the start of the session in a process of its own, with the environment the
# session started with (a test that sets a variable while it runs cannot reach the chapters); then come the
# tests that read the book, and last those marked `every_core`. With pytest-xdist's workers (`make test` runs
# two), the build is shared: the controlling process names its folder, the first worker starts it, and a
# worker reads it once the build has written its exit status there.
SHARED = "FEDLAB_SMOKE_BOOK"   # the build's folder, named for the session's workers
BUILD_SMOKE_BOOK = """
import os
import sys
import traceback
from pathlib import Path
where, notebooks = Path(sys.argv[1]), Path(sys.argv[2])
status = 1
try:
    from fedlab_core import book
    book_dir = book.stage(where)
    executed = book.execute("smoke", notebooks, book_dir / "chapters", book_dir / "_toc.yml", jobs=book.JOBS["smoke"])
    missing = sorted({p.stem for p in notebooks.glob("*.ipynb")} - set(executed))
    if missing:
        raise RuntimeError(f"the smoke build executed no {missing}")
    book.write_status(book_dir / "chapters", book_dir / "_toc.yml")
    book.write_labs(book_dir)
    index = book.build_html(book_dir, where / "_config.yml")
    (where / "index").write_text(str(index))
    status = 0
except BaseException:
    traceback.print_exc()
finally:
    (where / "status.part").write_text(str(status))
    os.replace(where / "status.part", where / "status")
sys.exit(status)
"""
_SMOKE_BOOK: dict = {}
BUILD_WAIT = 3600   # seconds a worker waits for a build another worker started


def pytest_configure(config):
    if not hasattr(config, "workerinput"):    # the controlling process (or a run without workers)
        os.environ[SHARED] = tempfile.mkdtemp(prefix="fedlab-smoke-book-")


def pytest_unconfigure(config):
    where = None if hasattr(config, "workerinput") else os.environ.pop(SHARED, None)
    if where:
        shutil.rmtree(where, ignore_errors=True)


def _start_smoke_book() -> None:
    if not _SMOKE_BOOK:
        where = Path(os.environ[SHARED])
        _SMOKE_BOOK["where"] = where
        if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":   # the first worker, or the only process
            log = (where / "build.log").open("w")
            root = Path(__file__).resolve().parents[1]
            process = subprocess.Popen([sys.executable, "-c", BUILD_SMOKE_BOOK, str(where), str(root / "notebooks")],
                                       cwd=root, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
            _SMOKE_BOOK.update(log=log, process=process)


@pytest.hookimpl(trylast=True)   # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config, items):
    def reads(item):
        return "smoke_book" in getattr(item, "fixturenames", ())
    if any(map(reads, items)) and not config.option.collectonly:
        def rank(item):
            return 2 if item.get_closest_marker("every_core") else 1 if reads(item) else 0
        items.sort(key=rank)     # stable: each group keeps its order (every worker collects the same order)
        _start_smoke_book()


def pytest_sessionfinish(session):
    if "process" in _SMOKE_BOOK:
        if _SMOKE_BOOK["process"].poll() is None:
            print("\nwaiting for the smoke book's build, started in the background, to end")
        _SMOKE_BOOK["process"].wait()
        _SMOKE_BOOK["log"].close()


@pytest.fixture(scope="session")
def smoke_book():
    """Every notebook executed with the smoke profile, and the HTML book built from them: (the book, its HTML)."""
    _start_smoke_book()
    where = _SMOKE_BOOK["where"]
    if "process" in _SMOKE_BOOK:
        _SMOKE_BOOK["process"].wait()
    waited = time.monotonic()
    while not (where / "status").exists():
        if time.monotonic() - waited > BUILD_WAIT:
            pytest.fail(f"the smoke book's build, started by another worker, did not end in {BUILD_WAIT} s",
                        pytrace=False)
        time.sleep(2)
    status = (where / "status").read_text()
    if status != "0":
        tail = (where / "build.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"the smoke book's build failed (exit {status}):\n{tail}", pytrace=False)
    index = Path((where / "index").read_text())
    return where / "book", index.parent
