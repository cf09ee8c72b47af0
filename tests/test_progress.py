"""What a sweep says while it computes (fedlab_core.progress): the estimate before it starts, priced from the
archive's own timings, and the lines as runs end."""
import re

import pytest

from fedlab_core import RunConfig, progress
from fedlab_core.store import Archive

BASE = RunConfig(dataset="fashion_mnist", num_clients=4, num_rounds=10, max_train_samples=2000, max_test_samples=200)


def _archive(folder, seconds, config=BASE, rounds=10, train=2000):
    """An archive of one run of `config` that took `seconds` over `rounds` rounds on `train` images."""
    doc = {"config": {k: v for k, v in config.to_dict().items() if k in ("algorithm", "augment", "model", "dataset")},
           "rounds": [{"round": r + 1} for r in range(rounds)], "final": {},
           "meta": {"seconds": seconds, "samples": {"train": train}}}
    folder.mkdir(exist_ok=True)
    Archive.write(folder / f"{config.algorithm}{rounds}.json.gz", doc)
    progress._rates.cache_clear()
    return Archive(folder)


def test_a_run_is_priced_from_archived_runs_of_its_method_by_rounds_images_and_epochs(tmp_path):
    archive = _archive(tmp_path / "runs", seconds=100.0)
    same, longer, more, fedprox = progress.estimate(
        [BASE, BASE.replace(num_rounds=30), BASE.replace(max_train_samples=4000, local_epochs=2),
         BASE.replace(algorithm="fedprox")], archive)
    assert same == pytest.approx(progress.SETUP + 100.0)
    assert longer - progress.SETUP == pytest.approx(3 * 100.0)
    assert more - progress.SETUP == pytest.approx(4 * 100.0)
    assert fedprox == pytest.approx(same)          # no fedprox run archived: priced at every run's rate


def test_a_method_is_priced_from_its_own_runs_when_the_archive_holds_some(tmp_path):
    folder = tmp_path / "runs"
    _archive(folder, seconds=100.0)
    archive = _archive(folder, seconds=400.0, config=BASE.replace(algorithm="scaffold"), rounds=20)
    fedavg, scaffold = progress.estimate([BASE, BASE.replace(algorithm="scaffold")], archive)
    assert fedavg - progress.SETUP == pytest.approx(100.0)
    assert scaffold - progress.SETUP == pytest.approx(200.0)   # 400 s over 20 rounds: 20 s a round


def test_without_an_archive_a_run_is_priced_at_a_minute(tmp_path):
    assert progress.estimate([BASE], Archive(tmp_path / "none")) == [60.0]


def test_the_report_says_the_count_and_estimate_first_then_each_end_with_the_time_left(tmp_path, monkeypatch,
                                                                                       capsys):
    monkeypatch.setenv("FEDLAB_ARCHIVE_DIR", str(tmp_path / "runs"))
    _archive(tmp_path / "runs", seconds=595.0)        # with SETUP: ten minutes a run
    configs = [BASE.replace(seed=s) for s in range(5)]
    report = progress.Report(configs, todo=[1, 2, 3, 4], workers=2, lines=True)
    clock = iter([0.0, 0.0, 300.0, 600.0])          # two start at 0; the first ends at 300 s (half its estimate)
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    report.start(1), report.start(2)
    report.finish(1)
    lines = capsys.readouterr().err.splitlines()    # outside a notebook, on stderr as progress goes
    assert lines[0] == "runs: computing 4 of 5 runs (1 from the archive or cache), about 20 min on 2 processes"
    # at half the estimated pace: runs 3 and 4 queued (2 x 5 min) and run 2 (5 min, just ended by that pace)
    assert re.fullmatch(r"runs: 1 of 4 done, about 5 min left; computing fedavg, iid, seed 2", lines[1]), lines[1]


def test_runs_trained_together_share_their_time_in_the_pace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDLAB_ARCHIVE_DIR", str(tmp_path / "runs"))
    _archive(tmp_path / "runs", seconds=595.0)        # with SETUP: ten minutes a run, priced from a CPU run
    configs = [BASE.replace(seed=s) for s in range(4)]
    report = progress.Report(configs, todo=[0, 1, 2, 3], workers=1, lines=True, place="one GPU")
    clock = iter([0.0, 0.0] + [60.0] * 4)            # runs 0 and 1 trained together in one minute
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    report.start(0), report.start(1)
    report.finish(0, share=0.5), report.finish(1, share=0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "runs: computing 4 of 4 runs (0 from the archive or cache), about 40 min on one GPU"
    assert lines[2] == "runs: 2 of 4 done, about 60 s left"   # a minute a pair, not two


@pytest.mark.parametrize("seconds, words", [(40, "40 s"), (540, "9 min"), (9000, "2.5 hours")])
def test_durations_read_at_a_glance(seconds, words):
    assert progress.duration(seconds) == words


def test_a_run_is_named_by_method_split_and_seed():
    assert progress.label(BASE.replace(algorithm="fedavg", augment="fedrdn", partition="dirichlet", alpha=0.1,
                                       seed=3)) == "fedavg+fedrdn, dirichlet(0.1), seed 3"
    assert progress.label(BASE.replace(partition="distrans", dh=0.5)) == "fedavg, distrans(0.5), seed 0"
