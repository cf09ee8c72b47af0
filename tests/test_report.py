"""The reproducibility report: claims laid against recorded results, loud failures, files, provenance."""
import json

import pandas as pd
import pytest

from fedlab_core import book, report, verdicts
from fedlab_core.report import BEYOND, Entry
from fedlab_core.runs import run
from fedlab_core.store import History


def history(seed, acc, algorithm="fedavg"):
    # a curve that has flattened (the plateau test passes) and scores acc
    rounds = [{"round": r, "mean_client_accuracy": a} for r, a in enumerate((acc - 0.1, acc - 0.05, *[acc] * 6), 1)]
    meta = {"key": f"{algorithm}-{seed}", "code_version": "v", "device": "cpu", "data_checksum": "d",
            "split_hash": f"s{seed}", "threads": 1, "versions": {"torch": "t"}, "samples": {"train": 500}}
    config = {"seed": seed, "dataset": "digits", "model": "mlp", "algorithm": algorithm, "num_rounds": 8}
    return History(config=config, rounds=rounds, final={"mean_client_accuracy": acc}, meta=meta)


def chapter_verdicts():
    found = verdicts.Verdicts()
    a = [history(s, 0.8 + 0.01 * s, "distrans") for s in range(5)]
    b = [history(s, 0.7, "fedavg") for s in range(5)]
    found.add(verdicts.beats(a, b, "Table 1, DH 80%: DisTrans beats FedAvg", paper="+0.02"))
    found.add(verdicts.beats(b, a, "Table 1, DH 0%: FedAvg beats DisTrans"))
    found.add(verdicts.beats(a, b, "Label skew: DisTrans beats FedAvg"))
    return found


CATALOGUE = (Entry("DisTrans", "abstract", "DisTrans wins", "distrans", covers=("Table 1",)),
             Entry("DisTrans", "Table 1", "DisTrans beats the baselines", "distrans", "CIFAR-10"),
             Entry("DisTrans", "Table 9", "something no chapter can run", None, reason="needs MRI volumes"),
             Entry("DisTrans", "Fig. 7", "features separate", "distrans"))


def test_source_is_the_table_or_figure_a_claim_names_first():
    assert report.source_of("Table 2, DH 80%: x") == "Table 2"
    assert report.source_of("Fig. 2a: offsets help") == "Fig. 2a"
    assert report.source_of("Appendix Table 3, 5/5: the CNN wins") == "Appendix Table 3"
    assert report.source_of("Sec. 6: cost") == "Sec. 6"
    for claim in ("Label skew (10/10): x", "Tables 1 and 2: x", "(contrast) x", "Fig. two"):
        assert report.source_of(claim) == BEYOND


def test_record_writes_verdicts_with_the_provenance_of_their_runs(tmp_path):
    path = report.record(chapter_verdicts(), "distrans", section="what-we-found", deviations="Fashion-MNIST",
                         folder=tmp_path)
    saved = json.loads(path.read_text())
    assert path.name == "distrans.json" and saved["paper"] == "DisTrans" and saved["section"] == "what-we-found"
    first = saved["rows"][0]
    assert first["source"] == "Table 1" and first["outcome"] == "held" and first["seeds"] == 5
    assert first["decided"] and first["converged"] and first["score"] == verdicts.LAST_FIFTH
    assert saved["rows"][1]["verdict"] == "not held (reversed)" and saved["rows"][1]["reason"] == "reversed"
    assert first["mean"] == pytest.approx(0.12) and first["paper"] == "+0.02"
    assert [r["key"] for r in first["runs"][0]] == [f"distrans-{s}" for s in range(5)]
    assert first["runs"][1][2] == {**first["runs"][1][2], "seed": 2, "split_hash": "s2", "threads": 1,
                                   "data_checksum": "d", "train_samples": 500}
    assert saved["rows"][2]["source"] == BEYOND
    with pytest.raises(ValueError, match="chapter"):
        report.record(chapter_verdicts(), "nonsense", folder=tmp_path)


def test_a_chapters_stated_budget_and_tuning_follow_its_parameters():
    assert report.budget(180, False, [102, 100, 101], 180) == ("every run trained for all 180 rounds; learning rates "
                                                               "tuned on seeds 100, 101, 102 at 180 rounds")
    assert report.budget(90, True) == "each run stopped once its convergence test passed (at most 90 rounds)"
    assert report.budget(60, False, [0]).endswith("tuned on seed 0")
    assert report.budget(2, False, [100], 1) == ("every run trained for all 2 rounds; learning rates tuned on seed 100 "
                                                 "at 1 round")


def test_claims_table_lays_the_catalogue_against_the_results(tmp_path):
    report.record(chapter_verdicts(), "distrans", section="what-we-found", deviations="Fashion-MNIST",
                  skipped={"Fig. 7": "UMAP_PER_CLIENT is 0 in this profile"}, folder=tmp_path)
    table = report.claims_table(report.read(tmp_path), CATALOGUE, profile="smoke")
    assert list(table["source"]) == ["abstract", "Table 1", "Table 1", "Table 9", "Fig. 7", BEYOND]
    assert table["verdict"].iloc[0] == "1 held, 1 not held (reversed); of 2"  # the abstract sums its tables' verdicts
    assert list(table["verdict"].iloc[1:3]) == ["held", "not held (reversed)"]
    assert table["ours"].iloc[1] == "d = +0.120 [+0.100, +0.140] (5 seeds)"   # mean d and its 95% interval
    assert table["evidence"].iloc[1] == ("digits (embedded); 500 training images; 8 rounds; 5 seeds; score: mean of "
                                         "the last fifth of evaluated rounds")
    assert table["paper's setting"].iloc[1] == "CIFAR-10" and table["deviations"].iloc[1] == "Fashion-MNIST"
    assert table["command"].iloc[1] == "python -m fedlab_core.book --profile smoke --chapters distrans"
    assert table["verdict"].iloc[3] == "not judged" and table["evidence"].iloc[3] == "needs MRI volumes"
    assert table["evidence"].iloc[4] == "UMAP_PER_CLIENT is 0 in this profile"
    assert table["claim"].iloc[5] == "Label skew: DisTrans beats FedAvg"


def test_claims_table_fails_loudly_when_a_claims_results_are_missing(tmp_path):
    with pytest.raises(ValueError, match="no results recorded by chapter.*distrans"):
        report.claims_table({}, CATALOGUE)
    report.record(chapter_verdicts(), "distrans", folder=tmp_path)     # judges Table 1, not Fig. 7, no reason
    with pytest.raises(ValueError, match="no verdict and no reason recorded for DisTrans Fig. 7"):
        report.claims_table(report.read(tmp_path), CATALOGUE)
    found = chapter_verdicts()
    found.add(verdicts.order([1, 2, 3], [0, 1, 2], "Table 8: a table the paper does not have"))
    report.record(found, "distrans", skipped={"Fig. 7": "none"}, folder=tmp_path)
    with pytest.raises(ValueError, match="'Table 8', which the catalogue of DisTrans does not list"):
        report.claims_table(report.read(tmp_path), CATALOGUE)


def test_csv_and_json_hold_the_table(tmp_path):
    report.record(chapter_verdicts(), "distrans", skipped={"Fig. 7": "none"}, folder=tmp_path)
    table = report.claims_table(report.read(tmp_path), CATALOGUE)
    csv, js = report.write(table, tmp_path / "out")
    back = pd.read_csv(csv, keep_default_na=False)
    assert list(back.columns) == list(table.columns) and len(back) == len(table)
    for column in ("source", "claim", "paper's number", "ours", "verdict", "evidence", "command"):
        assert list(back[column].astype(str)) == list(table[column].astype(str)), column
    assert back["runs"].iloc[1] == " ".join([f"distrans-{s}" for s in range(5)] + [f"fedavg-{s}" for s in range(5)])
    assert json.loads(js.read_text()) == json.loads(table.to_json(orient="records"))


def test_the_catalogue_names_every_paper_and_chapters_that_exist():
    stems = set(book.toc_chapters(book.ROOT / "book" / "_toc.yml"))
    assert {e.paper for e in report.CATALOGUE} == set(report.PAPERS)
    assert set(report.CHAPTER_PAPER) <= stems
    for e in report.CATALOGUE:
        assert e.chapter in stems or (e.chapter is None and e.reason), e
        assert e.covers or e.source in {"abstract"} or report.source_of(e.source + ": x") == e.source, e
    assert sum(e.source == "abstract" for e in report.CATALOGUE) == len(report.PAPERS)   # one per abstract


def test_lock_lists_the_installed_versions():
    names = [line.split("==")[0] for line in report.lock().splitlines()]
    assert "torch" in names and "papermill" in names and names == sorted(names, key=str.lower)
    assert not any(n.lower().replace("_", "-") == "fedlab-core" for n in names)   # the project is not on PyPI


def test_a_run_records_its_data_checksum_split_hash_threads_and_versions(tiny, tmp_path):
    a = run(tiny, cache_dir=tmp_path, workers=1)
    again = run(tiny, cache_dir=tmp_path / "again", workers=1)
    other = run(tiny.replace(seed=1), cache_dir=tmp_path, workers=1)
    assert a.meta["threads"] == 1 and a.meta["versions"]["torch"] == a.meta["torch"]
    assert a.meta["split_hash"] == again.meta["split_hash"] and a.meta["data_checksum"] == again.meta["data_checksum"]
    assert a.meta["split_hash"] != other.meta["split_hash"]        # another seed splits the clients otherwise
    assert a.meta["data_checksum"] == other.meta["data_checksum"]  # ... of the same data
    assert report.provenance(a)["split_hash"] == a.meta["split_hash"]


def test_chapters_that_read_results_are_executed_last_and_again_when_results_change(tmp_path):
    assert book.execution_order(["report", "a", "b"]) == ["a", "b", "report"]
    nb = tmp_path / "n.ipynb"
    nb.write_text("{}")
    results = tmp_path / "results"
    results.mkdir()
    before = book._stamp(nb, {}, results)
    (results / "a.json").write_text("{}")
    assert book._stamp(nb, {}, results) != before
    with pytest.raises(ValueError, match="chapters: unknown nonsense"):
        book.execute("smoke", tmp_path, tmp_path / "out", book.ROOT / "book" / "_toc.yml", force=["nonsense"])


def test_claimed_differences_pairs_the_papers_difference_with_ours(tmp_path):
    found = verdicts.Verdicts()
    found.add(verdicts.order([0.3, 0.4, 0.5], [0.0, 0.0, 0.0], "Table 1, 5/5: A beats B", paper="+0.284 (CIFAR-10)"))
    found.add(verdicts.order([1, 2, 3], [0, 0, 0], "Table 1: C beats D", paper="+7.29 points (Office-Caltech-10)"))
    for i, paper in enumerate(("+0.083, +0.006, +0.012", "-0.013 to +0.136", "+0.012 at DH 75% (CH-MNIST)",
                               "ahead (plot)", "")):
        found.add(verdicts.order([1, 2, 3], [0, 0, 0], f"Table 1: E beats F{i}", paper=paper))
    found.add(verdicts.number([0.9, 0.91, 0.92], 0.99, "Table 1: reaches 99%"))   # a claimed number, not a difference
    report.record(found, "ot_fedavg", folder=tmp_path)
    pairs = report.claimed_differences(report.read(tmp_path))
    assert list(pairs["claimed"]) == pytest.approx([0.284, 0.0729])
    assert list(pairs["ours"]) == pytest.approx([0.4, 2.0]) and list(pairs["paper"]) == ["OT preprocessing"] * 2


def test_effects_lists_every_verdict_with_a_number_paper_by_paper_zero_where_the_rule_turns(tmp_path):
    found = verdicts.Verdicts()
    found.add(verdicts.number([0.9, 0.91, 0.92, 0.9, 0.92], 0.99, "Table 1: reaches 99%"))
    found.add(verdicts.order([0.3, 0.4, 0.5], [0.0, 0.0, 0.0], "Table 1, 5/5: A beats B"))
    report.record(found, "ot_fedavg", folder=tmp_path)
    report.record(chapter_verdicts(), "distrans", folder=tmp_path)
    table = report.effects(report.read(tmp_path))
    assert list(table["paper"]) == ["DisTrans"] * 3 + ["OT preprocessing"] * 2     # in the order of PAPERS
    number, ordering = table.iloc[3], table.iloc[4]
    assert number["effect"] == pytest.approx(0.91 - 0.99)                          # ours minus the paper's
    assert number["low"] < number["effect"] < number["high"] < 0 and number["outcome"] == verdicts.NOT_REACHED
    assert ordering["effect"] == pytest.approx(0.4) and ordering["outcome"] == verdicts.INCONCLUSIVE   # 3 seeds
    assert ordering["low"] < 0.4 < ordering["high"] and ordering["category"].startswith("inconclusive (fewer")


def test_chapter_times_are_kept_for_the_book_profile_only(tmp_path, monkeypatch):
    monkeypatch.setattr(book, "TIMINGS", tmp_path / "chapter_seconds.json")
    assert book._timings("book") == {}
    book._timings("book", {"distrans": 61.234})
    assert book._timings("book") == {"distrans": 61.2}       # what the next build estimates the time left from
    assert book._timings("smoke") == {}
    assert json.loads((tmp_path / "chapter_seconds.json").read_text()) == {"distrans": 61.2}


def test_first_screen_counts_per_paper_what_was_decided_and_why_the_rest_was_not(tmp_path):
    found = chapter_verdicts()
    a = [history(s, 0.8 + 0.01 * s, "distrans") for s in range(5)]
    found.add(verdicts.beats(a[:2], a[:2], "Table 1, DH 40%: DisTrans beats itself"))      # two seeds only
    report.record(found, "distrans", skipped={"Fig. 7": "UMAP_PER_CLIENT is 0"}, folder=tmp_path)
    text = report.first_screen(report.claims_table(report.read(tmp_path), CATALOGUE))
    distrans = text.split("**DisTrans**")[1].split("**OT preprocessing**")[0]
    assert distrans.startswith(": 4 claims judged on our runs, 3 decided (2 held, 1 not held (reversed)); "
                               "1 undecided (1 inconclusive (fewer than 5 seeds)); 2 of the paper's tables and "
                               "figures not judged (UMAP_PER_CLIENT is 0; needs MRI volumes).")
    assert "**FRAug**: 0 claims judged on our runs, 0 decided." in text
    assert "- *" not in text                                 # counts only: the claims come after the pictures
    listed = report.decided(report.claims_table(report.read(tmp_path), CATALOGUE))
    distrans = listed.split("**DisTrans**")[1].split("**OT preprocessing**")[0]
    title = report.chapter_title("distrans")   # each link is labelled with its chapter's title
    assert f"- *held*: Table 1, DH 80%: DisTrans beats FedAvg ([{title}](distrans.ipynb))" in distrans
    assert distrans.count("- *") == 3 and "DisTrans beats itself" not in distrans   # undecided: counted, not listed
    assert "**FRAug**: none decided." in listed
    # the landing page's findings: the same counts, the held claim first, each linked to its chapter's page
    page = report.headlines(report.claims_table(report.read(tmp_path), CATALOGUE), shown=1)
    distrans = page.split("<strong>DisTrans</strong>")[1].split("<strong>OT preprocessing</strong>")[0]
    assert distrans.startswith(": of 4 claims judged on our runs, the rule decided 3 (2 held, 1 not held "
                               "(reversed)); 1 undecided.<ul><li><em>held</em>: ")
    assert f'(<a href="chapters/distrans.html">{title}</a>)' in distrans
    assert '<li>2 more in <a href="chapters/report.html">the report</a></li>' in distrans
    assert "beats itself" not in page and page.count("<strong>") == len(report.PAPERS)


def test_a_chapters_title_is_its_notebooks_first_level_one_heading(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# not a heading"),
                                         nbformat.v4.new_markdown_cell("Before it.\n\n## A section\n# The title\n"),
                                         nbformat.v4.new_markdown_cell("# A later heading")])
    nbformat.write(nb, tmp_path / "chapter.ipynb")
    assert report.chapter_title("chapter", tmp_path) == "The title"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no heading")]),
                   tmp_path / "bare.ipynb")
    with pytest.raises(ValueError, match="no level-one heading"):
        report.chapter_title("bare", tmp_path)


def test_the_stopping_replay_measures_how_far_a_stop_lies_from_the_end_per_patience():
    from fedlab_core import RunConfig
    from fedlab_core.store import History

    def run(values, **meta):
        rounds = [{"round": 5 * (i + 1), "mean_client_accuracy": v} for i, v in enumerate(values)]
        return History(RunConfig().to_dict(), rounds, {"mean_client_accuracy": values[-1]}, meta)

    # flat for ten evaluations, then a second climb of ten points: a first flat stretch stops it too early
    late = run([0.5] * 10 + [0.5 + 0.01 * i for i in range(1, 11)] + [0.6] * 10)
    flat = run([0.7] * 30)
    stopped = run([0.7] * 30, stopped_at_plateau=150)             # already stopped: not a long run
    short = run([0.7] * 10)
    table = report.stopping_replay([late, flat, stopped, short], patiences=(1, 12))
    assert list(table["runs"]) == [2, 2] and list(table["stopped early"]) == [2, 1]
    # patience 1 stops `late` at its sixth evaluation (0.5) against 0.6 at the end: 10 points; `flat`: 0
    assert table.loc[1, "median |end - stop| (points)"] == pytest.approx(5.0)
    assert table.loc[1, "share over 2 points"] == pytest.approx(0.5)
    # twelve passes in a row never happen in `late`'s first flat stretch: it is not stopped at all
    assert table.loc[12, "share over 2 points"] == 0.0 and table.loc[12, "median |end - stop| (points)"] == pytest.approx(0.0)


def test_the_provenance_table_says_where_each_chapters_runs_were_computed():
    def entry(key, device, executor=None):
        r = {"key": key, "seed": 0, "code_version": "v", "data_checksum": "d", "split_hash": "s", "threads": 1,
             "versions": {"torch": "2.14.1"}, "device": device}
        return r if executor is None else {**r, "executor": executor}  # records before the executor was kept lack it
    results = {"quickstart": {"rows": [{"runs": [[entry("a", "cpu"), entry("b", "cpu", "loop")],
                                                 [entry("c", "cuda", "batched"), entry("a", "cpu")]]}]}}
    table = report.provenance_table(results)
    assert table.loc[0, "runs"] == 3 and table.loc[0, "computed on"] == "cpu, loop: 2; cuda, batched: 1"


def test_the_protocol_sentences_follow_each_parameter():
    evidence = report.protocol(90, False, 0.1, [100, 101, 102], [0, 1, 2, 3, 4], 2)
    assert evidence == {
        "budget_rule": "Every run trains for all 90 rounds, so both arms of every comparison get one budget.",
        "monitor_rule": "a validation share held out of each client's training images (10%), never the test set",
        "tune_seeds": "3 seeds (100, 101, 102), none of which the tables evaluate on",
        "tune_choice": "the smallest rate within one standard error (over the seeds) of the best is chosen",
        "second_look_rule": "Where five seeds leave a claim's interval straddling, or its interval decides but "
                            "Holm's adjustment over its table does not, five more are added (the rule's second look)."}
    earlier = report.protocol(90, True, 0.0, [0], [0, 1, 2, 3, 4], 1)   # each setting changes its own sentence
    assert all(earlier[k] != evidence[k] for k in evidence)
    assert earlier["budget_rule"].startswith("Every run stops once its convergence test passes (at most 90 rounds)")
    assert earlier["monitor_rule"].startswith("the test curve")
    assert earlier["tune_seeds"] == "1 seed (0), which the tables also evaluate on"
    assert earlier["tune_choice"].startswith("with one seed there is no standard error")
    assert "no second look" in earlier["second_look_rule"]
    assert report.protocol(90, False, 0.1, [4, 100], range(5), 2)["tune_seeds"] == \
        "2 seeds (4, 100), of which the tables also evaluate on 4"
    revised = report.protocol(90, False, 1.0, [100, 101, 102], range(5), 2, validation_source="unused", converging=True)
    assert revised["monitor_rule"].startswith("a validation set per client, as large as its test set and with its "
                                              "classes, drawn from the training images that no client holds")
    assert "0.5 times its test set" in report.protocol(90, False, 0.5, [100], range(5), 2, "unused")["monitor_rule"]
    assert revised["tune_choice"] == ("of the rates within one standard error (over the seeds) of the best, those "
                                      "whose tuning runs have converged by their last round (the mean of their "
                                      "validation curves over the seeds passes the convergence test) come first, then "
                                      "the smallest")
    assert report.protocol(90, False, 0.1, [100], range(5), 2, converging=True)["tune_choice"] == earlier["tune_choice"]
    # a chapter with one class per client says where that regime's rates come from; the others say nothing of it
    own = report.protocol(90, False, 1.0, [100, 101, 102], range(5), 2, one_class=True)["tune_one_class"]
    assert own.startswith("One class per client is tuned on its own benchmark") and "degenerate" in own
    assert report.protocol(90, False, 1.0, [100, 101, 102], range(5), 2, one_class=False)["tune_one_class"] == (
        "One class per client takes the label-skew benchmark's rates (TUNE_ONE_CLASS = True tunes that regime on its "
        "own benchmark).")
    # a benchmark given a longer horizon: the budget names its rounds, and says it was tuned there
    longer = report.protocol(90, False, 1.0, [100, 101, 102], range(5), 2, horizons={"label skew": 180})
    assert longer["budget_rule"] == ("Every run trains for all its benchmark's rounds, 90 (180 on label skew), so both "
                                     "arms of every comparison get one budget; a benchmark given more rounds is tuned "
                                     "at them.")
    assert report.protocol(90, True, 1.0, [100], range(5), 2, horizons={"label skew": 180})["budget_rule"].startswith(
        "Every run stops once its convergence test passes (at most 90 rounds, 180 on label skew), so")
    assert report.protocol(90, False, 1.0, [100], range(5), 2, horizons={})["budget_rule"] == evidence["budget_rule"]


def test_rounds_text_names_each_longer_horizon_after_the_pages_rounds():
    assert report.rounds_text(90, {}) == "90"
    assert report.rounds_text(90, {"label skew": 180, "feature skew": 120}) == "90 (180 on label skew, 120 on feature skew)"
    assert report.rounds_text(90, {"FedAvg": 360}, "for") == "90 (360 for FedAvg)"
