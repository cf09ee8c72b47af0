"""The plots the book uses.

Every function draws with matplotlib, returns the :class:`~matplotlib.figure.Figure`, never calls
``plt.show()`` and accepts an optional ``ax`` to draw into (a new figure is made when it is ``None``).
No backend is chosen here; set ``MPLBACKEND=Agg`` for headless use.

Figures are sized for the book's main column (676 pixels at a 1,280-pixel window): at most :data:`COLUMN`
inches wide, they are shown at their own size, so that the smallest text they draw (:data:`SMALLEST_FONT`)
stays readable; a wider figure would be scaled down to the column, its text with it.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator, NullLocator

from .data.base import Dataset
from .verdicts import OUTCOMES, Verdicts, curve

__all__ = [
    "domain_grid",
    "partition_heatmap",
    "partition_heatmaps",
    "normalize_counts",
    "accuracy_curves",
    "bytes_per_round",
    "client_size_histogram",
    "results_heatmap",
    "delta_heatmap",
    "class_separation",
    "embedding_scatter",
    "offset_grid",
    "umap_embedding",
    "tsne_embedding",
    "channel_distributions",
    "image_panels",
    "image_grid",
    "fit_power_law",
    "scaling_plot",
    "claim_effects",
    "verdict_curves",
]

_MAX_TICK_LABELS = 20
DPI = 100            # pixels per inch of the notebooks' figures (matplotlib's default, which the inline backend keeps)
COLUMN = 6.6         # inches: the widest figure, with the margin a saved figure keeps within the column
SMALLEST_FONT = 7    # points: the smallest text a figure draws, 9.7 pixels at DPI
# the colour of each verdict's label (:data:`~.verdicts.OUTCOMES`): greens held or reached, reds not held, orange
# not reached, and greys, darkest first, for the reasons a claim was not decided
VERDICT_COLOURS = dict(zip(OUTCOMES, ["#2b8a3e", "#37b24d", "#e03131", "#ff8787", "#f76707",
                                      *map(plt.cm.Greys, np.linspace(0.85, 0.35, len(OUTCOMES) - 5))], strict=True))


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
    size = min(0.8, (COLUMN - 1.2) / per_domain)   # inches per image
    fig, ax = _fig_ax(ax, figsize=(per_domain * size + 1.2, len(names) * size + 0.4))
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
                      ax=None, fontsize: float = 10):
    """Client-by-class heatmap (as in DisTrans, Fig. 3): clients on x, classes on y, with a colourbar.

    Each cell is what :func:`normalize_counts` gives for ``normalize``. Beyond ~20 clients (or classes) the
    per-client tick labels are thinned out so 100 clients stay readable. ``fontsize``: the points of every
    text but the title, which is a point larger.
    """
    m = normalize_counts(class_counts, normalize)
    n_classes, n_clients = m.shape
    fig, ax = _fig_ax(ax, figsize=(min(3 + 0.12 * n_clients, COLUMN), min(2 + 0.3 * n_classes, 10)))
    im = ax.imshow(m, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    label = {"class": "fraction of class", "client": "fraction of client's data", None: "samples"}[normalize]
    bar = fig.colorbar(im, ax=ax)
    bar.set_label(label, fontsize=fontsize)
    _sparse_ticks(ax.xaxis, n_clients, ax.set_xticks)
    _sparse_ticks(ax.yaxis, n_classes, ax.set_yticks)
    for each in (ax, bar.ax):
        each.tick_params(labelsize=fontsize)
    ax.set_xlabel("client", fontsize=fontsize)
    ax.set_ylabel("class", fontsize=fontsize)
    if title:
        ax.set_title(title, fontsize=fontsize + 1)
    return fig


def partition_heatmaps(panels: Mapping[str, np.ndarray], ncols: int = 3, normalize: str | None = "class"):
    """Several :func:`partition_heatmap` panels, `ncols` to a row of the column, their text at 8 points:
    ``{title: (clients, classes) counts}``."""
    nrows = -(-len(panels) // ncols)
    ncols = min(ncols, len(panels))
    width = min(3.3, COLUMN / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, (0.6 * width + 0.9) * nrows), layout="constrained",
                             squeeze=False)
    for ax, (title, counts) in zip(axes.flat, panels.items()):
        partition_heatmap(counts, title=title, normalize=normalize, ax=ax, fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    return fig


def _per_round(df, column: str):
    """Rows with ``column`` present, aggregated over seeds: DataFrame indexed by round (mean, min, max)."""
    if column not in df.columns or "round" not in df.columns:
        raise ValueError(f"frame needs 'round' and {column!r} columns, has {list(df.columns)}")
    import pandas as pd

    values = pd.to_numeric(df[column], errors="coerce")  # None (not evaluated, or no such metric) becomes NaN
    d = df.assign(**{column: values})[values.notna()]
    return d.groupby("round")[column].agg(["mean", "min", "max"]).sort_index()


def accuracy_curves(frames: Mapping[str, "pandas.DataFrame"], metric: str = "global_accuracy", ax=None,
                    title: str | None = None):
    """One line of ``metric`` against ``round`` per label; NaN rows are skipped, and a label without any
    value (e.g. the global accuracy of a method with no global model) is left out.

    A frame with several seeds (a ``seed`` column with more than one value) is drawn as the mean line with
    a shaded min-max band.
    """
    fig, ax = _fig_ax(ax)
    for label, df in frames.items():
        g = _per_round(df, metric)
        if g.empty:
            continue
        (line,) = ax.plot(g.index, g["mean"], label=label)
        if "seed" in df.columns and df["seed"].nunique() > 1:
            ax.fill_between(g.index, g["min"], g["max"], color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("round")
    ax.set_ylabel(metric.replace("_", " "))
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def tuning_curves(curves: "pandas.DataFrame", ncols: int = 3, title: str | None = None):
    """Small multiples of a tuning (:meth:`fedlab_core.tuning.Tuning.curves`): per method, the validation score
    against the learning rate (log scale) with one standard error over the tuning seeds as error bars, the chosen
    rate ringed, a rate where a seed diverged (no score) crossed at 0, so a reader sees how sharp each choice is.
    One panel per method, `ncols` to a row."""
    methods = list(dict.fromkeys(curves["method"]))
    if not methods:
        raise ValueError("curves: no methods to draw")
    nrows = -(-len(methods) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(min(2.2, COLUMN / ncols) * ncols, 1.9 * nrows), sharey=True,
                             squeeze=False, layout="constrained")
    for ax, method in zip(axes.flat, methods):
        c = curves[curves["method"] == method]
        ax.errorbar(c["lr"], c["validation"], yerr=c["validation_se"].fillna(0), marker="o", markersize=3,
                    capsize=2, linewidth=1)
        lost = c[c["validation"].isna()]
        ax.plot(lost["lr"], np.zeros(len(lost)), "x", color="tab:red", markersize=6)
        best = c[c["chosen"]]
        ax.plot(best["lr"], best["validation"], "o", markersize=9, markerfacecolor="none", color="black")
        ax.set_xscale("log")
        ax.set_title(method, fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    diverged = "; ×: a seed diverged" if curves["validation"].isna().any() else ""
    fig.supxlabel(f"learning rate (ringed: chosen{diverged})", fontsize=9)
    fig.supylabel("validation client accuracy", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
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


def _annotated_heatmap(values: "pandas.DataFrame", fmt: str, title: str | None, ax, dark,
                       notes: "pandas.DataFrame | None" = None, **imshow):
    """The shared layout of the heatmaps: cells coloured by value, each labelled with ``fmt``, white text
    where ``dark(value)``; a NaN cell blank, or labelled with its text in `notes` (same shape) where it has one."""
    m = values.to_numpy(dtype=float)
    if notes is not None and notes.shape != m.shape:
        raise ValueError(f"notes: shape {notes.shape} differs from the values' {m.shape}")
    text = notes.to_numpy(dtype=object) if notes is not None else np.full(m.shape, "", dtype=object)
    fig, ax = _fig_ax(ax, figsize=(min(1.2 * m.shape[1] + 2.5, COLUMN), 0.38 * m.shape[0] + 1.2))
    im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", **imshow)
    fig.colorbar(im, ax=ax)
    ax.set_xticks(range(m.shape[1]), [str(c) for c in values.columns], rotation=30, ha="right")
    ax.set_yticks(range(m.shape[0]), [str(r) for r in values.index])
    for (i, j), v in np.ndenumerate(m):
        if np.isfinite(v):
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8, color="white" if dark(v) else "black")
        elif text[i, j]:
            ax.text(j, i, str(text[i, j]), ha="center", va="center", fontsize=7, color="black")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def results_heatmap(values: "pandas.DataFrame", title: str | None = None, fmt: str = "{:.2f}", ax=None,
                    notes: "pandas.DataFrame | None" = None):
    """A table of numbers (rows x columns, e.g. algorithms x settings) as an annotated heatmap; a NaN cell is
    blank, or shows its text in `notes` (a table of strings of the same shape, e.g. "diverged")."""
    mid = np.nanmean(values.to_numpy(dtype=float))
    return _annotated_heatmap(values, fmt, title, ax, lambda v: v < mid, notes, cmap="viridis")


def delta_heatmap(values: "pandas.DataFrame", title: str | None = None, fmt: str = "{:+.1f}",
                  limit: float | None = None, ax=None):
    """Signed changes (rows x columns, e.g. algorithms x augmentations: gain over a baseline) as an
    annotated heatmap on a diverging scale centred at zero: gains blue, losses red, no change white.

    limit : the colour scale spans [-limit, limit]; None: the largest absolute value. NaN cells stay blank.
    """
    m = values.to_numpy(dtype=float)
    finite = np.abs(m[np.isfinite(m)])
    if limit is None:
        limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    return _annotated_heatmap(values, fmt, title, ax, lambda v: abs(v) > 0.6 * limit, cmap="RdBu", vmin=-limit,
                              vmax=limit)


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
        ax.set_title(title, fontsize=10)
    return fig


def _as_image(t: torch.Tensor) -> np.ndarray:
    """(C, H, W) tensor to an (H, W) or (H, W, 3) array for imshow."""
    a = t.detach().cpu().numpy()
    return a[0] if a.shape[0] == 1 else np.transpose(a, (1, 2, 0))


def offset_grid(offsets: list[torch.Tensor], examples: list[torch.Tensor], alpha: float,
                initial: list[torch.Tensor] | None = None):
    """Per client: a training image x, (its initial offset t0,) its offset t, (what training changed, t - t0,)
    and the first input channel (1 - alpha) x + alpha t.

    Offsets are drawn on their own colour scale (they are not images and may leave [0, 1]); t0 and t share
    one scale per client, so what moved shows; t - t0 is drawn on a scale symmetric about 0. The shifted
    inputs are clipped to [0, 1] for display only.
    """
    n = len(offsets)
    names = ["image x"] + (["initial t0"] if initial else []) + ["offset t"] + (["t - t0"] if initial else []) \
        + ["(1-a)x + a t"]
    size = min(1.3, (COLUMN - 0.3) / n)   # inches per image
    fig, axes = plt.subplots(len(names), n, figsize=(size * n + 0.3, (size + 0.1) * len(names)), layout="constrained",
                             squeeze=False)
    grey = offsets[0].shape[0] == 1

    def show(ax, t, low, high, cmap="coolwarm"):
        if grey:
            ax.imshow(_as_image(t), cmap=cmap, vmin=low, vmax=high)
        else:  # RGB: the shared range mapped to [0, 1]
            ax.imshow(_as_image(((t - low) / max(high - low, 1e-12)).clamp(0, 1)))

    for c, (t, x) in enumerate(zip(offsets, examples)):
        rows = iter(axes[:, c])
        next(rows).imshow(_as_image(x).clip(0, 1), vmin=0, vmax=1, **({"cmap": "gray"} if grey else {}))
        both = [t] + ([initial[c]] if initial else [])
        low, high = float(min(v.min() for v in both)), float(max(v.max() for v in both))
        if initial:
            show(next(rows), initial[c], low, high)
        show(next(rows), t, low, high)
        if initial:
            delta = t - initial[c]
            span = float(delta.abs().max()) or 1.0
            show(next(rows), delta, -span, span, cmap="PuOr")
        next(rows).imshow(_as_image((1 - alpha) * x + alpha * t).clip(0, 1), vmin=0, vmax=1,
                          **({"cmap": "gray"} if grey else {}))
        axes[0, c].set_title(f"client {c}", fontsize=8)
    for row, name in zip(axes, names):
        row[0].set_ylabel(name, fontsize=8)
        for ax in row:
            ax.set(xticks=[], yticks=[])
    return fig


def umap_embedding(z: np.ndarray, seed: int = 0, n_neighbors: int = 15, min_dist: float = 0.1) -> np.ndarray:
    """UMAP (umap-learn) of representations (n, D) to (n, 2), deterministic for a seed (single-threaded).

    Only the distinct rows are embedded and every copy of a row gets its point: umap-learn's layout is not
    reproducible, even with a fixed ``random_state``, when rows repeat (the same test image seen by several
    clients through one model gives the same representation)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # umap's import-time tqdm notice and numba chatter
        import umap

        distinct, inverse = np.unique(np.asarray(z), axis=0, return_inverse=True)
        reducer = umap.UMAP(n_neighbors=min(n_neighbors, len(distinct) - 1), min_dist=min_dist, random_state=seed,
                            n_jobs=1)
        return reducer.fit_transform(distinct)[inverse.reshape(-1)]


def tsne_embedding(z: np.ndarray, seed: int = 0, perplexity: float = 30.0) -> np.ndarray:
    """t-SNE (scikit-learn's ``TSNE``, PCA start) of representations (n, D) to (n, 2), deterministic for a
    seed (single-threaded). ``perplexity`` is lowered to (n - 1) / 3 for small n, which t-SNE needs."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    z = np.asarray(z, dtype=np.float32)
    if z.ndim != 2 or len(z) < 4:
        raise ValueError(f"tsne_embedding needs at least 4 points of shape (n, D), got {z.shape}")
    perplexity = min(perplexity, (len(z) - 1) / 3)
    with threadpool_limits(1):  # one thread: the same layout on any machine, and no oversubscription
        return TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(z)


# ------------------------------------------------------------------------- distributions, image panels, scaling

def channel_distributions(rows: Mapping[str, np.ndarray], support=None, labels=None, channel_names=None,
                          targets: Mapping[str, np.ndarray] | None = None, log: bool = False,
                          xlabel: str = "intensity"):
    """Per-channel distributions of several groups overlaid, one row of panels per entry of ``rows``.

    Parameters
    ----------
    rows : ``{row title: (K, C, B) array}``: K groups (e.g. clients), C channels, B levels; every entry
        has the same C and B.
    support : (B,) x values of the levels; None: B equally spaced values in [0, 1].
    labels : K names of the groups (one legend, right of the first row); None: "0", "1", ...
    channel_names : C panel titles; None: "R", "G", "B" for 3 channels, "channel 0", ... otherwise.
    targets : ``{row title: (C, B)}``: a distribution drawn over that row's groups as a thick black line.
    log : log-scaled y axis (masses spread over orders of magnitude, e.g. a dark background), showing
        four decades below the largest mass in each panel.

    Returns a figure with ``len(rows) x C`` axes; each axes holds K lines, plus one for its row's target.
    """
    arrays = {title: np.asarray(v, dtype=float) for title, v in rows.items()}
    k, c, b = next(iter(arrays.values())).shape
    x = np.linspace(0.0, 1.0, b) if support is None else np.asarray(support, dtype=float)
    labels = [str(i) for i in range(k)] if labels is None else [str(name) for name in labels]
    if channel_names is None:
        channel_names = ["R", "G", "B"] if c == 3 else [f"channel {i}" for i in range(c)]
    targets = {title: np.asarray(v, dtype=float) for title, v in (targets or {}).items()}
    fig, axes = plt.subplots(len(arrays), c, figsize=(min(3.6 * c + 0.6, COLUMN), 1.9 * len(arrays) + 0.4),
                             layout="constrained", squeeze=False, sharex=True)
    colours = plt.get_cmap("tab10" if k <= 10 else "tab20")
    for r, (title, values) in enumerate(arrays.items()):
        if values.shape != (k, c, b):
            raise ValueError(f"row {title!r} has shape {values.shape}, expected {(k, c, b)}")
        for ch in range(c):
            ax = axes[r, ch]
            for i in range(k):
                ax.plot(x, values[i, ch], color=colours(i % colours.N), linewidth=1.0, alpha=0.85, label=labels[i])
            if title in targets:
                ax.plot(x, targets[title][ch], color="k", linewidth=2.2, label="target")
            if log:
                top = max(values[:, ch].max(), targets[title][ch].max() if title in targets else 0.0)
                ax.set_yscale("log")
                ax.set_ylim(top * 1e-4, top * 2)
            ax.set_title(f"{title}: {channel_names[ch]}" if c > 1 else title, fontsize=8)
            ax.tick_params(labelsize=8)
        axes[r, 0].set_ylabel("mass", fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel, fontsize=8)
    handles = axes[0, 0].get_lines()[:k]
    if targets:  # the legend names the target even when the first row has none
        handles = [*handles, plt.Line2D([], [], color="k", linewidth=2.2, label="target")]
    axes[0, -1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return fig


def image_panels(panels: Mapping[str, Sequence[torch.Tensor]], row_labels: Sequence[str] | None = None,
                 per_row: int = 4, pad: int = 2):
    """Images side by side in titled panels (e.g. before and after a transform), one row per group; as many
    panels to a row of the figure as the column holds with images at least a quarter of an inch wide.

    Parameters
    ----------
    panels : ``{panel title: [row 0 images (n, C, H, W), row 1 images, ...]}``; every panel has the same
        rows. Values are shown on the fixed scale [0, 1] (clipped), so a transform that shrinks the
        intensities shows as a dark panel.
    row_labels : one label per row (e.g. the clients' domains); None: "0", "1", ...
    per_row : images shown per row (the first ones); shorter rows leave white space.
    pad : white pixels between images.

    Returns a figure with one axes per panel, in the order of ``panels``, each showing one mosaic image.
    """
    titles = list(panels)
    n_rows = len(panels[titles[0]])
    row_labels = [str(i) for i in range(n_rows)] if row_labels is None else [str(r) for r in row_labels]
    c, h, w = panels[titles[0]][0].shape[1:]
    ncols = int(min(len(titles), max(1, (COLUMN - 1.0) // (0.25 * per_row + 0.3))))
    size = min(0.75, (COLUMN - 1.0 - 0.3 * ncols) / (ncols * per_row))   # inches per image
    nrows = -(-len(titles) // ncols)
    fig, axes = plt.subplots(nrows, ncols, layout="constrained", squeeze=False,
                             figsize=(ncols * (size * per_row + 0.3) + 1.0, nrows * (size * n_rows + 0.6)))
    for ax in axes.flat[len(titles):]:
        ax.remove()
    for ax, title in zip(axes.flat, titles):
        rows = panels[title]
        if len(rows) != n_rows:
            raise ValueError(f"panel {title!r} has {len(rows)} rows, expected {n_rows}")
        mosaic = np.ones((n_rows * (h + pad) - pad, per_row * (w + pad) - pad, c), dtype=np.float32)
        for r, images in enumerate(rows):
            for j, img in enumerate(images[:per_row]):
                mosaic[r * (h + pad): r * (h + pad) + h, j * (w + pad): j * (w + pad) + w] = \
                    img.detach().float().cpu().clamp(0, 1).permute(1, 2, 0).numpy()
        ax.imshow(mosaic[..., 0] if c == 1 else mosaic, cmap="gray" if c == 1 else None, vmin=0, vmax=1)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([r * (h + pad) + h / 2 for r in range(n_rows)], row_labels if ax in axes[:, 0] else [])
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    return fig


def image_with_histogram(images: Mapping[str, torch.Tensor], bins: int = 64):
    """One image in several versions (e.g. raw and aligned by each variant), each above its intensity
    histogram, with its mean intensity (brightness) marked and written in the title.

    Parameters
    ----------
    images : ``{title: image (C, H, W) in [0, 1]}``; channels are pooled in the histogram, and a colour
        image is shown in colour.
    bins : histogram bins over [0, 1]; the first bin holds the black pixels.

    Returns a figure of two rows (images, histograms on a log scale) and one column per version.
    """
    import textwrap

    titles = list(images)
    fig, axes = plt.subplots(2, len(titles), figsize=(min(1.9 * len(titles) + 0.4, COLUMN), 4.0),
                             layout="constrained", squeeze=False, gridspec_kw={"height_ratios": [1.2, 1]}, sharey="row")
    edges = np.linspace(0, 1, bins + 1)
    for j, title in enumerate(titles):
        img = images[title].detach().float().cpu()
        values = img.flatten().clamp(0, 1).numpy()
        shown = img.clamp(0, 1).permute(1, 2, 0).numpy()
        axes[0, j].imshow(shown[..., 0] if img.shape[0] == 1 else shown, cmap="gray", vmin=0, vmax=1)
        axes[0, j].set_title(f"{textwrap.fill(title, 14)}\nbrightness {values.mean():.3f}", fontsize=8)
        axes[0, j].set_axis_off()
        counts, _ = np.histogram(values, bins=edges)
        axes[1, j].bar(edges[:-1], counts / counts.sum(), width=1 / bins, align="edge", color="tab:blue")
        axes[1, j].axvline(values.mean(), color="tab:red", linewidth=1)
        axes[1, j].set_yscale("log")
        axes[1, j].set_xlim(0, 1)
        axes[1, j].set_xlabel("intensity", fontsize=8)
        axes[1, j].tick_params(labelsize=7)
    axes[1, 0].set_ylabel("share of pixels", fontsize=8)
    return fig


def image_grid(images: Sequence[Sequence[torch.Tensor]], row_labels: Sequence[str] | None = None,
               col_labels: Sequence[str] | None = None, value_range=(0.0, 1.0), size: float = 1.1):
    """A table of images, e.g. one source image per row and one transform of it per column.

    Parameters
    ----------
    images : rows of (C, H, W) tensors (C = 1 or 3), every row of the same length.
    row_labels, col_labels : labels on the left of each row and above each column; None: none.
    value_range : ``(low, high)`` shown as black and white, values beyond clipped; one pair for every
        column, or a list of pairs, one per column (standardised images need e.g. ``(-2.5, 2.5)``,
        raw images ``(0, 1)``). Every image of a column shares its scale, so shifts show.
    size : inches per image, at most what fits the column (:data:`COLUMN`).

    Returns a figure with one axes per image, in row-major order.
    """
    n_rows, n_cols = len(images), len(images[0])
    if any(len(row) != n_cols for row in images):
        raise ValueError(f"every row needs {n_cols} images, got rows of {[len(row) for row in images]}")
    ranges = [tuple(value_range)] * n_cols if np.ndim(value_range) == 1 else [tuple(r) for r in value_range]
    if len(ranges) != n_cols:
        raise ValueError(f"value_range: expected one (low, high) pair or {n_cols}, got {len(ranges)}")
    size = min(size, (COLUMN - 0.8) / n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(size * n_cols + 0.8, size * n_rows + 0.4),
                             layout="constrained", squeeze=False)
    for r, row in enumerate(images):
        for j, img in enumerate(row):
            low, high = ranges[j]
            shown = ((img.detach().float().cpu() - low) / (high - low)).clamp(0, 1)  # (C, H, W) in [0, 1]
            ax = axes[r, j]
            ax.imshow(_as_image(shown), cmap="gray" if shown.shape[0] == 1 else None, vmin=0, vmax=1)
            ax.set(xticks=[], yticks=[])
            if r == 0 and col_labels is not None:
                ax.set_title(str(col_labels[j]), fontsize=8)
            if j == 0 and row_labels is not None:
                ax.set_ylabel(str(row_labels[r]), fontsize=8)
    return fig


def fit_power_law(x, y) -> tuple[float, float]:
    """Least-squares fit of ``y = a * x**k`` on log-log axes: returns ``(k, a)``; needs positive x, y."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("fit_power_law needs at least two points with positive x and y")
    k, log_a = np.polyfit(np.log(x), np.log(y), 1)
    return float(k), float(np.exp(log_a))


def scaling_plot(series: Mapping[str, tuple], claimed: float | None = None, ax=None, xlabel: str = "x",
                 ylabel: str = "seconds", title: str | None = None, colors: Mapping[str, str] | None = None):
    """Measured cost against a size on log-log axes, with fitted power laws and a claimed exponent.

    Parameters
    ----------
    series : ``{label: (x values, y values)}``; each is drawn as points and its fitted power law
        (:func:`fit_power_law`) as a line, the exponent in the legend.
    claimed : an exponent claimed for this size (e.g. 2 for O(d^2)): a dashed grey line of that slope
        through the first point of the first series.
    colors : a colour per label, to keep a series' colour across panels; None: matplotlib's cycle.

    The x ticks are the measured sizes. Returns the figure; ``ax.lines`` holds the fitted line of each
    series in order, then the claimed slope.
    """
    fig, ax = _fig_ax(ax, figsize=(4.5, 3.5))
    first, sizes = None, set()
    for label, (x, y) in series.items():
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        k, a = fit_power_law(x, y)
        points = ax.scatter(x, y, s=18, zorder=3, color=(colors or {}).get(label))
        grid = np.geomspace(x.min(), x.max(), 50)
        ax.plot(grid, a * grid ** k, color=points.get_facecolor()[0], label=f"{label}: slope {k:.2f}")
        first = first or (x[0], y[0], x.max())
        sizes.update(x.tolist())
    if claimed is not None and first is not None:
        x0, y0, x1 = first
        grid = np.geomspace(x0, x1, 50)
        ax.plot(grid, y0 * (grid / x0) ** claimed, color="grey", linestyle="--", label=f"claimed slope {claimed:g}")
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
    ax.set_xticks(sorted(sizes), [f"{v:g}" for v in sorted(sizes)], fontsize=7)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def _cut(claim: str, width: int) -> str:
    """A claim's text without its bracketed asides, cut between words to at most `width` characters, two
    thirds from its start (which names the table and the claim) and one from its end (often what differs
    between a table's rows)."""
    import re

    text = re.sub(r"\s*\([^()]*\)", "", claim)
    if len(text) <= width:
        return text
    tail = width // 3
    return text[:width - tail - 4].rsplit(" ", 1)[0] + " ... " + text[-tail - 1:].split(" ", 1)[-1]


def claim_effects(effects: "pandas.DataFrame", label_width: int = 64):
    """Every judged claim's effect with the interval the rule decided on, one row per claim (its text without
    its bracketed asides, cut in the middle to `label_width` characters), one panel per paper in the order of
    ``effects``, a line at zero; coloured by the verdict's category (:data:`VERDICT_COLOURS`; a category it
    does not list by the verdict's outcome).

    effects : the frame of :func:`fedlab_core.report.effects` (paper, claim, effect, low, high, outcome,
        category); a claim without an interval is a dot alone.

    The x axis is linear within ±0.1, where most differences of accuracy lie, and logarithmic beyond, so that an
    effect of another size (a loss, an exponent) shares it. Returns the figure, :data:`COLUMN` wide; each panel
    holds one dot per claim, in its ``collections[-1]``.
    """
    papers = list(dict.fromkeys(effects["paper"]))
    if not papers:
        raise ValueError("effects: no claims to draw")
    sizes = [int((effects["paper"] == p).sum()) for p in papers]
    fig, axes = plt.subplots(len(papers), 1, figsize=(COLUMN, 0.125 * sum(sizes) + 0.45 * len(papers) + 0.9),
                             height_ratios=sizes, sharex=True, layout="constrained", squeeze=False)
    shown = {}
    for ax, paper in zip(axes[:, 0], papers):
        rows = effects[effects["paper"] == paper]
        keys = [c if c in VERDICT_COLOURS else o for c, o in zip(rows["category"], rows["outcome"])]
        colours = [VERDICT_COLOURS.get(k, "0.5") for k in keys]
        y = np.arange(len(rows))
        ax.axvline(0, color="0.3", linewidth=0.8)
        ax.hlines(y, rows["low"].fillna(rows["effect"]), rows["high"].fillna(rows["effect"]), colors=colours,
                  linewidth=2)
        ax.scatter(rows["effect"], y, c=colours, s=12, zorder=3)
        ax.set_yticks(y, [_cut(c, label_width) for c in rows["claim"]])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.tick_params(labelsize=SMALLEST_FONT, labelbottom=True)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{paper}: {len(rows)} claim{'s' if len(rows) != 1 else ''}", loc="left", fontsize=9)
        shown.update(dict(zip(keys, colours)))
    ax.set_xscale("symlog", linthresh=0.1)
    ticks = (-1, -0.3, -0.1, -0.05, 0, 0.05, 0.1, 0.3, 1)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("effect (bar: the interval the rule decided on)", fontsize=8)
    order_ = sorted(shown, key=lambda k: OUTCOMES.index(k) if k in OUTCOMES else len(OUTCOMES))
    fig.legend(handles=[plt.Line2D([], [], color=shown[k], marker="o", linewidth=2, label=k) for k in order_],
               loc="outside upper center", ncols=3, fontsize=SMALLEST_FONT)
    return fig


def verdict_curves(found: "Verdicts", metric: str = "mean_client_accuracy", ncols: int = 2,
               names: tuple[str, str] = ("A", "B")):
    """The accuracy curves behind every verdict of a page (`found`) judged on training runs: one panel per verdict, the claimed
    better side (solid) and the other (dashed), mean over seeds with a min-max band (where runs stopped at
    different rounds: over the seeds evaluated at that round); the panel's title is the claim and its
    verdict. Returns the figure, or None when no verdict carries runs."""
    import textwrap

    import pandas as pd

    shown = [(i, v) for i, v in enumerate(found.items, 1) if v.runs]
    if not shown:
        return None
    nrows = -(-len(shown) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(min(4.2, COLUMN / ncols) * ncols, 3.0 * nrows),
                             layout="constrained", squeeze=False)
    for ax, (i, v) in zip(axes.flat, shown):
        for runs, name, style in zip(v.runs, names, ("-", "--")):
            # rounds x seeds; a run that stopped once converged leaves NaN after its last round, and the
            # mean and band are over the seeds still running
            values = pd.DataFrame({k: pd.Series(curve(h, metric)) for k, h in enumerate(runs)}).sort_index()
            (line,) = ax.plot(values.index, values.mean(axis=1), style, marker=".", label=name)
            ax.fill_between(values.index, values.min(axis=1), values.max(axis=1), color=line.get_color(),
                            alpha=0.2, linewidth=0)
        ax.set_title(textwrap.fill(f"{i}. {v.claim}", 44) + "\n" + textwrap.fill(v.label, 44), fontsize=8)
        ax.set_xlabel("round", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    fig.supylabel(metric.replace("_", " "), fontsize=9)
    return fig
