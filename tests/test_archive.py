"""The archive of the book's runs: written only when asked, read before the cache, keyed without the code's
digest, verified bit for bit against the current code, and a hand-edited number caught by run and round; the
stored timings, read instead of measured and stale once the timed code or libraries move."""

import json

import pytest
import torch

from fedlab_core import kernels
from fedlab_core import runs as runs_module
from fedlab_core import store
from fedlab_core.runs import RunConfig, rerun, run
from fedlab_core.store import Archive
from fedlab_core.verification import verify

CPU = torch.device("cpu")


@pytest.fixture
def archive(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE_DIR", str(tmp_path / "archive"))
    return Archive()


def test_runs_enter_the_archive_only_when_writing_is_on(tiny, tmp_path, archive, monkeypatch):
    run(tiny, cache_dir=tmp_path / "cache", workers=1)
    assert not list(archive.entries())                                   # reading is the default
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    first = run(tiny, cache_dir=tmp_path / "cache", workers=1)         # a cache hit is archived too
    [(key, stored)] = list(archive.entries())
    assert key == store.archive_key(tiny, CPU) == store.archive_key(RunConfig(**stored.config), "cpu")
    assert stored.rounds == first.rounds
    assert stored.meta["code_version"] == store.code_version() and stored.meta["kernels"] == kernels.signature()
    # an archived run is read, not recomputed, whatever the cache holds
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("an archived run was re-run"))
    again = run(tiny, cache_dir=tmp_path / "empty", workers=1)
    assert again.rounds == first.rounds and again.final == first.final


def test_a_field_added_to_the_config_later_at_its_default_keeps_the_archives_key_and_entry(tiny, tmp_path, archive,
                                                                                             monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    first = run(tiny, cache_dir=tmp_path, workers=1)
    [(key, _)] = list(archive.entries())
    assert "validation" not in store.settings(tiny) and store.settings(tiny)["dataset"] == tiny.dataset
    assert store.archive_key(tiny.replace(validation=0.2), CPU) != key   # a field off its default names the run
    # an entry written before a field existed: its stored config lacks the field, at its default today
    path = archive.path(key)
    doc = Archive.read(path)
    del doc["config"]["validation"]
    Archive.write(path, doc)
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("an archived run was re-run"))
    assert run(tiny, cache_dir=tmp_path / "empty", workers=1).rounds == first.rounds
    doc["config"]["seed"] = 7                                            # another run's config: refused
    Archive.write(path, doc)
    with pytest.raises(ValueError, match="another run's config"):
        run(tiny, cache_dir=tmp_path / "empty", workers=1)


def test_use_cache_false_ignores_the_archive(tiny, tmp_path, archive, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    run(tiny, cache_dir=tmp_path, workers=1)
    calls = []
    real = runs_module.build
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: calls.append(1) or real(*a, **k))
    run(tiny, use_cache=False, workers=1)
    assert calls == [1]


def test_verify_passes_on_the_codes_own_runs_and_names_a_hand_edited_number(tiny, tmp_path, archive, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    for config in (tiny, tiny.replace(seed=1), tiny.replace(algorithm="fedprox")):
        run(config, cache_dir=tmp_path, workers=1)
    checks = verify(rerun, archive, rounds=2)
    assert len(checks) == 2                                   # one run per distinct algorithm (fedavg, fedprox)
    assert all(c.ok and c.first_difference is None and c.rounds == 2 for c in checks)
    assert len(verify(rerun, archive, rounds=None, every=True)) == 3
    assert verify(rerun, archive, rounds=2, workers=2) == checks           # side by side: the same checks
    # edit one stored number by hand: verification fails, naming the run and the round
    key = store.archive_key(tiny.replace(algorithm="fedprox"), CPU)
    path = archive.path(key)
    doc = Archive.read(path)
    doc["rounds"][1]["mean_client_accuracy"] += 1e-12
    Archive.write(path, doc)
    [bad] = [c for c in verify(rerun, archive, rounds=2) if c.key == key]
    assert not bad.ok and bad.first_difference == 2 and bad.largest_difference == pytest.approx(1e-12, rel=0.01)
    assert key in str(bad) and "round 2" in str(bad)
    assert [c for c in verify(rerun, archive, rounds=1) if c.key == key][0].ok   # round 1 is untouched
    # a run whose kernels differ from this machine's (another canary, or none recorded: computed before the
    # kernels were pinned): the difference is reported, with why, not failed
    doc["meta"]["kernels"]["canary"] = "0123456789ab"
    Archive.write(path, doc)
    [other] = [c for c in verify(rerun, archive, rounds=2) if c.key == key]
    assert other.ok and other.first_difference == 2 and "reported, not failed" in str(other)
    assert "canary 0123456789ab" in str(other) and kernels.signature()["canary"] in str(other)
    del doc["meta"]["kernels"]
    Archive.write(path, doc)
    [legacy] = [c for c in verify(rerun, archive, rounds=2) if c.key == key]
    assert legacy.ok and "before the kernels were pinned" in str(legacy)
    # per group, a run these kernels can check strictly is chosen over a cheaper one they cannot
    [chosen] = [c for c in verify(rerun, archive, rounds=2) if c.label.startswith("fedprox")]
    assert chosen.key == key and not chosen.same_kernels      # the only fedprox run
    doc["meta"]["seconds"] = 0.0                               # the cheapest fedavg run, but computed elsewhere
    other_key = store.archive_key(tiny.replace(seed=1), CPU)
    other_doc = Archive.read(archive.path(other_key))
    del other_doc["meta"]["kernels"]
    other_doc["meta"]["seconds"] = 0.0
    Archive.write(archive.path(other_key), other_doc)
    [fedavg] = [c for c in verify(rerun, archive, rounds=2) if c.label.startswith("fedavg")]
    assert fedavg.key == store.archive_key(tiny, CPU) and fedavg.same_kernels


def test_verification_also_checks_one_run_per_way_of_drawing_a_validation_set(tiny, tmp_path, archive, monkeypatch):
    # the held-out share and the unused images are drawn by code of their own: a change there must show, though
    # the runs share their algorithm, data, model and split with a run that holds no validation set
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    small = tiny.replace(max_train_samples=600)
    configs = [small, small.replace(seed=1, validation_monitor=0.2),
               small.replace(seed=2, validation_monitor=1.0, validation_source="unused")]
    for config in configs:
        run(config, cache_dir=tmp_path, workers=1)
    keys = [store.archive_key(c, CPU) for c in configs]

    def timed(cheapest):   # the group's run is its cheapest per round: set the timings, not left to the clock
        for key in keys:
            doc = Archive.read(archive.path(key))
            doc["meta"]["seconds"] = 1.0 if key == cheapest else 9.0
            Archive.write(archive.path(key), doc)
        return verify(rerun, archive, rounds=1)

    # both validation runs are checked, and the group's run, the run without one, too
    checks = timed(keys[0])
    assert sorted(c.key for c in checks) == sorted(keys) and all(c.ok for c in checks)
    # a run chosen for its group as well as for its way of drawing is checked once
    checks = timed(keys[1])
    assert sorted(c.key for c in checks) == sorted(keys[1:]) and all(c.ok for c in checks)
    key = store.archive_key(configs[2], CPU)                  # the unused images' validation curve, edited
    doc = Archive.read(archive.path(key))
    doc["rounds"][0]["client_validation_accuracy"][0] += 1e-12
    Archive.write(archive.path(key), doc)
    assert [c.ok for c in verify(rerun, archive, rounds=1) if c.key == key] == [False]


def test_verification_checks_a_reference_recomputed_with_the_pinned_kernels_while_the_book_reads_the_entry(
        tiny, tmp_path, archive, monkeypatch):
    # the archive's entry was computed before the pins (no kernels recorded); its reference, in pinned/, with them
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    fresh = run(tiny, cache_dir=tmp_path, workers=1)
    key = store.archive_key(tiny, CPU)
    path = archive.path(key)
    (archive.folder / store.REFERENCES).mkdir()
    reference = archive.folder / store.REFERENCES / path.name
    reference.write_bytes(path.read_bytes())
    legacy = Archive.read(path)
    del legacy["meta"]["kernels"]
    legacy["rounds"][0]["mean_client_accuracy"] += 0.01        # other kernels, other floats
    Archive.write(path, legacy)
    assert run(tiny, cache_dir=tmp_path / "elsewhere").rounds == legacy["rounds"]   # the book reads the entry
    assert [k for k, _ in archive.references()] == [key]
    [check] = verify(rerun, archive, rounds=2)                   # the group's run: the reference, strictly
    assert check.key == f"pinned/{key}" and check.same_kernels and check.ok and check.first_difference is None
    assert len(verify(rerun, archive, rounds=1, every=True)) == 2
    doc = Archive.read(reference)
    doc["rounds"][1]["train_loss"] += 1e-9                     # a hand-edited reference fails, named
    Archive.write(reference, doc)
    [bad] = verify(rerun, archive, rounds=2)
    assert not bad.ok and bad.first_difference == 2 and f"pinned/{key}" in str(bad)
    assert fresh.rounds[1]["train_loss"] != doc["rounds"][1]["train_loss"]


def test_a_full_verification_resumes_from_its_journal(tiny, tmp_path, archive, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    for seed in (0, 1):
        run(tiny.replace(seed=seed), cache_dir=tmp_path, workers=1)
    journal = tmp_path / "journal.jsonl"
    first = verify(rerun, archive, rounds=None, every=True, journal=journal)
    calls = []
    again = verify(lambda h, k: calls.append(k) or rerun(h, k), archive, rounds=None, every=True, journal=journal)
    assert calls == [] and [c.key for c in again] == [c.key for c in first] and all(c.ok for c in again)


def test_rerun_stops_after_k_rounds_of_the_same_run(tiny):
    full = run(tiny.replace(num_rounds=4), use_cache=False, workers=1)
    first = rerun(full, 2)
    assert [r["round"] for r in first] == [1, 2]
    assert [r["mean_client_accuracy"] for r in first] == [r["mean_client_accuracy"] for r in full.rounds[:2]]


@pytest.mark.every_core
def test_the_repositorys_archive_verifies():
    """`make test` re-runs the first rounds of one archived run per method, data, model and split."""
    archive = Archive(store.ARCHIVE_DIR)
    entries = list(archive.entries())
    assert entries, f"{archive.folder} holds no runs"
    checks = verify(rerun, archive, rounds=2, progress=False, workers=2)
    failed = [str(c) for c in checks if not c.ok]
    assert not failed, "archived runs the current code no longer reproduces (recompute them):\n" + "\n".join(failed)


def test_a_sweep_reads_stored_runs_itself_and_starts_none_after_its_deadline(tiny, tmp_path, monkeypatch):
    import time

    from fedlab_core.sweeps import BudgetSpent, sweep

    configs = [tiny.replace(seed=s) for s in range(3)]
    first = sweep(configs[:2], max_workers=2, cache_dir=tmp_path)
    monkeypatch.setenv("FEDLAB_DEADLINE", str(time.time() - 1))     # the budget is spent
    again = sweep(configs[:2], max_workers=2, cache_dir=tmp_path)    # stored: read, no process started
    assert [h.rounds for h in again] == [h.rounds for h in first]
    with pytest.raises(BudgetSpent, match="FEDLAB_DEADLINE.*1 of 3 runs"):
        sweep(configs, max_workers=2, cache_dir=tmp_path)
    assert not list(tmp_path.glob(f"{store.cache_key(configs[2], CPU)}.*"))   # the third never started


def test_compute_stops_cleanly_when_the_time_runs_out(monkeypatch, tmp_path, capsys):
    from papermill.exceptions import PapermillExecutionError

    from fedlab_core import book

    monkeypatch.setenv("FEDLAB_ARCHIVE_DIR", str(tmp_path))
    seen = {}

    def spent(*args, **kwargs):
        seen.update(kwargs, deadline=float(book.os.environ["FEDLAB_DEADLINE"]), archive=book.os.environ["FEDLAB_ARCHIVE"])
        raise PapermillExecutionError(0, 1, "sweep(...)", "BudgetSpent", "the time budget ran out", [])

    monkeypatch.setattr(book, "execute", spent)
    for name in ("FEDLAB_DEADLINE", "FEDLAB_ARCHIVE", "FEDLAB_BACKEND"):   # compute() sets them: restored after
        monkeypatch.setenv(name, "")
    assert book.compute("distrans", hours=0.5) == 3
    assert seen["only"] == ["distrans"] and seen["archive"] == "write"
    assert "run the same command to continue" in capsys.readouterr().out
    monkeypatch.setattr(book, "execute", lambda *a, **k: (_ for _ in ()).throw(
        PapermillExecutionError(0, 1, "x", "ValueError", "a real error", [])))
    with pytest.raises(PapermillExecutionError):      # any other failure is not swallowed
        book.compute("distrans")


def test_entries_are_gzipped_json_with_the_same_bytes_for_the_same_run(tiny, tmp_path, archive, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    history = run(tiny, cache_dir=tmp_path, workers=1)
    path = archive.path(store.archive_key(tiny, CPU))
    first = path.read_bytes()
    assert path.name.endswith(".json.gz") and first[:2] == b"\x1f\x8b"          # gzip's magic number
    assert Archive.read(path)["rounds"] == history.rounds
    archive.add(history, tiny, CPU)                                              # written again: no timestamp inside
    assert path.read_bytes() == first
    # timings keep four significant digits (the rest is the machine's noise); the numbers keep every digit
    doc = Archive.read(path)
    timings = [row[k] for row in doc["rounds"] for k in ("train_seconds", "eval_seconds")] + [doc["meta"]["seconds"]]
    assert all(t > 0 and t == float(f"{t:.4g}") for t in timings)
    assert any(len(repr(row["train_loss"])) > 8 for row in doc["rounds"])


def test_the_archive_refuses_a_run_computed_with_other_kernels(tiny, tmp_path, archive):
    """Only runs that verify on every x86-64 machine with AVX2 enter the archive, refused in one line."""
    history = run(tiny, cache_dir=tmp_path, workers=1)
    history.meta["kernels"]["canary"] = "0123456789ab"                  # computed where the pins did not hold
    with pytest.raises(RuntimeError, match=r"^kernels: .*canary 0123456789ab") as err:
        archive.add(history, tiny, CPU)
    assert "\n" not in str(err.value)
    del history.meta["kernels"]                                          # recorded before the pins
    with pytest.raises(RuntimeError, match="not recorded"):
        archive.add(history, tiny, CPU)
    assert not list(archive.folder.glob("*"))


CARRIED_DATA = 10e6  # the Fashion-MNIST subset a GPU check carries beside the tree (20,000 images: 9.4 MB)


def test_the_working_tree_travels_light():
    """The tracked files (the archive most of them), counted as the disk holds them (whole blocks), leave room in
    the 64 MiB a check on another machine may carry for the data subset it carries beside them."""
    import subprocess
    from pathlib import Path

    root = Path(store.__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    files = [root / name for name in listed.stdout.decode().split("\0") if name]
    used = sum(p.stat().st_blocks * 512 for p in files if p.is_file())
    assert len(files) > 100 and used + CARRIED_DATA < 64 * 2**20, (
        f"the tracked files take {used / 2**20:.1f} MiB on disk: with the data a GPU check carries, over 64 MiB")


def _as_computed_on_cuda(history, config, archive):
    """Archive `history` as if a GPU had computed it (its meta says so), under the CUDA key; returns the key."""
    archive.add(history.with_meta(device="cuda", kernels=None), config, torch.device("cuda"))
    return store.archive_key(config, "cuda")


def test_an_archived_run_is_read_whatever_device_would_compute_it_now(tiny, tmp_path, archive, monkeypatch):
    # torch.device("cuda") needs no GPU: the lookups only name the device type
    cuda = torch.device("cuda")
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    on_cpu = run(tiny, cache_dir=tmp_path, device="cpu", workers=1)
    monkeypatch.delenv("FEDLAB_ARCHIVE")
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("an archived run was re-run"))
    assert archive.key_of(tiny, cuda) == store.archive_key(tiny, CPU)
    assert archive.get(tiny, cuda).meta["device"] == "cpu"
    monkeypatch.setattr(runs_module, "resolve_device", lambda device: cuda)   # this machine as if it had a GPU
    found = run(tiny, cache_dir=tmp_path / "empty")
    assert found.rounds == on_cpu.rounds and found.meta["device"] == "cpu"  # the page shows where it was computed
    cuda_key = _as_computed_on_cuda(on_cpu, tiny, archive)
    assert run(tiny, cache_dir=tmp_path / "empty").meta["device"] == "cuda"  # the device's own entry comes first
    archive.path(store.archive_key(tiny, CPU)).unlink()
    monkeypatch.setattr(runs_module, "resolve_device", lambda device: CPU)
    assert archive.key_of(tiny, CPU) == cuda_key and run(tiny, cache_dir=tmp_path / "empty").meta["device"] == "cuda"


def test_an_archived_run_is_read_under_another_build_of_the_same_pytorch_release(tiny, tmp_path, archive,
                                                                                   monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    run(tiny, cache_dir=tmp_path, workers=1)
    monkeypatch.delenv("FEDLAB_ARCHIVE")
    [(key, _)] = list(archive.entries())
    release = torch.__version__.split("+")[0]
    monkeypatch.setattr(store, "ARCHIVE_BUILDS", (torch.__version__,))
    monkeypatch.setattr(torch, "__version__", f"{release}+other")          # say, "+cpu" from PyTorch's CPU index
    assert archive.key_of(tiny, CPU) == key
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("an archived run was re-run"))
    assert run(tiny, cache_dir=tmp_path / "empty").meta["torch"] == store.ARCHIVE_BUILDS[0]  # the build that computed it
    monkeypatch.setattr(torch, "__version__", "99.0.0+cpu")                  # another release: its own runs
    assert archive.key_of(tiny, CPU) is None


def test_archive_builds_name_the_build_of_every_archived_run():
    archive = Archive(store.ARCHIVE_DIR)
    builds = {h.meta.get("torch") for _, h in [*archive.entries(), *archive.references()]}
    assert builds <= set(store.ARCHIVE_BUILDS), builds - set(store.ARCHIVE_BUILDS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU re-runs a GPU's run")
def test_verification_reports_a_run_computed_on_a_gpu_as_not_checkable_on_a_machine_without_one(tiny, tmp_path,
                                                                                                archive, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    on_cpu = run(tiny, cache_dir=tmp_path, device="cpu", workers=1)
    cuda_key = _as_computed_on_cuda(on_cpu, tiny, archive)
    checks = verify(rerun, archive, rounds=2)
    [chosen] = checks                                   # of the group, the run this machine can re-run
    assert chosen.key == store.archive_key(tiny, CPU) and chosen.first_difference is None
    archive.path(chosen.key).unlink()
    [check] = verify(lambda h, k: pytest.fail("a GPU's run was re-run on a CPU"), archive, rounds=2,
                     journal=tmp_path / "journal.jsonl")
    assert check.ok and check.key == cuda_key and check.unavailable == "cuda"
    assert str(check) == (f"{cuda_key} (fedavg / none / digits / mlp / iid, seed 0): not checkable on this machine, "
                          f"which has no cuda device (the run was computed on one); not re-run")
    assert not (tmp_path / "journal.jsonl").exists()  # not journaled: a machine with a GPU checks it


def test_make_verify_counts_apart_the_runs_this_machine_cannot_check(monkeypatch, tmp_path, capsys):
    from fedlab_core import book, verification
    from fedlab_core.verification import Check

    monkeypatch.setenv("FEDLAB_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.setenv("FEDLAB_MEASUREMENTS_DIR", str(tmp_path / "measurements"))
    checks = [Check("a", "fedavg", 2), Check("b", "fedavg", 0, unavailable="cuda")]
    monkeypatch.setattr(verification, "verify", lambda **kwargs: checks)
    assert book.verify_archive() == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("[verify] 1 archived runs re-run (first 2 rounds)")
    assert last.endswith("all bit-identical; 1 not checkable on this machine's devices")


# ------------------------------------------------------------------------------------- stored timings

@pytest.fixture
def measurements(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLAB_MEASUREMENTS_DIR", str(tmp_path / "measurements"))
    return store.Measurements()


def test_a_timing_is_measured_once_stored_when_writing_and_then_read_not_remeasured(measurements, monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return {"seconds": [0.5 * len(calls), 2.0]}

    source = ("augment/ot_align.py",)
    first = measurements.get("cost", {"M": [1, 2]}, measure, source)  # not writing: measured, not kept
    assert not first["stored"] and measurements.get("cost", {"M": [1, 2]}, measure, source)["values"] == {
        "seconds": [1.0, 2.0]} and len(calls) == 2
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    made = measurements.get("cost", {"M": [1, 2]}, measure, source)
    read = measurements.get("cost", {"M": [1, 2]}, measure, source)
    assert len(calls) == 3 and not made["stored"] and read["stored"] and read["values"] == {"seconds": [1.5, 2.0]}
    assert read["machine"]["cores"] >= 1 and read["date"] == made["date"]
    assert not measurements.get("cost", {"M": [1, 3]}, measure, source)["stored"]  # other settings: measured anew
    again = measurements.get("cost", {"M": [1, 2]}, measure, source, remeasure=True)
    assert len(calls) == 5 and not again["stored"]
    assert measurements.get("cost", {"M": [1, 2]}, measure, source)["values"] == {"seconds": [2.5, 2.0]}
    assert measurements.stale() == []


def test_a_change_of_the_timed_code_makes_a_stored_timing_stale_and_measures_anew(measurements, monkeypatch):
    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    source = ("augment/ot_align.py",)
    measurements.get("cost", {"M": 1}, lambda: [1.0], source)
    real = store.source_digest
    monkeypatch.setattr(store, "source_digest", lambda sources: {s: "0" * 12 for s in real(sources)})
    assert measurements.get("cost", {"M": 1}, lambda: [2.0], source)["values"] == [2.0]  # not the stored 1.0
    monkeypatch.setattr(store, "source_digest", lambda sources: {s: "1" * 12 for s in real(sources)})
    stale = measurements.stale()
    assert len(stale) == 2 and all("augment/ot_align.py changed" in line for line in stale)
    monkeypatch.setattr(store, "source_digest", real)
    doc = json.loads(next(measurements.folder.glob("*.json")).read_text())
    measurements.path("gone", "0").write_text(json.dumps({**doc, "name": "gone", "sources": ["augment/gone.py"]}))
    assert any(line.startswith("gone-0.json: stale (augment/gone.py changed") for line in measurements.stale())


def test_remeasure_must_be_a_switch(measurements):
    with pytest.raises(ValueError, match="^remeasure: expected True or False"):
        measurements.get("cost", {}, lambda: [1.0], ("augment/ot_align.py",), remeasure="yes")


def test_a_measurement_with_a_name_that_cannot_name_its_file_is_refused_before_any_run(tiny, tmp_path, measurements,
                                                                                      monkeypatch):
    from fedlab_core.runs import measured

    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("a run started for a refused name"))
    for bad in ("../cost", "Cost", "a-b", ""):
        with pytest.raises(ValueError, match="^name: a measurement's name is lower-case letters"):
            measured(bad, tiny, lambda sim, state: 1.0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="^name: "):
        measurements.get("a/b", {}, lambda: [1.0], ())


def test_make_verify_fails_on_a_stale_timing(monkeypatch, tmp_path, capsys, measurements):
    from fedlab_core import book, verification

    monkeypatch.setenv("FEDLAB_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.setattr(verification, "verify", lambda **kwargs: [])
    monkeypatch.setattr(store.Measurements, "stale", lambda self: ["cost-abc.json: stale (POT changed since)"])
    assert book.verify_archive() == 1
    assert "measurement cost-abc.json: stale (POT changed since)" in capsys.readouterr().out


def test_the_repositorys_timings_are_current_and_the_cost_study_is_stored_for_the_book_profile():
    """The OT chapter's cost verdicts read one stored timing study: it must be the book profile's, and neither the
    timed code nor the timed libraries may have moved since it was measured."""
    from fedlab_core import book

    folder = store.Measurements(store.MEASUREMENTS_DIR)
    assert folder.stale() == [], "stored timings the code or libraries have left behind (measure them anew)"
    docs = [json.loads(p.read_text()) for p in folder.folder.glob("ot_alignment_cost-*.json")]
    params = book.profile_parameters(book.load_profiles(), "ot_alignment", "book")
    assert len(docs) == 1, f"{folder.folder}: {len(docs)} stored cost studies of the OT chapter, not one"
    assert [d["settings"] for d in docs] == [{k: params[k] for k in docs[0]["settings"]}]
    sweeps = docs[0]["values"]["sweeps"]
    assert len(sweeps) == params["COST_REPEATS"] and all(t > 0 for repeat in sweeps for point in repeat for t in point)


# ------------------------------------------------------------------- what figures draw from trained models

def _probe(sim, state):
    """A measurement only the trained model can give: the sum of a few clients' features."""
    from fedlab_core.runs import client_features

    return round(float(client_features(sim, state, per_client=3)[0].sum()), 4)


def test_a_figures_measurement_of_a_trained_model_is_stored_once_and_needs_neither_the_model_nor_the_run_again(
        tiny, tmp_path, archive, measurements, monkeypatch):
    from fedlab_core.runs import measured

    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    value = measured("probe", tiny, _probe, settings={"n": 3}, cache_dir=tmp_path / "cache")
    assert [key for key, _ in archive.entries()] == [store.archive_key(tiny, CPU)]
    assert not list(archive.folder.glob("*.final"))                   # the archive keeps results, not models
    assert list((tmp_path / "cache").glob("*.final"))                 # the state stays in the cache
    builds = []
    real_build = runs_module.build
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    assert measured("probe", tiny, _probe, settings={"n": 3}, cache_dir=tmp_path / "empty") == value and not builds
    assert measured("probe", tiny, lambda sim, state: 1.0, settings={"n": 4}, cache_dir=tmp_path / "cache") == 1.0
    assert builds                                                     # other settings: measured on the model anew
    path = archive.path(store.archive_key(tiny, CPU))             # the run recomputed to other numbers
    doc = Archive.read(path)
    doc["final"]["global_accuracy"] = 0.5
    Archive.write(path, doc)
    assert measured("probe", tiny, lambda sim, state: 2.0, settings={"n": 3}, cache_dir=tmp_path / "cache") == 2.0


def test_measured_groups_trains_each_run_once_and_then_reads_its_measurements(tiny, tmp_path, archive, measurements,
                                                                              monkeypatch):
    from fedlab_core.sweeps import measured_groups

    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    groups = {"a": [tiny], "b": [tiny.replace(seed=1)]}
    first = measured_groups("probe", groups, _probe, cache_dir=tmp_path / "cache", max_workers=1)
    assert set(first) == {"a", "b"} and first["a"][0] != first["b"][0]
    assert len(list((tmp_path / "cache").glob("*.final"))) == 2 and len(list(archive.entries())) == 2
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("a measured run was trained again"))
    assert measured_groups("probe", groups, _probe, cache_dir=tmp_path / "empty", max_workers=1) == first


def test_a_measurement_names_the_functions_it_runs_and_moves_with_them_alone(tmp_path, monkeypatch):
    package = tmp_path / "package"
    package.mkdir()
    code = "def a():\n    return 1\n\n\ndef b():\n    return {}\n\n\nclass C:\n    def m(self):\n        return {}\n"
    (package / "code.py").write_text(code.format(2, 4))
    monkeypatch.setattr(store, "__file__", str(package / "store.py"))
    names = ("code.py::a", "code.py::b", "code.py::C.m", "code.py::gone", "code.py::C.gone", "code.py", "gone.py::a")
    before = store.source_digest(names)
    assert before["code.py::gone"] == before["code.py::C.gone"] == before["gone.py::a"] == "absent"
    assert len({before["code.py::a"], before["code.py::b"], before["code.py::C.m"]}) == 3
    (package / "code.py").write_text(code.format(3, 4))
    after = store.source_digest(names)
    assert after["code.py::a"] == before["code.py::a"] and after["code.py::C.m"] == before["code.py::C.m"]
    assert after["code.py::b"] != before["code.py::b"] and after["code.py"] != before["code.py"]
    (package / "code.py").write_text(code.format(3, 5))                # a method's change moves the method
    assert store.source_digest(names)["code.py::C.m"] != after["code.py::C.m"]


def test_what_the_chapters_measure_on_a_trained_model_agrees_with_the_run_and_reads_back_as_taken(
        tiny, tmp_path, archive, measurements, monkeypatch):
    from functools import partial

    from fedlab_core.runs import TEST_SET_CHECK_SOURCES, test_set_checks
    from fedlab_core.runs import FEATURE_MIXING_SOURCES, TSNE_MAP_SOURCES, feature_mixing, measured, tsne_map

    monkeypatch.setenv("FEDLAB_ARCHIVE", "write")
    taken = {"checks": (test_set_checks, TEST_SET_CHECK_SOURCES),
             "mixing": (partial(feature_mixing, per_client=10), FEATURE_MIXING_SOURCES),
             "tsne": (partial(tsne_map, per_client=10), TSNE_MAP_SOURCES)}
    values = {name: measured(name, tiny, measure, sources=sources, cache_dir=tmp_path)
              for name, (measure, sources) in taken.items()}
    history = run(tiny, cache_dir=tmp_path)
    checks = values["checks"]
    assert checks["aligned test set"] is None                                   # the run aligns nothing
    assert checks["raw test set"] == pytest.approx(history.final["global_accuracy"])   # the run's own global score
    assert len(checks["client test sizes"]) == tiny.num_clients and 0 <= checks["own training images"] <= 1
    assert 0 <= values["mixing"]["neighbours tell the client"] <= 1 and -1 <= values["mixing"]["classes"] <= 1
    assert len(values["tsne"]["xy"]) == len(values["tsne"]["clients"]) == 10 * tiny.num_clients
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("a stored measurement was taken again"))
    assert {name: measured(name, tiny, measure, sources=sources, cache_dir=tmp_path / "empty")
            for name, (measure, sources) in taken.items()} == values
