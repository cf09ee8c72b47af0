"""Tests for the book's plotting helpers (headless, Agg backend)."""
import matplotlib

matplotlib.use("Agg")  # before pyplot draws anything; tests only

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fedlab_core import viz  # noqa: E402
from fedlab_core.data.base import Dataset  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _ds(channels=3, domains=("a", "b", "c")):
    g = torch.Generator().manual_seed(0)
    n = 60
    ds = Dataset(torch.rand(n, channels, 12, 10, generator=g), torch.randint(0, 4, (n,), generator=g),
                 torch.rand(8, channels, 12, 10), torch.zeros(8, dtype=torch.int64), 4, "toy")
    if domains:
        ds.domains = list(domains)
        ds.domain_train = torch.arange(n) % len(domains)
    return ds


def _counts(clients=10, classes=5, seed=0):
    return np.random.default_rng(seed).integers(0, 50, size=(clients, classes))


def _frame(seeds=(0,), rounds=5, nan_every=0):
    rows = []
    for s in seeds:
        for r in range(rounds):
            acc = np.nan if nan_every and r % nan_every == 1 else 0.1 * r + 0.01 * s
            rows.append({"round": r, "seed": s, "global_accuracy": acc, "bytes_up": 1e6 * (r + 1), "bytes_down": 2e6})
    return pd.DataFrame(rows)


def test_domain_grid_rows_labelled():
    fig = viz.domain_grid(_ds(), per_domain=4)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert len(ax.images) == 1
    assert ax.images[0].get_array().shape == (3 * 12 + 2 * 2, 4 * 10 + 3 * 2, 3)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]


def test_domain_grid_without_domains_and_grey():
    fig = viz.domain_grid(_ds(channels=1, domains=None), per_domain=5)
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (12, 5 * 10 + 4 * 2)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["toy"]


@pytest.mark.parametrize("normalize", ["class", "client", None])
def test_partition_heatmap_values(normalize):
    counts = _counts()
    counts[3] = 0  # an empty client
    fig = viz.partition_heatmap(counts, title="t", normalize=normalize)
    assert isinstance(fig, Figure) and len(fig.axes) == 2  # heatmap + colourbar
    expected = viz.normalize_counts(counts, normalize)
    assert expected.shape == (5, 10)
    np.testing.assert_allclose(np.asarray(fig.axes[0].images[0].get_array()), expected)
    if normalize == "class":
        np.testing.assert_allclose(expected.sum(1), 1.0)
        np.testing.assert_allclose(expected, (counts / counts.sum(0)).T)
    elif normalize == "client":
        np.testing.assert_allclose(expected[:, 3], 0.0)
        np.testing.assert_allclose(np.delete(expected.sum(0), 3), 1.0)
    else:
        np.testing.assert_allclose(expected, counts.T)
    assert fig.axes[0].get_title() == "t"


def test_partition_heatmap_many_clients_thins_ticks():
    fig = viz.partition_heatmap(_counts(clients=100, classes=10))
    fig.canvas.draw()
    labels = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert 0 < len(labels) <= 20
    with pytest.raises(ValueError):
        viz.normalize_counts(_counts(), "rows")


def test_partition_heatmap_into_given_ax():
    fig, axes = plt.subplots(1, 2)
    out = viz.partition_heatmap(_counts(), ax=axes[1])
    assert out is fig and len(axes[1].images) == 1 and len(axes[0].images) == 0


def test_accuracy_curves_lines_and_band():
    frames = {"fedavg": _frame(seeds=(0, 1, 2)), "local": _frame(nan_every=2), "noseed": _frame().drop(columns="seed")}
    fig = viz.accuracy_curves(frames, title="acc")
    ax = fig.axes[0]
    assert [l.get_label() for l in ax.get_lines()] == ["fedavg", "local", "noseed"]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1  # only the multi-seed frame gets a min-max band
    x, y = ax.get_lines()[0].get_data()
    np.testing.assert_allclose(y, 0.1 * np.arange(5) + 0.01)  # mean over seeds 0, 1, 2
    x_local, _ = ax.get_lines()[1].get_data()
    assert list(x_local) == [0, 2, 4]  # NaN rounds skipped
    assert ax.get_title() == "acc"


def test_accuracy_curves_leave_out_a_label_without_values():
    # a method with no global model: its global accuracy is None in every row (object dtype), over two seeds
    empty = _frame(seeds=(0, 1)).assign(global_accuracy=None)
    fig = viz.accuracy_curves({"fedavg": _frame(seeds=(0, 1)), "fedbn": empty})
    assert [l.get_label() for l in fig.axes[0].get_lines()] == ["fedavg"]


def test_accuracy_curves_missing_metric():
    with pytest.raises(ValueError):
        viz.accuracy_curves({"a": _frame()}, metric="nope")


def test_bytes_per_round_mb():
    fig = viz.bytes_per_round({"a": _frame(), "b": _frame(seeds=(0, 1))})
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2
    np.testing.assert_allclose(lines[0].get_ydata(), np.arange(1, 6) + 2.0)


def test_client_size_histogram():
    counts = _counts(clients=30)
    fig = viz.client_size_histogram(counts)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert sum(heights) == 30
    fig2 = viz.client_size_histogram(counts.sum(1))
    assert [p.get_height() for p in fig2.axes[0].patches] == heights


def test_offset_grid_shows_initial_and_learned_offsets_on_one_scale():
    g = torch.Generator().manual_seed(0)
    initial = [torch.rand(1, 6, 6, generator=g) for _ in range(3)]
    learned = [t + 0.5 * torch.rand(1, 6, 6, generator=g) for t in initial]
    examples = [torch.rand(1, 6, 6, generator=g) for _ in range(3)]
    fig = viz.offset_grid(learned, examples, alpha=0.3, initial=initial)
    axes = np.array(fig.axes).reshape(5, 3)
    assert [axes[r, 0].get_ylabel() for r in range(5)] == ["image x", "initial t0", "offset t", "t - t0",
                                                          "(1-a)x + a t"]
    t0, t = axes[1, 0].images[0], axes[2, 0].images[0]
    assert t0.get_clim() == t.get_clim()  # one scale: what moved shows
    low, high = axes[3, 0].images[0].get_clim()
    assert high > 0 and low == -high  # the change is drawn symmetrically about zero
    np.testing.assert_allclose(axes[3, 0].images[0].get_array(), (learned[0] - initial[0])[0].numpy(), atol=1e-6)
    plt.close(fig)
    assert len(viz.offset_grid(learned, examples, alpha=0.3).axes) == 9  # without the initial offsets: 3 rows


def test_umap_embedding_is_reproducible_when_rows_repeat():
    # umap-learn alone gives a different layout on every call for data like this, random_state or not
    rng = np.random.default_rng(0)
    base = (rng.normal(size=(700, 32)) + rng.integers(0, 10, size=(700, 1))).astype(np.float32)
    copies = rng.integers(0, 700, size=900)
    z = np.concatenate([base, base[copies]])
    first, second = viz.umap_embedding(z, seed=0), viz.umap_embedding(z, seed=0)
    assert first.shape == (1600, 2) and np.array_equal(first, second)
    assert np.array_equal(first[700:], first[copies])          # every copy of a row sits on that row's point


def test_image_with_histogram_marks_each_versions_brightness():
    dark = torch.zeros(1, 4, 4)
    dark[0, :2] = 1.0  # half white: brightness 0.5, half the pixels in the first bin
    grey = torch.full((1, 4, 4), 0.25)
    fig = viz.image_with_histogram({"raw": dark, "aligned": grey}, bins=4)
    top, bottom = fig.axes[0:2], fig.axes[2:4]  # images first, then histograms (row by row)
    assert [ax.get_title() for ax in top] == ["raw\nbrightness 0.500", "aligned\nbrightness 0.250"]
    heights = [[p.get_height() for p in ax.patches] for ax in bottom]
    assert heights[0] == [0.5, 0.0, 0.0, 0.5] and heights[1] == [0.0, 1.0, 0.0, 0.0]
    assert bottom[1].lines[0].get_xdata()[0] == 0.25  # the mean marked
    plt.close(fig)


def test_tuning_curves_draw_one_panel_per_method_with_error_bars_and_the_choice_ringed():
    import pandas as pd

    curves = pd.DataFrame({"method": ["a"] * 3 + ["b"] * 3, "lr": [0.01, 0.1, 1.0] * 2,
                           "validation": [0.5, 0.7, 0.6, 0.4, 0.45, 0.2], "validation_se": [0.01, 0.05, 0.02] + [float("nan")] * 3,
                           "chosen": [False, True, False, False, True, False]})
    fig = viz.tuning_curves(curves, ncols=4)
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in shown] == ["a", "b"] and shown[0].get_xscale() == "log"
    ring = shown[0].lines[-1]
    assert list(ring.get_xdata()) == [0.1] and list(ring.get_ydata()) == [0.7]
    assert "diverged" not in fig.get_supxlabel()
    curves.loc[5, "validation"] = float("nan")                 # b diverged at lr 1: a cross at 0, said in the label
    fig = viz.tuning_curves(curves, ncols=4)
    crosses = [line for ax in fig.axes for line in ax.lines if line.get_marker() == "x"]
    assert [(list(c.get_xdata()), list(c.get_ydata())) for c in crosses if len(c.get_xdata())] == [([1.0], [0.0])]
    assert "×: a seed diverged" in fig.get_supxlabel()
    with pytest.raises(ValueError, match="^curves: "):
        viz.tuning_curves(curves.iloc[:0])


def test_results_heatmap_leaves_a_nan_cell_blank_or_writes_its_note():
    import pandas as pd

    values = pd.DataFrame([[0.5, float("nan")], [float("nan"), 0.9]], index=["a", "b"], columns=["0.1", "1"])
    ax = viz.results_heatmap(values).axes[0]
    assert [t.get_text() for t in ax.texts] == ["0.50", "0.90"]
    notes = pd.DataFrame([["", "diverged"], ["", ""]], index=values.index, columns=values.columns)
    ax = viz.results_heatmap(values, notes=notes).axes[0]
    assert [(t.get_text(), t.get_position()) for t in ax.texts] == [("0.50", (0, 0)), ("diverged", (1, 0)),
                                                                    ("0.90", (1, 1))]
    with pytest.raises(ValueError, match="^notes: "):
        viz.results_heatmap(values, notes=notes.iloc[:1])


def test_claim_effects_draw_a_dot_and_an_interval_per_claim_coloured_by_verdict_one_panel_per_paper():
    from fedlab_core.verdicts import OUTCOMES

    effects = pd.DataFrame({
        "paper": ["DisTrans", "DisTrans", "DisTrans", "FRAug"],
        "claim": ["Table 1, DH 0%: DisTrans beats FedAvg (closest: moon)", "Table 7: overhead at most the paper's",
                  "Table 1: reaches 99%", "Table 2: FRAug beats FedBN"],
        "effect": [0.04, -0.02, -1.5, -0.1], "low": [0.01, -0.02, np.nan, -0.2], "high": [0.07, -0.02, np.nan, 0.01],
        "outcome": ["held", "reached", "not comparable", "inconclusive"],
        "category": ["held", "reached", "not comparable", "inconclusive (a reason no category lists)"]})
    fig = viz.claim_effects(effects)
    panels = fig.axes
    assert [ax.get_title(loc="left") for ax in panels] == ["DisTrans: 3 claims", "FRAug: 1 claim"]
    assert [len(ax.collections[-1].get_offsets()) for ax in panels] == [3, 1]      # one dot per claim
    dots = np.concatenate([ax.collections[-1].get_facecolors() for ax in panels])
    expected = [viz.VERDICT_COLOURS[k] for k in ("held", "reached", "not comparable", "inconclusive")]
    np.testing.assert_allclose(dots, [matplotlib.colors.to_rgba(c) for c in expected])
    assert [t.get_text() for t in panels[0].get_yticklabels()][0] == "Table 1, DH 0%: DisTrans beats FedAvg"
    assert fig.get_size_inches()[0] == viz.COLUMN and panels[0].get_xscale() == "symlog"
    assert list(viz.VERDICT_COLOURS) == list(OUTCOMES)                                   # every label has its colour
    with pytest.raises(ValueError, match="^effects: "):
        viz.claim_effects(effects.iloc[:0])
