import logging
import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")

from fedlab_core import RunConfig  # noqa: E402

torch.set_num_threads(1)  # tests compare numbers, not speed; one thread keeps them stable and light


@pytest.fixture
def tiny():
    """A run small enough for a unit test: real 8x8 digits, an MLP, four clients, three rounds."""
    return RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=3, batch_size=32, lr=0.1, seed=0)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.WARNING, logger="fedlab_core")
