"""fedlab_core: a thin, fast PyTorch library for federated learning under data heterogeneity.

The pieces: :mod:`fedlab_core.data` (datasets as tensors, partitions, the DH metric, feature-skew domains),
:mod:`fedlab_core.models`, :mod:`fedlab_core.algorithms` (one file per method), :mod:`fedlab_core.augment`
(data-level plug-ins), :mod:`fedlab_core.engine` (the simulation loop), :mod:`fedlab_core.runs` (configs and
runs), :mod:`fedlab_core.store` (results, the cache, checkpoints, the archive of the book's runs),
:mod:`fedlab_core.verification` (the archive re-run against the code), :mod:`fedlab_core.kernels` (the CPU
kernels pinned, so that numbers are the same on every x86-64 CPU with AVX2) and :mod:`fedlab_core.sweeps` (many
runs, in parallel).
"""
__version__ = "0.1.0"

from . import kernels  # noqa: E402  (first: the kernels are pinned before any library runs one)

kernels.pin()
kernels.exact_sqrt()

from .runs import RunConfig, run  # noqa: E402
from .store import History  # noqa: E402
from .sweeps import sweep  # noqa: E402

__all__ = ["History", "RunConfig", "run", "sweep", "__version__"]
