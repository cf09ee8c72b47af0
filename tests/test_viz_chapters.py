"""Tests for the plotting helpers of the OT-preprocessing and FedRDN chapters (headless, Agg backend)."""
import matplotlib

matplotlib.use("Agg")  # before pyplot draws anything; tests only

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fedlab_core import viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_channel_distributions_draws_a_line_per_group_and_the_target():
    rng = np.random.default_rng(0)
    before = rng.random((4, 3, 16))  # 4 clients, 3 channels, 16 levels
    after = rng.random((4, 3, 16))
    target = rng.random((3, 16))
    fig = viz.channel_distributions({"before": before, "after": after}, labels=list("abcd"),
                                    targets={"after": target}, log=True)
    axes = np.array(fig.axes).reshape(2, 3)
    assert [len(ax.get_lines()) for ax in axes.flat] == [4, 4, 4, 5, 5, 5]  # the target only in its row
    np.testing.assert_allclose(axes[1, 2].get_lines()[-1].get_ydata(), target[2])
    np.testing.assert_allclose(axes[0, 1].get_lines()[3].get_xdata(), np.linspace(0, 1, 16))
    assert axes[0, 0].get_yscale() == "log" and axes[0, 0].get_title() == "before: R"
    legend = [t.get_text() for t in axes[0, -1].get_legend().get_texts()]
    assert legend == ["a", "b", "c", "d", "target"]
    grey = viz.channel_distributions({"x": before[:, :1]}, support=np.arange(16))
    assert len(grey.axes) == 1 and grey.axes[0].get_lines()[0].get_xdata()[-1] == 15
    with pytest.raises(ValueError, match="shape"):
        viz.channel_distributions({"a": before, "b": before[:, :2]})


def test_image_panels_puts_each_group_on_a_row_and_clips_to_the_unit_range():
    rows = [torch.full((3, 3, 4, 5), 0.5), torch.full((1, 3, 4, 5), 2.0)]  # the second row: one image, out of range
    fig = viz.image_panels({"raw": rows, "after": [r * 0.0 for r in rows]}, row_labels=["x", "y"], per_row=2, pad=1)
    assert len(fig.axes) == 2 and [ax.get_title() for ax in fig.axes] == ["raw", "after"]
    mosaic = np.asarray(fig.axes[0].images[0].get_array())
    assert mosaic.shape == (2 * 4 + 1, 2 * 5 + 1, 3)
    assert np.allclose(mosaic[:4, :5], 0.5) and np.allclose(mosaic[5:, :5], 1.0)  # clipped
    assert np.allclose(mosaic[5:, 6:], 1.0)  # the missing image is white space
    assert np.allclose(np.asarray(fig.axes[1].images[0].get_array())[:4, :5], 0.0)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["x", "y"]
    with pytest.raises(ValueError, match="rows"):
        viz.image_panels({"a": rows, "b": rows[:1]})


def test_fit_power_law_recovers_the_exponent():
    x = np.array([10.0, 20.0, 40.0, 80.0])
    k, a = viz.fit_power_law(x, 3.0 * x ** 1.5)
    assert k == pytest.approx(1.5) and a == pytest.approx(3.0)
    k, _ = viz.fit_power_law(x, 2.0 / x)
    assert k == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        viz.fit_power_law([1.0], [1.0])
    with pytest.raises(ValueError):
        viz.fit_power_law([1.0, 2.0], [0.0, 1.0])


def test_scaling_plot_draws_fits_and_the_claimed_slope():
    x = np.array([100.0, 200.0, 400.0])
    fig = viz.scaling_plot({"linear": (x, 1e-3 * x), "quadratic": (x, 1e-5 * x ** 2)}, claimed=2,
                           colors={"linear": "tab:red"}, xlabel="d")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["linear: slope 1.00", "quadratic: slope 2.00", "claimed slope 2"]
    claimed = ax.get_lines()[-1]
    xs, ys = claimed.get_data()
    assert ys[0] == pytest.approx(0.1) and ys[-1] == pytest.approx(0.1 * 16)  # through the first point, slope 2
    assert matplotlib.colors.same_color(ax.get_lines()[0].get_color(), "tab:red")
    assert [float(t) for t in ax.get_xticks()] == [100.0, 200.0, 400.0]


def test_delta_heatmap_is_centred_at_zero_and_leaves_nan_blank():
    gains = pd.DataFrame([[1.5, -4.0], [np.nan, 0.25]], index=["fedavg", "fedprox"], columns=["+ a", "+ b"])
    fig = viz.delta_heatmap(gains, title="gain")
    ax = fig.axes[0]
    image = ax.images[0]
    assert image.get_clim() == (-4.0, 4.0)                      # symmetric around zero, from the largest |value|
    assert [t.get_text() for t in ax.texts] == ["+1.5", "-4.0", "+0.2"]   # the NaN cell has no label
    assert ax.texts[1].get_color() == "white" and ax.texts[0].get_color() == "black"
    assert bool(np.ma.getmaskarray(image.get_array())[1, 0]) and ax.get_title() == "gain"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fedavg", "fedprox"]
    fixed = viz.delta_heatmap(gains, limit=10.0, fmt="{:.2f}")
    assert fixed.axes[0].images[0].get_clim() == (-10.0, 10.0) and fixed.axes[0].texts[1].get_text() == "-4.00"
    flat = viz.delta_heatmap(pd.DataFrame([[0.0]]))
    assert flat.axes[0].images[0].get_clim() == (-1.0, 1.0)   # all zeros: a unit scale, not a zero-width one


def test_image_grid_shares_a_scale_per_column_and_labels_rows_and_columns():
    raw = torch.full((3, 4, 5), 0.5)            # (C, H, W) in [0, 1]
    standard = torch.full((3, 4, 5), 1.0)       # a standardised image: 1 std above the mean
    fig = viz.image_grid([[raw, standard], [raw * 0, -standard * 9]], row_labels=["x", "y"],
                         col_labels=["raw", "normalised"], value_range=[(0, 1), (-2, 2)])
    assert len(fig.axes) == 4
    shown = [np.asarray(ax.images[0].get_array()) for ax in fig.axes]
    assert shown[0].shape == (4, 5, 3)
    assert np.allclose(shown[0], 0.5) and np.allclose(shown[1], 0.75)   # (1 - (-2)) / 4
    assert np.allclose(shown[2], 0.0) and np.allclose(shown[3], 0.0)    # -9 is clipped to black
    assert [ax.get_title() for ax in fig.axes] == ["raw", "normalised", "", ""]
    assert [ax.get_ylabel() for ax in fig.axes] == ["x", "", "y", ""]
    grey = viz.image_grid([[torch.ones(1, 3, 3)]], value_range=(0, 2))
    assert np.allclose(np.asarray(grey.axes[0].images[0].get_array()), 0.5)
    with pytest.raises(ValueError, match="every row"):
        viz.image_grid([[raw, raw], [raw]])
    with pytest.raises(ValueError, match="value_range"):
        viz.image_grid([[raw, raw]], value_range=[(0, 1)] * 3)
