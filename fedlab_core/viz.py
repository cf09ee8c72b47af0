"""The plots the book uses.

Every function draws with matplotlib, returns the :class:`~matplotlib.figure.Figure`, never calls
``plt.show()`` and accepts an optional ``ax`` to draw into (a new figure is made when it is ``None``).
No backend is chosen here; set ``MPLBACKEND=Agg`` for headless use.
"""
from __future__ import annotations

from typing import Mapping

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from .data.base import Dataset

__all__ = [
    "domain_grid",
    "partition_heatmap",
    "partition_heatmaps",
    "normalize_counts",
    "accuracy_curves",
    "bytes_per_round",
    "client_size_histogram",
    "results_heatmap",
    "class_separation",
    "embedding_scatter",
    "offset_grid",
    "umap_embedding",
]

_MAX_TICK_LABELS = 20


def _fig_ax(ax=None, figsize=(6.0, 4.0)):
    """Return ``(fig, ax)``: the given axes and its figure, or a new figure with one axes."""
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    return ax.figure, ax


def domain_grid(ds: Dataset, per_domain: int = 8, seed: int = 0, ax=None):
    """A mosaic of random training images: one row per domain, labelled with the domain name.

    Datasets without domains give a single row labelled with the dataset name. Domains with fewer than
    ``per_domain`` images leave the rest of their row blank. Drawn as one image on one axes.
    """
    x = ds.x_train
    c, h, w = x.shape[1:]
    if ds.domains is None or ds.domain_train is None:
        names, ids = [ds.name], torch.zeros(len(x), dtype=torch.int64)
    else:
        names, ids = list(ds.domains), ds.domain_train
    gen = torch.Generator().manual_seed(seed)
    pad = 2
    mosaic = np.ones((len(names) * (h + pad) - pad, per_domain * (w + pad) - pad, c), dtype=np.float32)
    for r in range(len(names)):
        idx = torch.nonzero(ids == r).flatten()
        pick = idx[torch.randperm(len(idx), generator=gen)[:per_domain]]
        for k, img in enumerate(x[pick].permute(0, 2, 3, 1).numpy()):
            mosaic[r * (h + pad): r * (h + pad) + h, k * (w + pad): k * (w + pad) + w] = img
    fig, ax = _fig_ax(ax, figsize=(per_domain * 0.8 + 1.2, len(names) * 0.8 + 0.4))
    ax.imshow(mosaic[..., 0] if c == 1 else mosaic, cmap="gray" if c == 1 else None, vmin=0, vmax=1)
    ax.set_yticks([r * (h + pad) + h / 2 for r in range(len(names))], names)
    ax.set_xticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return fig


def normalize_counts(class_counts: np.ndarray, normalize: str | None = "class") -> np.ndarray:
    """The (classes, clients) matrix :func:`partition_heatmap` draws from (clients, classes) counts.

    ``"class"``: fraction of each class's samples held by each client (each row sums to 1);
    ``"client"``: fraction of each client's samples in each class (each column sums to 1);
    ``None``: raw counts. Empty classes / clients give zeros.
    """
    m = np.asarray(class_counts, dtype=np.float64).T
    if normalize is None:
        return m
    if normalize not in ("class", "client"):
        raise ValueError(f"normalize must be 'class', 'client' or None, got {normalize!r}")
    axis = 1 if normalize == "class" else 0
    total = m.sum(axis=axis, keepdims=True)
    return np.divide(m, total, out=np.zeros_like(m), where=total > 0)


def _sparse_ticks(axis, n: int, set_ticks) -> None:
    if n <= _MAX_TICK_LABELS:
        set_ticks(range(n))
    else:
        axis.set_major_locator(MaxNLocator(nbins=10, integer=True))


def partition_heatmap(class_counts: np.ndarray, title: str | None = None, normalize: str | None = "class",
                      ax=None):
    """Client-by-class heatmap (as in DisTrans, Fig. 3): clients on x, classes on y, with a colourbar.

    Each cell is what :func:`normalize_counts` gives for ``normalize``. Beyond ~20 clients (or classes) the
    per-client tick labels are thinned out so 100 clients stay readable.
    """
    m = normalize_counts(class_counts, normalize)
    n_classes, n_clients = m.shape
    fig, ax = _fig_ax(ax, figsize=(min(3 + 0.12 * n_clients, 14), min(2 + 0.3 * n_classes, 10)))
    im = ax.imshow(m, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    label = {"class": "fraction of class", "client": "fraction of client's data", None: "samples"}[normalize]
    fig.colorbar(im, ax=ax, label=label)
    _sparse_ticks(ax.xaxis, n_clients, ax.set_xticks)
    _sparse_ticks(ax.yaxis, n_classes, ax.set_yticks)
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    if title:
        ax.set_title(title)
    return fig


def partition_heatmaps(panels: Mapping[str, np.ndarray], ncols: int = 5, normalize: str | None = "class"):
    """Several :func:`partition_heatmap` panels side by side: ``{title: (clients, classes) counts}``."""
    nrows = -(-len(panels) // ncols)
    ncols = min(ncols, len(panels))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols, 2.9 * nrows), layout="constrained", squeeze=False)
    for ax, (title, counts) in zip(axes.flat, panels.items()):
        partition_heatmap(counts, title=title, normalize=normalize, ax=ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    return fig


def _per_round(df, column: str):
    """Rows with ``column`` present, aggregated over seeds: DataFrame indexed by round (mean, min, max)."""
    if column not in df.columns or "round" not in df.columns:
        raise ValueError(f"frame needs 'round' and {column!r} columns, has {list(df.columns)}")
    d = df[df[column].notna()]
    return d.groupby("round")[column].agg(["mean", "min", "max"]).sort_index()


def accuracy_curves(frames: Mapping[str, "pandas.DataFrame"], metric: str = "global_accuracy", ax=None,
                    title: str | None = None):
    """One line of ``metric`` against ``round`` per label; NaN rows are skipped.

    A frame with several seeds (a ``seed`` column with more than one value) is drawn as the mean line with
    a shaded min-max band.
    """
    fig, ax = _fig_ax(ax)
    for label, df in frames.items():
        g = _per_round(df, metric)
        (line,) = ax.plot(g.index, g["mean"], label=label)
        if "seed" in df.columns and df["seed"].nunique() > 1:
            ax.fill_between(g.index, g["min"], g["max"], color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("round")
    ax.set_ylabel(metric.replace("_", " "))
    ax.legend()
    if title:
        ax.set_title(title)
    return fig


def bytes_per_round(frames: Mapping[str, "pandas.DataFrame"], ax=None):
    """Communication per round: ``bytes_up + bytes_down`` in MB (1e6 bytes), one line per label.

    Several seeds are averaged per round.
    """
    fig, ax = _fig_ax(ax)
    for label, df in frames.items():
        d = df.assign(_mb=(df["bytes_up"] + df["bytes_down"]) / 1e6)
        g = _per_round(d, "_mb")
        ax.plot(g.index, g["mean"], marker="o", markersize=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round (up + down)")
    ax.legend()
    return fig


def client_size_histogram(class_counts: np.ndarray, ax=None):
    """Histogram of samples per client (quantity skew); accepts (clients, classes) counts or 1-D sizes."""
    counts = np.asarray(class_counts)
    sizes = counts.sum(axis=1) if counts.ndim == 2 else counts
    fig, ax = _fig_ax(ax)
    ax.hist(sizes, bins=int(np.clip(len(sizes) // 3, 5, 30)), color="tab:blue", edgecolor="white")
    ax.axvline(sizes.mean(), color="k", linestyle="--", linewidth=1, label=f"mean = {sizes.mean():.0f}")
    ax.set_xlabel("samples per client")
    ax.set_ylabel("clients")
    ax.legend()
    return fig


def results_heatmap(values: "pandas.DataFrame", title: str | None = None, fmt: str = "{:.2f}", ax=None):
    """A table of numbers (rows x columns, e.g. algorithms x settings) as an annotated heatmap."""
    m = values.to_numpy(dtype=float)
    fig, ax = _fig_ax(ax, figsize=(1.2 * m.shape[1] + 2.5, 0.38 * m.shape[0] + 1.2))
    im = ax.imshow(m, aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax)
    ax.set_xticks(range(m.shape[1]), [str(c) for c in values.columns], rotation=30, ha="right")
    ax.set_yticks(range(m.shape[0]), [str(r) for r in values.index])
    mid = np.nanmean(m)
    for (i, j), v in np.ndenumerate(m):
        ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8, color="white" if v < mid else "black")
    if title:
        ax.set_title(title)
    return fig


def class_separation(points: np.ndarray, labels: np.ndarray) -> float:
    """Silhouette score of points (n, d) grouped by label: 1 separated, 0 overlapping, < 0 mixed up."""
    from sklearn.metrics import silhouette_score

    return float(silhouette_score(points, labels))


def embedding_scatter(points: np.ndarray, labels: np.ndarray, ax=None, title: str | None = None):
    """2-D points (n, 2), e.g. a UMAP of representations, coloured by label, with a legend of labels."""
    fig, ax = _fig_ax(ax, figsize=(4.5, 4.5))
    cmap = plt.get_cmap("tab10" if len(np.unique(labels)) <= 10 else "tab20")
    for i, label in enumerate(np.unique(labels)):
        keep = labels == label
        ax.scatter(points[keep, 0], points[keep, 1], s=4, color=cmap(i % cmap.N), label=str(label), alpha=0.7)
    ax.set(xticks=[], yticks=[], xlabel="component 1", ylabel="component 2")
    ax.legend(markerscale=3, fontsize=7, loc="best", title="class", title_fontsize=7)
    if title:
        ax.set_title(title)
    return fig


def _as_image(t: torch.Tensor) -> np.ndarray:
    """(C, H, W) tensor to an (H, W) or (H, W, 3) array for imshow."""
    a = t.detach().cpu().numpy()
    return a[0] if a.shape[0] == 1 else np.transpose(a, (1, 2, 0))


def offset_grid(offsets: list[torch.Tensor], examples: list[torch.Tensor], alpha: float):
    """Per client: a training image x, its offset t, and the first input channel (1 - alpha) x + alpha t.

    Offsets are drawn on their own colour scale (they are not images and may leave [0, 1]); the shifted
    inputs are clipped to [0, 1] for display only.
    """
    n = len(offsets)
    fig, axes = plt.subplots(3, n, figsize=(1.3 * n, 4.2), layout="constrained", squeeze=False)
    gray = dict(cmap="gray") if offsets[0].shape[0] == 1 else {}
    for c, (t, x) in enumerate(zip(offsets, examples)):
        axes[0, c].imshow(_as_image(x).clip(0, 1), vmin=0, vmax=1, **gray)
        shown = t if t.shape[0] == 1 else (t - t.min()) / (t.max() - t.min()).clamp(min=1e-12)  # RGB: own range
        axes[1, c].imshow(_as_image(shown), cmap="coolwarm" if t.shape[0] == 1 else None)
        axes[2, c].imshow(_as_image((1 - alpha) * x + alpha * t).clip(0, 1), vmin=0, vmax=1, **gray)
        axes[0, c].set_title(f"client {c}", fontsize=8)
    for row, name in zip(axes, ("image x", "offset t", "(1-a)x + a t")):
        row[0].set_ylabel(name, fontsize=8)
        for ax in row:
            ax.set(xticks=[], yticks=[])
    return fig


def umap_embedding(z: np.ndarray, seed: int = 0, n_neighbors: int = 15, min_dist: float = 0.1) -> np.ndarray:
    """UMAP (umap-learn) of representations (n, D) to (n, 2), deterministic for a seed (single-threaded)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # umap's import-time tqdm notice and numba chatter
        import umap

        reducer = umap.UMAP(n_neighbors=n_neighbors, min_dist=min_dist, random_state=seed, n_jobs=1)
        return reducer.fit_transform(np.asarray(z))
