"""The verdict rule on hand-computed cases: every branch, in the order the rule checks them."""
import math

import pytest

from fedlab_core import verdicts
from fedlab_core import RunConfig
from fedlab_core.runs import History
from fedlab_core.verdicts import Verdicts, beats, converged, number, order, runs_converged, seed_values


def test_held_when_every_seed_is_on_the_claimed_side():
    v = order([0.80, 0.82, 0.81], [0.70, 0.75, 0.78], "A beats B")
    assert v.verdict == "held"
    assert v.values == pytest.approx((0.10, 0.07, 0.03))
    assert v.mean == pytest.approx(0.2 / 3)
    # sample std of (0.10, 0.07, 0.03) is 0.035119..., over sqrt(3)
    assert v.stderr == pytest.approx(0.0351188458 / math.sqrt(3))


def test_partly_held_when_the_mean_is_but_one_seed_is_not():
    v = order([0.9, 0.9, 0.7], [0.7, 0.7, 0.71])  # d = 0.2, 0.2, -0.01: mean 0.13, se 0.07
    assert v.verdict == "partly held"


def test_not_held_when_the_mean_goes_the_other_way():
    v = order([0.5, 0.6, 0.52], [0.7, 0.61, 0.6])  # d = -0.2, -0.01, -0.08
    assert v.verdict == "not held"


def test_inconclusive_within_one_standard_error():
    v = order([0.5, 0.7, 0.52], [0.6, 0.55, 0.56])  # d = -0.1, 0.15, -0.04: mean 0.0033, se 0.075
    assert v.verdict == "inconclusive"
    assert order([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]).verdict == "inconclusive"  # no difference at all


def test_inconclusive_with_fewer_than_three_seeds_however_large_the_gap():
    assert order([0.9, 0.9], [0.1, 0.1]).verdict == "inconclusive"
    assert order([0.9], [0.1]).verdict == "inconclusive"


def test_lower_is_better_flips_the_direction():
    assert order([1.0, 1.1, 0.9], [2.0, 2.1, 2.2], higher=False).verdict == "held"
    assert order([1.0, 1.1, 0.9], [2.0, 2.1, 2.2]).verdict == "not held"


def test_mappings_pair_by_seed_not_by_position():
    a = {0: 0.9, 1: 0.5, 2: 0.9}
    b = {2: 0.8, 1: 0.4, 0: 0.8}
    assert order(a, b).values == pytest.approx((0.1, 0.1, 0.1))
    with pytest.raises(ValueError, match="same seeds"):
        order({0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 1.0, 3: 1.0})
    with pytest.raises(ValueError, match="one value per seed"):
        order([1.0, 2.0, 3.0], [1.0, 2.0])
    diverged = order([1.0, math.nan, 3.0], [1.0, 2.0, 3.0])
    assert diverged.verdict == "inconclusive" and diverged.label == "inconclusive (a run diverged)"
    assert "diverged" in diverged.evidence


def test_claimed_number_within_or_below_our_interval_is_reached():
    ours = [0.90, 0.92, 0.94]  # mean 0.92, se 0.011547, t(0.975, 2) = 4.3027: [0.8703, 0.9697]
    v = number(ours, 0.95)
    assert (v.low, v.high) == pytest.approx((0.92 - 4.302653 * 0.0115470, 0.92 + 4.302653 * 0.0115470), rel=1e-5)
    assert v.verdict == "reached"
    assert number(ours, 0.50).verdict == "reached"      # we did better than claimed
    assert number(ours, 0.99).verdict == "not reached"  # above our interval


def test_a_cost_claim_is_reached_when_ours_is_no_lower_than_claimed():
    ratio = [2.0, 2.2, 2.1]  # interval about [1.85, 2.35]
    assert number(ratio, 3.0, higher=False).verdict == "reached"      # claimed worse than ours
    assert number(ratio, 2.0, higher=False).verdict == "reached"      # within
    assert number(ratio, 1.0, higher=False).verdict == "not reached"  # claimed cheaper than we measured


def test_numbers_need_three_seeds_unless_deterministic():
    assert number([0.9, 0.91], 0.5).verdict == "inconclusive"
    exact = number([49152], 49152, higher=False, deterministic=True)
    assert exact.verdict == "reached" and exact.low == exact.high == 49152
    assert number([1.07], 2.0, deterministic=True).verdict == "not reached"


def test_converged_looks_at_the_last_fifth_of_rounds():
    flat = [0.1, 0.5, 0.7, 0.75, 0.78, 0.79, 0.795, 0.80, 0.80, 0.805]
    assert converged(flat)  # rose 0.005 over the last 2 of 10 rounds
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9]
    assert not converged(rising)  # rose 0.1
    # over seeds, the mean curve decides; rounds without an evaluation are skipped
    seeds = [[0.5, None, 0.70, None, 0.71], [0.5, None, 0.72, None, 0.72]]
    assert converged(seeds)
    assert not converged([[0.5, None, 0.60, None, 0.70], [0.5, None, 0.60, None, 0.70]])
    assert not converged([0.7])  # one evaluated round cannot show flattening


def test_not_converged_is_carried_into_the_label():
    v = order([0.8, 0.8, 0.8], [0.7, 0.7, 0.7], converged=False)
    assert v.verdict == "held" and v.label == "held (not converged)"
    assert "not converged" in str(v)


def test_chapter_tally_and_table():
    book = Verdicts()
    book.add(order([0.8, 0.81, 0.82], [0.7, 0.7, 0.7], "A beats B"))
    book.add(order([0.8, 0.81], [0.7, 0.7], "A beats C"))
    book.add(number([0.9, 0.92, 0.94], 0.99, "99%"))
    assert book.count() == 3 and book.count("held") == 1
    assert book.summary() == "3 verdicts: 1 held, 1 inconclusive, 1 not reached"
    table = book.table()
    assert list(table["verdict"]) == ["held", "inconclusive", "not reached"]
    assert table["ours"][2].endswith("claimed 0.99")


def test_the_rule_the_book_prints_names_the_thresholds():
    assert f"fewer than {verdicts.MIN_SEEDS} seeds" in verdicts.RULE
    assert "one standard error" in verdicts.RULE and "95% interval" in verdicts.RULE


def _history(seed, curve):
    rounds = [{"round": r + 1, "mean_client_accuracy": v} for r, v in enumerate(curve)]
    return History(RunConfig(seed=seed).to_dict(), rounds, {"mean_client_accuracy": curve[-1]}, {})


def test_runs_are_paired_by_their_seed_and_judged_on_their_final_value_and_curves():
    a = [_history(s, [0.5, 0.7, 0.8 + 0.01 * s]) for s in (2, 0, 1)]  # any order
    b = [_history(s, [0.5, 0.6, 0.7]) for s in (0, 1, 2)]
    assert seed_values(a) == pytest.approx({0: 0.80, 1: 0.81, 2: 0.82})
    v = beats(a, b, "A beats B", paper="+0.05")
    assert v.verdict == "held" and v.values == pytest.approx((0.10, 0.11, 0.12)) and v.paper == "+0.05"
    assert not v.converged and v.label == "held (not converged)"  # a rose 0.1 over its last round of three
    flat = [_history(s, [0.5, 0.795, 0.8]) for s in (0, 1, 2)]
    assert runs_converged(flat) and beats(flat, b).converged is False  # b still rose 0.1
    with pytest.raises(ValueError, match="one seed each"):
        seed_values([_history(0, [0.5]), _history(0, [0.6])])


def test_curves_draw_the_runs_behind_each_verdict_judged_on_runs():
    import matplotlib
    matplotlib.use("Agg")
    a = [_history(s, [0.5, 0.7, 0.8 + 0.01 * s]) for s in (0, 1, 2)]
    b = [_history(s, [0.4, 0.6, 0.7]) for s in (0, 1, 2)]
    book = Verdicts()
    assert book.curves() is None                       # nothing judged yet
    book.add(order([0.8, 0.81, 0.82], [0.7, 0.7, 0.7], "numbers only"))  # no runs: no panel
    v = book.add(beats(a, b, "A beats B"))
    assert v.runs == (tuple(a), tuple(b))
    assert list(book.table()["#"]) == [1, 2]            # the table numbers the panels
    fig = book.curves(names=("A", "B"))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 1 and panels[0].get_title().startswith("2. A beats B")
    solid, dashed = panels[0].get_lines()
    assert list(solid.get_xdata()) == [1, 2, 3] and solid.get_ydata() == pytest.approx([0.5, 0.7, 0.81])
    assert dashed.get_ydata() == pytest.approx([0.4, 0.6, 0.7]) and dashed.get_linestyle() == "--"


def test_ahead_throughout_judges_the_smallest_lead_over_the_rounds():
    from fedlab_core.runs import History

    def run(seed, curve):
        rounds = [{"round": r, "mean_client_accuracy": a} for r, a in enumerate(curve, 1)]
        return History(config={"seed": seed}, rounds=rounds, final={"mean_client_accuracy": curve[-1]}, meta={})

    base = [run(s, [0.5, 0.6, 0.7]) for s in range(3)]
    always = [run(s, [0.55, 0.62, 0.75 + 0.01 * s]) for s in range(3)]
    v = verdicts.ahead_throughout(always, base, "ahead")
    assert v.verdict == "held" and v.values == pytest.approx((0.02, 0.02, 0.02))
    behind_once = [run(s, [0.45, 0.7, 0.8]) for s in range(3)]            # ahead at the end, behind in round 1
    v = verdicts.ahead_throughout(behind_once, base, "ahead")
    assert v.verdict == "not held" and v.values == pytest.approx((-0.05,) * 3)
    unevaluated = [run(s, [None, 0.61, 0.71]) for s in range(3)]         # rounds one side skipped do not count
    assert verdicts.ahead_throughout(unevaluated, base).values == pytest.approx((0.01,) * 3)
