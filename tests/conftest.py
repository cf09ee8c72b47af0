import logging
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("MPLBACKEND", "Agg")

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
