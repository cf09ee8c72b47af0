"""The verdict rule: hand-computed cases of every branch, its error rates by simulation, the convergence test on
synthetic curves, and the score taken at convergence."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from fedlab_core import RunConfig
from fedlab_core import verdicts, viz
from fedlab_core.store import History
from fedlab_core.verdicts import (ALPHA, BEST_ROUND, BEST_VALIDATION, LAST_FIFTH, Verdicts, ahead_over_rounds, beats,
                                  client_scores, converged, error_rates, number, order, plateau_rise, plateaued,
                                  runs_converged, score, seed_values)

T4 = 2.7764451051977987   # Student t, 97.5% quantile, 4 degrees of freedom
T4_LOOKS2 = 3.4954077     # 98.75% quantile (each of two looks at 97.5%)


def test_held_when_the_interval_lies_wholly_on_the_claimed_side():
    v = order([0.80, 0.82, 0.81, 0.83, 0.79], [0.70, 0.75, 0.78, 0.74, 0.72], "A beats B")
    d = np.array([0.10, 0.07, 0.03, 0.09, 0.07])
    se = d.std(ddof=1) / math.sqrt(5)
    assert v.verdict == "held" and v.label == "held" and v.decided
    assert v.values == pytest.approx(tuple(d))
    assert v.mean == pytest.approx(d.mean()) and v.stderr == pytest.approx(se)
    assert (v.low, v.high) == pytest.approx((d.mean() - T4 * se, d.mean() + T4 * se))


def test_not_held_reversed_when_the_interval_lies_wholly_on_the_other_side():
    v = order([0.70, 0.71, 0.69, 0.70, 0.72], [0.75, 0.74, 0.76, 0.77, 0.75])
    assert v.verdict == "not held" and v.reason == "reversed" and v.label == "not held (reversed)"


def test_not_held_no_difference_when_the_interval_lies_within_the_margin():
    a = [0.800, 0.801, 0.799, 0.802, 0.800]
    b = [0.801, 0.800, 0.800, 0.800, 0.801]   # d within +-0.002: interval well inside +-1 point
    v = order(a, b)
    assert v.label == "not held (no difference)" and v.margin == verdicts.MARGIN
    assert -verdicts.MARGIN <= v.low and v.high <= verdicts.MARGIN
    assert order(a, b, margin=None).label == "inconclusive"        # no margin: never "no difference"
    assert order(a, b, margin=0.0005).label == "inconclusive"      # the interval pokes out of a tighter margin


def test_a_certain_gain_smaller_than_the_margin_is_still_held():
    v = order([0.805, 0.806, 0.804, 0.805, 0.806], [0.800] * 5)  # +0.5 point, interval above zero
    assert v.label == "held" and v.high < verdicts.MARGIN


def test_inconclusive_when_the_interval_crosses_zero_and_the_margin():
    v = order([0.5, 0.7, 0.52, 0.66, 0.6], [0.6, 0.55, 0.56, 0.6, 0.62])
    assert v.low < 0 < v.high and v.label == "inconclusive" and not v.decided


def test_fewer_than_five_seeds_never_decide_however_large_the_gap():
    v = order([0.9, 0.9, 0.91, 0.92], [0.1, 0.1, 0.1, 0.1])
    assert v.verdict == "inconclusive" and v.reason == "fewer than 5 seeds"
    assert order([0.9], [0.1]).label == "inconclusive (fewer than 5 seeds)"
    assert verdicts.MIN_SEEDS == 5


def test_runs_that_have_not_converged_never_read_held_or_not_held():
    big = order([0.9] * 5, [0.5, 0.51, 0.52, 0.5, 0.49], converged=False)
    assert big.verdict == "inconclusive" and big.label == "inconclusive (not converged)"
    assert big.low > 0  # the interval alone would have said held
    both = order([0.9] * 3, [0.5] * 3, converged=False)
    assert both.label == "inconclusive (not converged; fewer than 5 seeds)"


def test_lower_is_better_flips_the_direction():
    low, high = [1.0, 1.1, 0.9, 1.0, 1.05], [2.0, 2.1, 2.2, 2.0, 1.9]
    assert order(low, high, higher=False).verdict == "held"
    assert order(low, high).label == "not held (reversed)"


def test_mappings_pair_by_seed_and_a_diverged_run_is_inconclusive():
    a = {0: 0.9, 1: 0.5, 2: 0.9, 3: 0.7, 4: 0.6}
    b = {4: 0.5, 3: 0.6, 2: 0.8, 1: 0.4, 0: 0.8}
    assert order(a, b).values == pytest.approx((0.1,) * 5)
    with pytest.raises(ValueError, match="same seeds"):
        order({0: 1.0, 1: 1.0}, {0: 1.0, 2: 1.0})
    with pytest.raises(ValueError, match="one value per seed"):
        order([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="margin"):
        order([1.0] * 5, [1.0] * 5, margin=-0.1)
    diverged = order([1.0, math.nan, 3.0, 1, 1], [1.0, 2.0, 3.0, 1, 1])
    assert diverged.label == "inconclusive (a run diverged)" and "diverged" in diverged.evidence


def test_two_looks_widen_each_interval():
    a, b = [0.80, 0.82, 0.81, 0.83, 0.79], [0.70, 0.75, 0.78, 0.74, 0.72]
    one, two = order(a, b), order(a, b, looks=2)
    assert two.mean == one.mean
    assert (two.high - two.low) / (one.high - one.low) == pytest.approx(T4_LOOKS2 / T4, rel=1e-6)
    with pytest.raises(ValueError, match="looks"):
        order(a, b, looks=0)


def test_a_claimed_number_is_reached_only_when_our_worse_bound_clears_it_less_the_tolerance():
    ours = [0.90, 0.92, 0.94, 0.91, 0.93]  # mean 0.92, se 0.0070711: [0.9004, 0.9396]
    v = number(ours, 0.95)
    se = np.std(ours, ddof=1) / math.sqrt(5)
    assert (v.low, v.high) == pytest.approx((0.92 - T4 * se, 0.92 + T4 * se))
    assert v.verdict == "not reached"                                    # the whole interval below the claim
    assert number(ours, 0.93).label == "inconclusive (consistent, undecided)"   # 0.9004 < 0.93 - 0.01
    assert number(ours, 0.91).verdict == "reached"                       # 0.9004 >= 0.91 - 0.01
    assert number(ours, 0.50).verdict == "reached"                       # we did better than claimed
    assert number(ours, 0.93, tolerance=0.03).verdict == "reached"       # a wider tolerance
    assert number(ours, 0.95, converged=False).label == "inconclusive (not converged)"
    assert number(ours[:3], 0.5).label == "inconclusive (fewer than 5 seeds)"


def test_a_cost_claim_is_reached_when_our_worse_bound_is_no_higher_than_claimed_plus_the_tolerance():
    ratio = [2.0, 2.2, 2.1, 2.05, 2.15]               # [1.998, 2.202]
    assert number(ratio, 3.0, higher=False, quantity="ratio").verdict == "reached"
    assert number(ratio, 2.1, higher=False, quantity="ratio").label == "inconclusive (consistent, undecided)"
    assert number(ratio, 2.16, higher=False, quantity="ratio").verdict == "reached"   # 2.202 <= 2.16 + 0.05
    assert number(ratio, 1.0, higher=False, quantity="ratio").verdict == "not reached"


def test_a_true_value_three_points_below_the_claim_is_reached_at_most_5_percent_of_the_time():
    rates = verdicts.number_error_rates(-0.03, sd=0.025)
    assert rates["reached"] <= 0.05
    # the same decision, claim by claim, as number() makes it
    rng = np.random.default_rng(3)
    reached = sum(number(list(0.80 + rng.normal(0, 0.025, 5)), 0.83).verdict == "reached" for _ in range(400))
    assert reached / 400 <= 0.05
    # and "reached" never stands on an interval that also holds the claim less three points
    for _ in range(400):
        v = number(list(rng.normal(0.8, 0.03, 5)), 0.8)
        if v.verdict == "reached":
            assert v.low > 0.8 - 0.03


def test_quantities_bring_their_own_margins_and_unknown_ones_are_refused():
    gap = [0.004, 0.006, 0.005, 0.004, 0.005]        # a loss gap: no natural margin, never "no difference"
    assert order(gap, [0.0] * 5, quantity="loss", higher=False).label == "not held (reversed)"
    tiny = [0.001, -0.002, 0.0015, -0.001, 0.0005]
    assert order(tiny, [0.0] * 5).label == "not held (no difference)"
    assert order(tiny, [0.0] * 5, quantity="loss").label == "inconclusive"
    with pytest.raises(ValueError, match="quantity: unknown value 'points'"):
        order(tiny, [0.0] * 5, quantity="points")


def test_deterministic_numbers_need_no_seeds():
    exact = number([49152], 49152, higher=False, deterministic=True)
    assert exact.verdict == "reached" and exact.low == exact.high == 49152
    assert number([1.07], 2.0, deterministic=True).verdict == "not reached"


def test_a_number_from_another_dataset_is_not_comparable_never_not_reached():
    v = number([0.80, 0.81, 0.82, 0.80, 0.81], 0.99, "reaches 99%", comparable="an accuracy on CIFAR-10")
    assert v.verdict == "not comparable" and v.label == "not comparable (an accuracy on CIFAR-10)"
    assert not v.decided and v.mean == pytest.approx(0.808)
    with pytest.raises(ValueError, match="comparable"):
        number([0.8] * 5, 0.99, comparable="")
    with pytest.raises(ValueError, match="comparable"):
        number([0.8] * 5, 0.99, comparable=False)


# ------------------------------------------------------------------------------ error rates

def test_under_no_difference_the_rule_decides_at_most_five_percent_either_way():
    null = error_rates(0.0)
    assert sum(null.values()) == pytest.approx(1.0)
    assert null["held"] <= 0.05 and null["reversed"] <= 0.05
    assert null["held"] == pytest.approx(0.025, abs=0.005) and null["reversed"] == pytest.approx(0.025, abs=0.005)
    heavy = error_rates(0.0, noise="heavy")           # runs that now and then land far off
    assert heavy["held"] <= 0.05 and heavy["reversed"] <= 0.05
    two = error_rates(0.0, looks=2)                   # adding seeds up to the cap keeps the rate
    assert two["held"] <= 0.05 and two["reversed"] <= 0.05
    assert error_rates(0.0, seeds=10)["held"] <= 0.05     # more seeds: the same rate


def test_power_against_a_real_difference_of_two_standard_deviations():
    real = error_rates(2 * verdicts.NOISE_SD)
    assert real["held"] >= 0.85 and real["reversed"] == 0.0
    assert error_rates(2 * verdicts.NOISE_SD, looks=2)["held"] > real["held"]   # the second look adds power
    # a real difference of 3 points is never called "no difference"
    assert error_rates(0.03, sd=0.002)["no difference"] == 0.0


def test_no_difference_is_decided_when_the_noise_is_well_below_the_margin():
    assert error_rates(0.0, sd=verdicts.MARGIN / 4)["no difference"] > 0.9
    assert error_rates(0.0, margin=None)["no difference"] == 0.0


def test_the_simulation_applies_the_same_decision_as_order():
    rng = np.random.default_rng(1)
    for _ in range(200):
        d = rng.normal(rng.choice([0.0, 0.01, -0.02]), rng.choice([0.002, 0.01]), 5)
        label = order(list(d), [0.0] * 5).label
        low, high = order(list(d), [0.0] * 5).low, order(list(d), [0.0] * 5).high
        code = int(verdicts._decide(low, high, 1.0, verdicts.MARGIN))
        assert label == ["held", "not held (reversed)", "not held (no difference)", "inconclusive"][code]


def test_the_rule_the_book_prints_carries_the_rates_computed_at_the_spread_it_is_given():
    text = verdicts.rule(0.025)
    null, power = error_rates(0.0, sd=0.025), error_rates(0.02, sd=0.025)
    assert f"*held* {100 * null['held']:.1f}%" in text
    assert f"*not held (reversed)* {100 * null['reversed']:.1f}%" in text
    assert f"difference of 2 points it says *held* {100 * power['held']:.1f}%" in text
    assert "per-seed spread of d 2.5 points" in text and "Holm" in text
    assert f"fewer than {verdicts.MIN_SEEDS} seeds" in text and "±1 accuracy point" in text
    family = verdicts.family_error_rates(sd=0.025)
    assert f"some false decision stands in {100 * family['family-wise error']:.1f}%" in text
    assert verdicts.rule(0.01) != text


def test_a_page_prints_the_rule_at_the_spread_its_own_claims_show():
    rng = np.random.default_rng(0)
    found = verdicts.Verdicts()
    for i in range(5):
        found.add(order(list(rng.normal(0.0, 0.03, 5)), [0.0] * 5, f"claim {i}"))
    sds = sorted(float(np.std(v.values, ddof=1)) for v in found.items)
    assert found.spread() == pytest.approx(sds[2])
    assert f"per-seed spread of d {100 * round(sds[2], 3):.1f} points" in found.rule()


# ------------------------------------------------------------------------------ the convergence test

def _saturating(rounds, rate=0.2, top=0.85, noise=0.0, seed=0):
    r = np.arange(1, rounds + 1)
    return list(top * (1 - np.exp(-rate * r)) + np.random.default_rng(seed).normal(0, noise, rounds))


def test_a_saturating_curve_passes_once_it_has_flattened_and_fails_while_it_rises():
    assert not plateaued(_saturating(10))       # rounds 7-10 still rise by several points
    assert plateaued(_saturating(40))           # rounds 27-40 rise by < 1 point
    assert plateau_rise(_saturating(10)) > 0.01 > plateau_rise(_saturating(40)) > 0


def test_round_to_round_noise_does_not_fail_a_flat_curve_and_a_noisy_rise_does_not_pass():
    flat = [0.8 + x for x in np.random.default_rng(0).normal(0, 0.005, 60)]
    assert plateaued(flat)
    rising = [0.6 + 0.003 * r + x for r, x in enumerate(np.random.default_rng(0).normal(0, 0.005, 60))]
    assert not plateaued(rising)                # 0.3 point a round: 6 points over the last third
    # the old check (last two evaluations of the mean) passed a curve still rising 4 points
    still_rising = [0.70, 0.74, 0.77, 0.80, 0.801, 0.802, 0.84, 0.86, 0.862, 0.863]
    assert not plateaued(still_rising)


def test_a_falling_curve_has_not_converged_either():
    assert not plateaued([0.8 - 0.005 * r for r in range(30)])


def test_too_few_evaluations_show_nothing_and_unevaluated_rounds_are_skipped():
    assert not plateaued([0.8, 0.8, 0.8, 0.8, 0.8])
    assert math.isnan(plateau_rise([0.8] * 5))
    sparse = {5: 0.60, 10: 0.75, 15: 0.80, 20: 0.81, 25: 0.812, 30: 0.813}   # eval_every = 5
    assert plateaued(sparse)
    with_gaps = [None, 0.6, None, 0.75, None, 0.8, None, 0.81, None, 0.812, None, 0.813]
    assert plateaued(with_gaps) and plateau_rise(with_gaps) == pytest.approx(plateau_rise(sparse))  # rise, not slope
    assert converged([_saturating(40), _saturating(40, rate=0.3)])
    assert not converged([_saturating(40), _saturating(40, rate=0.02)])   # the mean still rises: one seed rises 9 points
    # one seed rising 1.2 points fails alone; beside a flat seed the mean rises 0.8 and passes
    assert not plateaued(_saturating(40, rate=0.15)) and converged([_saturating(40), _saturating(40, rate=0.15)])
    # runs that stopped at different rounds have no mean curve: each must pass
    assert not converged([_saturating(40), _saturating(10)]) and converged([_saturating(40), _saturating(35)])


def test_a_sides_convergence_is_read_on_its_mean_curve_which_fails_flat_runs_rarely_and_rising_ones_always():
    # flat curves with the noise of our validation curves (0.73 points an evaluation, 18 evaluations: 90 rounds
    # evaluated every 5): the per-seed test fails a flat run about one time in four, and five flat seeds together
    # three times in four; their mean curve about one time in fifty. A mean curve still rising two points over
    # its last third (six evaluations) fails.
    rng = np.random.default_rng(0)
    trials = [[list(0.8 + rng.normal(0, 0.0073, 18)) for _ in range(5)] for _ in range(400)]
    one_fails = np.mean([not plateaued(runs[0]) for runs in trials])
    all_pass = np.mean([all(plateaued(c) for c in runs) for runs in trials])
    mean_fails = np.mean([not converged(runs) for runs in trials])
    assert 0.18 < one_fails < 0.33 and all_pass < 0.35 and mean_fails < 0.04
    rising = [[list(0.7 + 0.004 * np.arange(18) + rng.normal(0, 0.0073, 18)) for _ in range(5)] for _ in range(100)]
    assert np.mean([converged(runs) for runs in rising]) < 0.03


# ------------------------------------------------------------------------------ scores from runs

def _history(seed, curve, final=None):
    rounds = [{"round": r + 1, "mean_client_accuracy": v} for r, v in enumerate(curve)]
    last = [v for v in curve if v is not None][-1] if final is None else final
    return History(RunConfig(seed=seed).to_dict(), rounds, {"mean_client_accuracy": last}, {})


def test_the_score_is_the_mean_of_the_last_fifth_of_evaluated_rounds():
    h = _history(0, [0.1 * r for r in range(1, 11)])
    assert score(h) == pytest.approx((0.9 + 1.0) / 2)                 # 10 rounds: the last 2
    assert score(h, protocol=BEST_ROUND) == pytest.approx(1.0)
    sparse = _history(0, [None, 0.5, None, 0.7, None, 0.9])            # three evaluations: the last one
    assert score(sparse) == pytest.approx(0.9)
    assert math.isnan(score(_history(0, [0.5, 0.6], final=math.nan)))  # diverged
    with pytest.raises(ValueError, match="protocol"):
        score(h, protocol="final")
    assert LAST_FIFTH in verdicts.SCORES


def test_the_best_validation_round_picks_each_clients_test_accuracy_where_its_validation_peaks():
    val = [[0.5, 0.9, 0.4], [0.7, 0.8, 0.6], [0.7, 0.1, float("nan")]]    # rounds x clients
    test = [[0.50, 0.95, 0.30], [0.60, 0.80, 0.70], [0.90, 0.10, 0.20]]
    rounds = [{"round": r + 1, "mean_client_accuracy": float(np.mean(t)), "client_accuracy": t,
               "client_validation_accuracy": v} for r, (v, t) in enumerate(zip(val, test))]
    h = History(RunConfig().to_dict(), rounds, {"mean_client_accuracy": 0.4}, {})
    # client 0 peaks first in round 2 (ties keep the first), client 1 in round 1, client 2 in round 2
    assert score(h, protocol=BEST_VALIDATION) == pytest.approx((0.60 + 0.95 + 0.70) / 3)
    with pytest.raises(ValueError, match="validation_monitor"):
        score(_history(0, [0.5, 0.6]), protocol=BEST_VALIDATION)


def test_client_scores_are_each_clients_accuracy_under_the_protocol_and_average_to_the_runs_score():
    test = [[0.2, 0.4], [0.5, 0.9], None, [0.6, 0.7], [0.8, 0.6], [0.7, 0.9]] + [[0.7, 0.8]] * 4   # 9 evaluated
    rounds = [{"round": r + 1, "mean_client_accuracy": None if t is None else float(np.mean(t)), "client_accuracy": t}
              for r, t in enumerate(test)]
    h = History(RunConfig().to_dict(), rounds, {"mean_client_accuracy": 0.75, "client_accuracy": [0.7, 0.8]}, {})
    assert client_scores(h) == pytest.approx([0.7, 0.8])                         # the last 2 of 9 evaluations
    assert client_scores(h).mean() == pytest.approx(score(h))
    assert client_scores(h, BEST_ROUND) == pytest.approx([0.7, 0.9])             # round 6: the best mean, 0.8
    early = History(RunConfig().to_dict(), rounds[:5], {"mean_client_accuracy": 0.7, "client_accuracy": [0.8, 0.6]}, {})
    assert client_scores(early) == pytest.approx([0.8, 0.6])                     # 4 evaluated: the last one
    diverged = History(RunConfig().to_dict(), rounds, {"mean_client_accuracy": None, "client_accuracy": [0.1, 0.1]}, {})
    assert np.isnan(client_scores(diverged)).all() and len(client_scores(diverged)) == 2
    with pytest.raises(ValueError, match="validation_monitor"):
        client_scores(h, BEST_VALIDATION)


def test_runs_are_paired_by_seed_scored_at_convergence_and_must_all_converge():
    flat = [_history(s, _saturating(40, top=0.85 + 0.01 * s)) for s in (4, 2, 0, 1, 3)]  # any order
    base = [_history(s, _saturating(40, top=0.80)) for s in range(5)]
    v = beats(flat, base, "A beats B", paper="+0.05")
    assert v.verdict == "held" and v.converged and v.score == LAST_FIFTH and v.paper == "+0.05"
    assert list(seed_values(flat)) == [4, 2, 0, 1, 3]
    assert v.values == pytest.approx(tuple(seed_values(flat)[s] - seed_values(base)[s] for s in range(5)))
    short = [_history(s, _saturating(40, rate=0.02, top=0.95)) for s in range(5)]   # still rising at round 40
    assert not runs_converged(short)
    assert beats(short, base).label == "inconclusive (not converged)"
    assert beats(flat, base, protocol=BEST_ROUND).score == BEST_ROUND
    with pytest.raises(ValueError, match="one seed each"):
        seed_values([_history(0, [0.5]), _history(0, [0.6])])


def test_ahead_over_rounds_judges_the_mean_lead_not_the_smallest():
    base = [_history(s, _saturating(30, top=0.80, noise=0.002, seed=s)) for s in range(5)]
    ahead = [_history(s, [x + 0.03 for x in _saturating(30, top=0.80, noise=0.002, seed=s)]) for s in range(5)]
    v = ahead_over_rounds(ahead, base, "ahead")
    assert v.verdict == "held" and v.values == pytest.approx((0.03,) * 5)
    dip = [_history(s, [x + (0.03 if r != 5 else -0.05) for r, x in
                        enumerate(_saturating(30, top=0.80, noise=0.002, seed=s))]) for s in range(5)]
    assert ahead_over_rounds(dip, base).verdict == "held"   # one bad round does not decide it
    early = [_history(s, _saturating(8)) for s in range(5)]
    assert ahead_over_rounds(early, early).label == "inconclusive (not converged)"
    # planned with two looks, its interval is the wider one of each look (the second look's seeds may follow)
    lead = [_history(s, [x + 0.004 * (s - 1) for x in _saturating(30, top=0.80, noise=0.002, seed=s)]) for s in range(5)]
    one, two = ahead_over_rounds(lead, base), ahead_over_rounds(lead, base, looks=2)
    assert two.mean == pytest.approx(one.mean) and two.low < one.low and two.high > one.high


# ------------------------------------------------------------------------------ a chapter's verdicts

def test_chapter_tally_and_table():
    book = Verdicts()
    book.add(order([0.8, 0.81, 0.82, 0.8, 0.81], [0.7] * 5, "A beats B"))
    book.add(order([0.8, 0.81], [0.7, 0.7], "A beats C"))
    book.add(number([0.9] * 5, 0.99, "99%", comparable="another dataset"))
    book.add(order([0.8] * 5, [0.7] * 5, "A beats D", converged=False))
    assert book.count() == 4 and book.count("held") == 1 and book.count("inconclusive") == 2
    assert book.count("inconclusive (not converged)") == 1
    assert book.summary() == ("4 verdicts: 1 held, 1 inconclusive (not converged), 1 inconclusive (fewer than 5 "
                              "seeds), 1 not comparable")
    table = book.table()
    assert list(table["verdict"]) == ["held", "inconclusive (fewer than 5 seeds)", "not comparable (another dataset)",
                                      "inconclusive (not converged)"]
    assert table["ours"][2].endswith("claimed 0.99")


def test_findings_list_the_decided_claims_and_count_the_undecided_by_why():
    book = Verdicts()
    book.add(order([0.8, 0.81, 0.82, 0.8, 0.81], [0.7] * 5, "A beats B"))
    book.add(order([0.8] * 5, [0.7] * 5, "A beats D", converged=False))   # would hold, but not converged
    book.add(order([0.8, 0.81], [0.7, 0.7], "A beats C"))
    book.add(order([0.7] * 5, [0.8, 0.81, 0.82, 0.8, 0.81], "A beats E"))
    text = book.findings()
    assert text.startswith("**What we found.** The rule decided 2 of the 4 claims judged on this page (after Holm's "
                           "adjustment within each table or figure; a claim on training runs only when they "
                           "converged, none degenerate, with at least 5 seeds):")
    assert "- *held*: A beats B (d = +0.108" in text and "- *not held (reversed)*: A beats E (d = -0.108" in text
    assert "A beats D" not in text and "A beats C" not in text   # undecided claims are counted, not listed
    assert text.endswith("Undecided: 1 inconclusive (not converged), 1 inconclusive (fewer than 5 seeds).")
    alone = Verdicts([book.items[1]]).findings()
    assert alone == ("**What we found.** The rule decided 0 of the 1 claim judged on this page.\n\n"
                     "Undecided: 1 inconclusive (not converged).")


def test_curves_draw_the_runs_behind_each_verdict_judged_on_runs():
    import matplotlib
    matplotlib.use("Agg")
    a = [_history(s, [0.5, 0.7, 0.8 + 0.01 * s]) for s in range(3)]
    b = [_history(s, [0.4, 0.6, 0.7]) for s in range(3)]
    book = Verdicts()
    assert viz.verdict_curves(book) is None            # nothing judged yet
    book.add(order([0.8, 0.81, 0.82], [0.7, 0.7, 0.7], "numbers only"))  # no runs: no panel
    v = book.add(beats(a, b, "A beats B"))
    assert v.runs == (tuple(a), tuple(b))
    assert list(book.table()["#"]) == [1, 2]            # the table numbers the panels
    fig = viz.verdict_curves(book, names=("A", "B"))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 1 and panels[0].get_title().startswith("2. A beats B")
    solid, dashed = panels[0].get_lines()
    assert list(solid.get_xdata()) == [1, 2, 3] and solid.get_ydata() == pytest.approx([0.5, 0.7, 0.81])
    assert dashed.get_ydata() == pytest.approx([0.4, 0.6, 0.7]) and dashed.get_linestyle() == "--"


def test_curves_take_runs_that_stopped_at_different_rounds():
    import matplotlib
    matplotlib.use("Agg")
    a = [_history(0, [0.5, 0.7]), _history(1, [0.6, 0.8, 0.9])]   # seed 0 stopped once converged, a round early
    b = [_history(0, [0.4, 0.6, 0.7]), _history(1, [0.4, 0.6, 0.7])]
    book = Verdicts()
    book.add(beats(a, b, "A beats B"))
    solid, _ = [ax for ax in viz.verdict_curves(book).axes if ax.get_visible()][0].get_lines()
    assert list(solid.get_xdata()) == [1, 2, 3]
    assert solid.get_ydata() == pytest.approx([0.55, 0.75, 0.9])   # the last round: the seed still running


def test_a_truncated_run_is_judged_on_its_rounds_up_to_the_budget():
    rising = [0.1 * r for r in range(1, 7)] + [0.6] * 8  # rises for six rounds, then flat to round 14
    h = History({"seed": 0}, [{"round": r, "mean_client_accuracy": a} for r, a in enumerate(rising, 1)],
                {"mean_client_accuracy": 0.6}, {"seconds": 1.0})
    assert verdicts.runs_converged([h])
    early = verdicts.truncated(h, 6)
    assert [r["round"] for r in early.rounds] == list(range(1, 7)) and early.final["mean_client_accuracy"] == pytest.approx(0.6)
    assert not verdicts.runs_converged([early])                   # still rising at round 6
    assert verdicts.score(early) == pytest.approx(0.55) and early.meta["truncated_at"] == 6  # last fifth: rounds 5-6
    assert verdicts.truncated(h, 20) is h                         # a run that stopped before the budget is whole
    with pytest.raises(ValueError, match="last_round"):
        verdicts.truncated(h, 0)


def test_a_difference_is_shown_in_the_papers_unit():
    v = order([0.81, 0.82, 0.83, 0.81, 0.82], [0.8] * 5, "A beats B", paper="+3.98 points (Office-Caltech-10)")
    assert v.evidence == f"d = {100 * v.mean:+.2f} points [{100 * v.low:+.2f}, {100 * v.high:+.2f}] (5 seeds)"
    assert v.evidence.startswith("d = +1.80 points [")
    same = order([0.81, 0.82, 0.83, 0.81, 0.82], [0.8] * 5, "A beats B", paper="+0.284 (CIFAR-10)")
    assert same.evidence.startswith("d = +0.018 [")      # the paper's figure is an accuracy: ours too
    assert verdicts.difference_text(0.5, math.nan, math.nan, 1, "-2 points") == "d = +50.00 points (1 seed)"


def test_a_mean_and_its_spread_stay_on_one_line():
    # no-break spaces around the ±: a narrow table cell wraps around "0.741 ± 0.017", never inside it
    assert verdicts.mean_std(0.7414, 0.0172) == "0.741\u00a0±\u00a00.017"
    assert verdicts.mean_std(73.04, 1.66, ".1f") == "73.0\u00a0±\u00a01.7"
    assert verdicts.mean_std(0.7414, 0.0172, ".3g", ".2g") == "0.741\u00a0±\u00a00.017"
    assert " " not in verdicts.mean_std(12345.6, 789.1, ",.0f")


# ------------------------------------------------------------------------------ rankings

def _flat(seed, level, rounds=12):
    # a converged run: flat at `level` (plus a seed's wobble) from its first evaluation
    return _history(seed, [level + 0.001 * seed] * rounds)


def test_a_ranking_orders_by_score_and_judges_every_step_by_the_rule():
    seeds = range(5)
    groups = {"low": [_flat(s, 0.60) for s in seeds], "high": [_flat(s, 0.80) for s in seeds],
              "near high": [_history(s, [0.795 + 0.002 * (3 * s % 5)] * 12) for s in seeds],
              "rising": [_history(s, [0.40 + 0.025 * r for r in range(12)]) for s in seeds]}   # never plateaus
    table, steps = verdicts.ranking(groups, "split")
    assert list(table["method"]) == ["high", "near high", "rising", "low"]     # rising scores 0.65: third
    assert list(table["rank"]) == [1, 2, 3, 4]
    assert [v.claim for v in steps] == ["split: high beats near high", "split: near high beats rising",
                                        "split: rising beats low"]
    # d = +0.003 [-0.000, +0.006]: within the one-point margin, an equivalence, not a win
    assert steps[0].label == "not held (no difference)"
    assert steps[1].label.startswith("inconclusive (not converged") and steps[2].label.startswith("inconclusive")
    assert list(table["converged"]) == [True, True, False, True] and list(table["seeds"]) == [5] * 4
    assert table["beats the next?"].iloc[-1] == "—"                          # the last has no next
    row = table.iloc[0]
    assert row["mean"] == pytest.approx(0.802) and row["low"] < row["mean"] < row["high"]
    big, _ = verdicts.ranking({"a": [_flat(s, 0.9) for s in seeds], "b": [_flat(s, 0.5) for s in seeds]})
    assert _[0].label == "held" and _[0].claim == "a beats b"
    # as a page shows it: four columns, the interval and the converged runs beside the numbers, not touching them
    view = verdicts.ranking_view(table)
    assert list(view.columns) == ["rank", "method", "mean [95% interval]", "beats the next?"]
    assert list(view["method"]) == ["high", "near high", "rising (not converged)", "low"]
    assert view["mean [95% interval]"].iloc[0] == f"0.802 [{row['low']:.3f},\u00a0{row['high']:.3f}]"
    assert view["beats the next?"].iloc[0] == f"not held (no difference): {steps[0].evidence}"
    assert view["beats the next?"].iloc[-1] == "—"


def test_a_ranking_shows_each_step_as_holms_adjustment_leaves_it():
    seeds = range(5)
    table, steps = verdicts.ranking({"a": [_flat(s, 0.9) for s in seeds], "b": [_flat(s, 0.5) for s in seeds]}, "x")
    assert table["beats the next?"].iloc[0] == "held" and table["claim"].iloc[0] == "x: a beats b"
    undone = dataclasses.replace(steps[0], verdict=verdicts.INCONCLUSIVE,
                                 reason=f"{verdicts.MULTIPLICITY}: held before Holm's adjustment, adjusted p = 0.07")
    shown = verdicts.ranking_view(verdicts.adjusted_ranking(table, [undone]))
    assert shown["beats the next?"].iloc[0] == f"{undone.label}: {undone.evidence}"
    assert undone.label.startswith("inconclusive (multiplicity")
    assert shown["beats the next?"].iloc[-1] == "—" and table["beats the next?"].iloc[0] == "held"  # a copy
    with pytest.raises(ValueError, match="^items: no verdict for the ranking's step 'x: a beats b'"):
        verdicts.adjusted_ranking(table, [])


def test_a_ranking_judges_each_step_with_the_look_it_is_given():
    # the second look's shape: five more seeds for both sides of a step, judged with two looks
    near = {"a": [_flat(s, 0.70 + 0.01 * (s % 2)) for s in range(5)], "b": [_flat(s, 0.70) for s in range(5)]}
    _, (alone,) = verdicts.ranking(near, "x")
    looked = []

    def look(judge, a, b):
        looked.append(judge.keywords["claim"])
        return judge([*a, *(_flat(s, 0.71) for s in range(5, 10))], [*b, *(_flat(s, 0.70) for s in range(5, 10))],
                     looks=2)

    table, (step,) = verdicts.ranking(near, "x", look=look)
    assert looked == ["x: a beats b"] and step.claim == alone.claim
    assert alone.seeds == 5 and step.seeds == 10 and step.evidence != alone.evidence
    assert table["by"].iloc[0] == step.evidence and list(table["seeds"]) == [5, 5]   # the rows: the first five


def test_a_ranking_puts_a_diverged_method_last_and_gives_one_seed_no_interval():
    one = {"ok": [_flat(0, 0.7)], "diverged": [_history(0, [0.5, 0.6], final=math.nan)],
           "better": [_flat(0, 0.9)]}
    table, steps = verdicts.ranking(one)
    assert list(table["method"]) == ["better", "ok", "diverged"]
    assert math.isnan(table["low"].iloc[0]) and "fewer than 5 seeds" in steps[0].label
    assert list(verdicts.ranking_view(table)["mean [95% interval]"]) == ["0.900", "0.700", "—"]   # no interval


def test_a_results_table_marks_a_cell_whose_runs_did_not_all_converge():
    from fedlab_core.sweeps import UNCONVERGED_MARK, mean_std_table, summarize

    def run_of(seed, curve):
        h = _history(seed, curve)
        h.final.update(global_accuracy=curve[-1], client_accuracy=[curve[-1]])
        h.meta.update(dh=0.0, global_model=True)
        return h

    flat, rising = [0.7] * 12, [0.1 * r for r in range(1, 8)]
    summary = summarize({("a", "s"): [run_of(0, flat), run_of(1, flat)],
                         ("b", "s"): [run_of(0, flat), run_of(1, rising)]})
    assert list(summary["converged"]) == [True, False] and list(summary["seeds"]) == [2, 2]
    marked = mean_std_table(summary, "mean_client_accuracy", ["a", "b"], ["s"], mark_unconverged=True)
    assert marked.loc["a", "s"] == verdicts.mean_std(0.7, 0.0) and marked.loc["b", "s"].endswith(" " + UNCONVERGED_MARK)
    assert UNCONVERGED_MARK not in mean_std_table(summary, "mean_client_accuracy", ["a", "b"], ["s"]).loc["b", "s"]


def test_a_chapter_names_its_settings_and_an_unknown_name_fails_in_one_line():
    from fedlab_core.tuning import SETTINGS, named_settings

    chosen = named_settings("SETTINGS", ["feature skew", "DH 0.8"])
    assert list(chosen) == ["feature skew", "DH 0.8"] and chosen["DH 0.8"] == ("label skew", {})
    assert SETTINGS["Dir(0.1)"][1] == {"partition": "dirichlet", "alpha": 0.1, "dh": None}
    with pytest.raises(ValueError, match=r"^SPLITS: unknown setting 'Dir\(0\.3\)'; choose from 'IID', ") as err:
        named_settings("SPLITS", ["DH 0.8", "Dir(0.3)"])
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ degenerate runs

def _clients_run(seed, per_round, classes=10, meta=None, algorithm="fedavg", augment="none"):
    # a run whose every round is evaluated: per_round[r] is the clients' accuracies at round r + 1
    rounds = [{"round": r + 1, "client_accuracy": list(acc), "mean_client_accuracy": float(np.mean(acc))}
              for r, acc in enumerate(per_round)]
    final = {k: v for k, v in rounds[-1].items() if k != "round"}
    return History(RunConfig(seed=seed, algorithm=algorithm, augment=augment).to_dict(), rounds, final,
                   {"class_counts": [[1] * classes] * len(per_round[0]), "code_version": "v1", **(meta or {})})


def test_a_run_at_chance_a_constant_predictor_a_blind_model_and_a_collapse_are_degenerate():
    healthy = _clients_run(0, [[0.5 + 0.03 * r + 0.01 * c for c in range(3)] for r in range(6)]
                           + [[0.7 + 0.001 * ((r * c) % 3) + 0.01 * c for c in range(3)] for r in range(6)])
    assert verdicts.degenerate(healthy) == ""
    chance = _clients_run(0, [[0.10 + 0.005 * ((r + c) % 2) for c in range(3)] for r in range(12)])
    assert verdicts.degenerate(chance).startswith("scores near chance")
    # every client 0.500 from round 4 on: a model answering each client with its own class on a 50/50 test set
    constant = _clients_run(0, [[0.3 + 0.05 * r] * 3 for r in range(4)] + [[0.5] * 3] * 8)
    assert verdicts.degenerate(constant).startswith("predicts a constant per client")
    # a converged model whose accuracies happen to stop moving, but differ between clients, is not
    settled = _clients_run(0, [[0.9, 0.95, 1.0]] * 12)
    assert verdicts.degenerate(settled) == ""
    blind = _clients_run(0, [[0.7, 0.8, 0.75]] * 12, meta={"unchanged_under_noise": [0.97, 1.0, 0.95]})
    assert verdicts.degenerate(blind).startswith("ignores its input")
    peak = _clients_run(0, [[0.3 + 0.1 * r] * 2 + [0.31 + 0.1 * r] for r in range(5)] + [[0.55, 0.56, 0.57]] * 10)
    assert verdicts.degenerate(peak).startswith("collapsed (mean client accuracy 0.560 at the end against a peak")


def test_a_claim_resting_on_a_degenerate_run_is_inconclusive_whatever_its_interval():
    good = [_clients_run(s, [[0.80 + 0.01 * s + 0.001 * ((r * c) % 3) for c in range(3)] for r in range(12)])
            for s in range(5)]
    stuck = [_clients_run(s, [[0.5] * 3] * 12) for s in range(5)]
    v = beats(good, stuck, "DisTrans beats FedAvg")
    assert v.label.startswith("inconclusive (degenerate: fedavg seed 0 predicts a constant per client")
    assert v.category == "inconclusive (degenerate)" and not v.decided
    # the run is named with its plug-in: FedAvg with and without one are the two arms of a plug-in's claims
    stuck_plugged = [_clients_run(s, [[0.5] * 3] * 12, augment="mixup") for s in range(5)]
    assert beats(stuck_plugged, good).label.startswith("inconclusive (degenerate: fedavg+mixup seed 0 predicts")
    assert beats(good, [_clients_run(s, [[0.70 + 0.002 * s] * 2 + [0.71] for _ in range(12)])
                        for s in range(5)]).verdict == "held"


def test_arms_computed_by_different_code_wait_for_the_recompute():
    a = [_clients_run(s, [[0.80 + 0.01 * s, 0.81, 0.82]] * 12) for s in range(5)]
    b = [_clients_run(s, [[0.70 + 0.01 * s, 0.71, 0.72]] * 12, meta={"code_version": "v2"}) for s in range(5)]
    assert beats(a, b).label == "inconclusive (arms from different code versions: waits for the recompute)"
    # runs with the pinned kernels recorded compare across code versions (verification re-runs them under
    # today's code); other kernels do not
    pinned = {"kernels": {"canary": "abc", "threads": 1}}
    a2 = [dataclasses.replace(h, meta={**h.meta, **pinned}) for h in a]
    b2 = [dataclasses.replace(h, meta={**h.meta, **pinned}) for h in b]
    assert beats(a2, b2).verdict == "held"
    b3 = [dataclasses.replace(h, meta={**h.meta, "kernels": {"canary": "def", "threads": 1}}) for h in b]
    assert beats(a2, b3).label.startswith("inconclusive (arms from different code")
    # the pins make CPUs with other flags (AVX-512, AMX) compute alike: their canary says so, and it decides
    other_cpu = {"kernels": {"canary": "abc", "threads": 1, "flags": ["avx2", "fma", "avx512f", "amx_tile"]}}
    b4 = [dataclasses.replace(h, meta={**h.meta, **other_cpu}) for h in b]
    assert beats(a2, b4).verdict == "held"


def test_a_run_stopped_on_its_test_curve_or_arms_of_unequal_budgets_decide_nothing():
    a = [_clients_run(s, [[0.80 + 0.01 * s, 0.81, 0.82]] * 12) for s in range(5)]
    b = [_clients_run(s, [[0.70 + 0.01 * s, 0.71, 0.72]] * 12) for s in range(5)]
    assert beats(a, b).verdict == "held"
    test_stopped = [dataclasses.replace(h, meta={**h.meta, "stopped_at_plateau": 12}) for h in b]
    assert beats(a, test_stopped).label == ("inconclusive (stopped on the test curve: fedavg seed 0 stopped at "
                                            "round 12: waits for the recompute)")
    # the same stop read off held-out validation shares is fine, and so is a run scored on held-out data
    on_val = [dataclasses.replace(h, config={**h.config, "plateau_metric": "validation_accuracy"}) for h in test_stopped]
    assert beats(a, on_val).verdict == "held"
    at_cap = [dataclasses.replace(h, meta={**h.meta, "stopped_at_plateau": h.config["num_rounds"]}) for h in b]
    assert beats(a, at_cap).verdict == "held"                 # it trained to its cap: the stop shortened nothing
    longer = [_clients_run(s, [[0.70 + 0.01 * s, 0.71, 0.72]] * (12 + 3 * (s == 2))) for s in range(5)]
    assert beats(a, longer).label == "inconclusive (unequal budgets: seed 2 trained 12 rounds on one side, 15 on the other)"
    # a chapter's deliberate truncation (equal local steps) states its own budget
    assert beats(a, [verdicts.truncated(h, 12) if s == 2 else h for s, h in enumerate(longer)]).verdict == "held"


def test_convergence_reads_the_validation_shares_when_a_run_has_them():
    flat_test = [[0.8, 0.8, 0.8]] * 12
    rising_val = [list(np.full(3, 0.5 + 0.02 * r)) for r in range(12)]
    h = _clients_run(0, flat_test)
    assert verdicts.runs_converged([h])
    for row, val in zip(h.rounds, rising_val):
        row["client_validation_accuracy"] = val
    assert not verdicts.runs_converged([h])          # its test curve is flat, its validation curve still rises
    assert verdicts.convergence_curve(h)[12] == pytest.approx(0.72)


class _Shortcut(torch.nn.Module):
    """A model that reads the class from a client's marker channel, not from the image."""

    def forward(self, x):
        return torch.nn.functional.one_hot(x[:, 1, 0, 0].long(), 10).float() * 10


def test_the_input_check_finds_a_model_that_ignores_its_images():
    from fedlab_core.runs import unchanged_under_noise

    g = torch.Generator().manual_seed(1)        # not the noise's own seed
    images = torch.randn(200, 1, 8, 8, generator=g)
    marker = torch.full((200, 1, 8, 8), 3.0)
    shortcut = unchanged_under_noise(lambda x: _Shortcut()(x), torch.cat([images, marker], 1), channels=1)
    assert shortcut == 1.0
    reader = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    torch.manual_seed(0)
    reads = unchanged_under_noise(reader, images)
    assert reads < 0.5


# ------------------------------------------------------------------------------ families and multiplicity

def test_holm_adjusts_each_family_and_a_decision_that_does_not_survive_says_what_it_was():
    found = Verdicts()
    strong = [0.10, 0.11, 0.09, 0.10, 0.12]             # p ~ 1e-5
    weak = [0.02, 0.04, 0.005, 0.03, 0.02]              # p ~ 0.02: held alone, not after x 7
    found.add(order(strong, [0.0] * 5, "Table 1, DH 0%: A beats B"))
    found.add(order(weak, [0.0] * 5, "Table 1, DH 20%: A beats B"))
    for i in range(6):
        found.add(order([0.01, -0.02, 0.015, 0.0, -0.01], [0.0] * 5, f"Table 1, DH {i}: A beats C"))
    found.add(order(weak, [0.0] * 5, "Fig. 4: A beats B"))   # a family of one: stands
    raw = order(weak, [0.0] * 5, "Table 1, DH 20%: A beats B")
    assert raw.verdict == "held" and ALPHA / 7 < raw.p < ALPHA
    first, second = found.items[0], found.items[1]
    assert first.verdict == "held" and first.family == "Table 1" and first.family_size == 8
    assert first.adjusted_p == pytest.approx(min(1, 8 * first.p))
    assert second.category == "inconclusive (multiplicity)"
    assert second.reason.startswith("multiplicity: held before Holm's adjustment, adjusted p = ")
    assert second.reason.endswith("over the 8 claims of Table 1")
    assert found.items[-1].verdict == "held" and found.items[-1].family_size == 1
    assert found.count("held") == 2 and "Holm p" in first.evidence
    own = Verdicts()   # claims beyond the papers' tables: one family, named as such
    own.add(order(weak, [0.0] * 5, "A beats B"))
    for i in range(6):
        own.add(order([0.01, -0.02, 0.015, 0.0, -0.01], [0.0] * 5, f"A beats C{i}"))
    assert own.items[0].reason.endswith("over the book's own 7 claims")
    with pytest.raises(ValueError, match="^claim: already judged on this page.*'A beats B'$"):
        own.add(order(weak, [0.0] * 5, "A beats B"))   # counted twice, it would inflate its family
    assert len(own.items) == 7                          # refused: nothing added


def test_holm_controls_the_familywise_error_of_twenty_null_claims():
    rng = np.random.default_rng(5)
    families_with_an_error = 0
    for _ in range(300):
        found = Verdicts()
        for i in range(20):
            found.add(order(list(rng.normal(0, 0.025, 5)), [0.0] * 5, f"Table 2, case {i}: A beats B"))
        families_with_an_error += any(v.decided and v.verdict != "not held" or v.label == "not held (reversed)"
                                      for v in found.items)
    assert families_with_an_error / 300 <= 0.05 + 0.03   # 5% nominal, with room for 300 draws


def test_a_second_look_at_claims_that_holm_undoes_keeps_the_family_error_and_adds_power():
    null = verdicts.family_error_rates()                          # 20 claims, none real
    assert null["family-wise error"] <= ALPHA + 0.003             # 5% nominal; 20,000 families: s.e. 0.15%
    mixed = verdicts.family_error_rates(real=10)                  # 10 of them differ by 3 points
    assert mixed["family-wise error"] <= ALPHA + 0.003
    plain = verdicts.family_error_rates(real=10, multiplicity_look=False)
    assert mixed["held"] > plain["held"] + 0.1 and mixed["second looks"] > plain["second looks"]


def test_holm_adjusts_by_rank_and_keeps_the_adjusted_p_monotone():
    # by hand: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    p = [0.01, 0.04, 0.03, 0.005]
    expected = [0.03, 0.06, 0.06, 0.02]
    assert list(verdicts._holm_adjusted(np.array([p, p[::-1]]))[1]) == pytest.approx(expected[::-1])
    found = verdicts.holm([dataclasses.replace(order([0.01] * 5, [0.0] * 5, f"Table 1: claim {i}"), p=x)
                           for i, x in enumerate(p)])
    assert [v.adjusted_p for v in found] == pytest.approx(expected)


def test_second_looks_grows_only_the_claims_holm_undid_until_none_is_left():
    weak = [0.02, 0.04, 0.005, 0.03, 0.02]                       # held alone (two looks), not over 3 claims
    strong = [0.02, 0.021, 0.019, 0.02, 0.022] * 2               # the same claim at ten seeds: held
    taken = []

    def grow(claim):
        return lambda: taken.append(claim) or order(strong, [0.0] * 10, claim, looks=2)
    found = Verdicts()
    found.add(dataclasses.replace(order(weak, [0.0] * 5, "Table 1: A beats B", looks=2),
                                  more=grow("Table 1: A beats B")))
    for i in range(2):                                            # undecided claims still count in the family
        found.add(order([0.01, -0.02, 0.015, 0.0, -0.01], [0.0] * 5, f"Table 1: C{i} beats B", looks=2))
    found.add(dataclasses.replace(order(weak, [0.0] * 5, "Fig. 4: A beats B", looks=2),
                                  more=grow("Fig. 4: A beats B")))   # a family of one: stands, no look
    assert found.items[0].category == "inconclusive (multiplicity)" and found.items[3].verdict == "held"
    assert found.second_looks() == 1 and taken == ["Table 1: A beats B"]
    assert found.items[0].label == "held" and found.items[0].seeds == 10 and found.items[0].family_size == 3
    assert found.second_looks() == 0 and taken == ["Table 1: A beats B"]   # each claim looks again once


def test_two_looks_grows_a_straddling_claim_and_keeps_the_growth_for_a_decided_one():
    # values from anything (a numpy toy, not runs): the first five seeds, then ten when the interval straddles
    straddling, ten = [0.01, -0.02, 0.015, 0.0, -0.01], [0.02, 0.021, 0.019, 0.02, 0.022] * 2
    calls = []

    def first(values):
        return lambda looks: calls.append(("first", looks)) or order(values, [0.0] * 5, "Fig. 2b: A beats B",
                                                                    looks=looks)

    def grown():
        calls.append(("grown", 2))
        return order(ten, [0.0] * 10, "Fig. 2b: A beats B", looks=2)

    v = verdicts.two_looks(first(straddling), grown)
    assert calls == [("first", 2), ("grown", 2)] and v.seeds == 10 and v.label == "held"
    calls.clear()
    clear = verdicts.two_looks(first(ten[:5]), grown)            # decided at five: no seeds added now ...
    assert calls == [("first", 2)] and clear.seeds == 5 and clear.decided and clear.more is grown   # ... but kept
    calls.clear()
    once = verdicts.two_looks(first(straddling), grown, looks=1)  # one look planned: the 95% interval, no growth
    assert calls == [("first", 1)] and once.seeds == 5 and once.more is None
    with pytest.raises(ValueError, match=r"^looks: 1 \(no second look\) or 2; got 3"):
        verdicts.two_looks(first(straddling), grown, looks=3)


# ------------------------------------------------------------------------------ beats every other

@pytest.mark.parametrize("rivals", [2, 3, 4, 5])
def test_beats_every_other_with_equal_rivals_errs_at_most_5_percent_either_way(rivals):
    rates = verdicts.every_error_rates(rivals, sd=0.025)
    assert rates["held"] <= 0.05 and rates["reversed"] <= 0.05
    assert verdicts.every_error_rates(rivals, effect=0.05, sd=0.025)["held"] > 0.5   # and it can say held


def test_beats_every_judges_each_rival_and_shows_the_closest():
    a = [_clients_run(s, [[0.80 + 0.01 * s, 0.81, 0.82 + 0.001 * s]] * 12) for s in range(5)]
    far = [_clients_run(s, [[0.60 + 0.01 * s, 0.61, 0.62 + 0.002 * s]] * 12) for s in range(5)]
    near = [_clients_run(s, [[0.80 + 0.01 * s + (0.03 if s % 2 else -0.03), 0.81, 0.82]] * 12) for s in range(5)]
    v = verdicts.beats_every(a, {"far": far, "near": near}, "Table 1: A beats every other")
    assert v.runs[1] is not None and v.runs[1][0] is near[0]          # the curves of the closest rival
    assert v.mean == pytest.approx(order(seed_values(a), seed_values(near)).mean)
    assert v.verdict != "held"                                         # "near" is not beaten
    assert verdicts.beats_every(a, {"far": far}, "Table 1: A beats every other").verdict == "held"


def test_a_rival_that_can_decide_nothing_leaves_held_undecided_but_not_a_refutation_by_the_others():
    a = [_clients_run(s, [[0.70 + 0.004 * s, 0.71, 0.72]] * 12) for s in range(5)]
    better = [_clients_run(s, [[0.78 + 0.003 * s, 0.79, 0.80]] * 12) for s in range(5)]       # beats a by 8 points
    worse = [_clients_run(s, [[0.60 + 0.002 * s, 0.61, 0.62]] * 12) for s in range(5)]
    rising = [_clients_run(s, [[0.40 + 0.03 * r] * 3 for r in range(12)]) for s in range(5)]  # never converges
    stuck = [_clients_run(s, [[0.5] * 3] * 12) for s in range(5)]                             # a constant answer
    for broken in (rising, stuck):
        v = verdicts.beats_every(a, {"better": better, "broken": broken}, "Table 1: A beats every other")
        assert v.label == "not held (reversed)" and v.runs[1][0] is better[0]   # shown against the rival that can decide
        # widened over both rivals, as if the broken one had been judged too
        assert v.p == pytest.approx(verdicts.beats_every(a, {"better": better, "also": better}).p)
        # without a refutation the broken rival still leaves the claim undecided, and never held
        v = verdicts.beats_every(a, {"worse": worse, "broken": broken}, "Table 1: A beats every other")
        assert v.verdict == "inconclusive" and v.label != "held"
    # a's own runs must be able to decide: a still rising refutes nothing
    best = [_clients_run(s, [[0.90 + 0.002 * s, 0.91, 0.92]] * 12) for s in range(5)]
    assert verdicts.beats_every(rising, {"best": best, "broken": stuck}).label.startswith("inconclusive")


def test_the_second_look_adds_seeds_five_to_nine_only_to_a_claim_whose_interval_straddles(monkeypatch):
    import functools

    from fedlab_core import sweeps

    def runs_for(configs, gap):
        # a converged run per config; side "a" (gap > 0) leads by `gap` with a seed-dependent swing of +-2 points
        return [_clients_run(c.seed, [[x, x + 0.05, x + 0.1] for x in [0.7 + gap + (0.02 * (-1) ** c.seed if gap else 0)]]
                             * 12, algorithm=c.algorithm) for c in configs]

    asked = []

    def fake_sweep(configs, **kwargs):
        asked.append(sorted({c.seed for c in configs}))
        return [h for c in configs for h in runs_for([c], 0.025 if c.algorithm == "fedprox" else 0.0)]
    monkeypatch.setattr(sweeps, "sweep", fake_sweep)
    judge = functools.partial(beats, claim="FedProx beats FedAvg")
    a = runs_for([RunConfig(algorithm="fedprox", seed=s) for s in range(5)], 0.025)
    b = runs_for([RunConfig(seed=s) for s in range(5)], 0.0)
    first = judge(a, b, looks=2)
    assert first.straddles and first.seeds == 5              # a small lead that swings by 2 points: undecided
    second = sweeps.second_look(judge, a, b)
    assert asked == [[5, 6, 7, 8, 9]] and second.seeds == 10 and second.decided
    clear = runs_for([RunConfig(algorithm="fedprox", seed=s) for s in range(5)], 0.2)
    asked.clear()
    decided = sweeps.second_look(judge, clear, b)
    assert decided.verdict == "held" and asked == []   # decided at five: no more seeds, unless Holm undoes it
    assert decided.more().seeds == 10 and asked == [[5, 6, 7, 8, 9]]
    assert sweeps.second_look(judge, clear, b, looks=1).more is None   # one look planned: none to take


def test_the_second_look_grows_every_rival_of_a_claim_against_every_other_method(monkeypatch):
    import functools

    from fedlab_core import sweeps

    def runs_for(configs):
        return [_clients_run(c.seed, [[x, x + 0.05, x + 0.1] for x in [0.7 + (0.025 + 0.02 * (-1) ** c.seed
                                                                                if c.algorithm == "fedprox" else 0)]]
                             * 12, algorithm=c.algorithm) for c in configs]
    asked = []
    monkeypatch.setattr(sweeps, "sweep", lambda configs, **kw: asked.append(len(configs)) or runs_for(configs))
    a = runs_for([RunConfig(algorithm="fedprox", seed=s) for s in range(5)])
    rivals = {m: runs_for([RunConfig(algorithm=m, seed=s) for s in range(5)]) for m in ("fedavg", "scaffold")}
    v = sweeps.second_look(functools.partial(verdicts.beats_every, claim="FedProx beats every other"), a, rivals)
    assert asked == [15] and v.seeds == 10 and v.verdict == "held"
    # two looks widen every p: the first look alone is more cautious than a single look
    assert verdicts.beats_every(a, rivals, looks=2).p == pytest.approx(min(1.0, 2 * verdicts.beats_every(a, rivals).p))
