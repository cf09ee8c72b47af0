"""fedlab_core: a thin, fast PyTorch library for federated learning under data heterogeneity.

The pieces: :mod:`fedlab_core.data` (datasets as tensors, partitions, the DH metric, feature-skew
domains), :mod:`fedlab_core.models`, :mod:`fedlab_core.algorithms` (one file per method),
:mod:`fedlab_core.augment` (data-level plug-ins), :mod:`fedlab_core.engine` (the simulation loop) and
:mod:`fedlab_core.runs` (configs and runs), :mod:`fedlab_core.store` (results, the cache, checkpoints, the archive of
the book's runs and its verification) and :mod:`fedlab_core.sweeps` (many runs, in parallel).
"""
__version__ = "0.1.0"

from .runs import RunConfig, run  # noqa: E402
from .store import History  # noqa: E402
from .sweeps import sweep  # noqa: E402

__all__ = ["History", "RunConfig", "run", "sweep", "__version__"]
