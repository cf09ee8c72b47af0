"""The book pipeline: profiles, notebook execution with papermill, glue read-back, the HTML build.

``python -m fedlab_core.book --profile book`` executes every notebook named in ``book/_toc.yml`` from
``notebooks/`` into ``book/chapters/`` with that profile's parameters (``book/profiles.yml``), writes
the execution-status page and the labs' student versions (``book/labs/``, see
:mod:`fedlab_core.labs`) and builds the HTML with Jupyter Book (v1), failing on any warning.

A notebook is executed again only when its source, its parameters or the library's code changed
(a stamp in the executed notebook's metadata records the three); finished federated runs come from
the run cache either way.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import nbformat
import yaml

from . import progress
from .store import code_version

ROOT = Path(__file__).resolve().parents[1]
PROFILE_NAMES = ("smoke", "book", "paper", "evidence")
# "evidence": the design the archive is being recomputed under (tuning seeds of its own, one budget for both arms
# of a comparison, convergence read on validation), computed chapter by chapter with --compute STEM --profile
# evidence into the archive; a chapter's evidence values become its book values once its runs are all archived.


def load_profiles(path: Path = ROOT / "book" / "profiles.yml") -> dict[str, dict[str, dict[str, Any]]]:
    """``{notebook stem: {profile: {PARAMETER: value}}}`` from the one place profiles are kept.

    The ``book`` entry is complete; ``smoke`` and ``paper`` list only what they change.
    """
    return yaml.safe_load(path.read_text())


def profile_parameters(profiles: dict, stem: str, profile: str) -> dict[str, Any]:
    """A notebook's full parameter set for a profile: the book values overridden by the profile's."""
    if stem not in profiles:
        raise ValueError(f"book/profiles.yml has no entry for notebook {stem!r}")
    return {**profiles[stem]["book"], **(profiles[stem].get(profile) or {})}


def parameters_cell(notebook: Path) -> dict[str, Any]:
    """The UPPER_CASE literals assigned in a notebook's first code cell, which must be tagged `parameters`."""
    nb = nbformat.read(notebook, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    if "parameters" not in cell.metadata.get("tags", []):
        raise ValueError(f"{notebook.name}: the first code cell must be tagged 'parameters'")
    values = {}
    for node in ast.parse(cell.source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"{notebook.name}: the parameters cell may only assign literals to names")
        name = node.targets[0].id
        if name != name.upper():
            raise ValueError(f"{notebook.name}: parameter {name!r} must be UPPER_CASE")
        values[name] = ast.literal_eval(node.value)
    return values


def toc_chapters(toc: Path) -> list[str]:
    """The notebook stems the table of contents lists as ``chapters/<stem>``, in order."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if str(node.get("file", "")).startswith("chapters/"):
                found.append(node["file"].split("/", 1)[1])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(toc.read_text()))
    return [stem for stem in found if stem != "status"]


# chapters that read the results other chapters record (``results/`` beside the executed notebooks): they
# are executed after every other chapter, and again whenever those results change
READS_RESULTS = ("report",)


def _stamp(notebook: Path, params: dict[str, Any], results: Path | None = None) -> str:
    payload = notebook.read_bytes() + json.dumps(params, sort_keys=True).encode() + code_version().encode()
    if results is not None:
        payload += b"".join(p.name.encode() + p.read_bytes() for p in sorted(results.glob("*")) if p.is_file())
    return hashlib.sha256(payload).hexdigest()


def execution_order(stems: list[str]) -> list[str]:
    """The toc's chapters in the order they are executed: those of :data:`READS_RESULTS` last."""
    return [s for s in stems if s not in READS_RESULTS] + [s for s in stems if s in READS_RESULTS]


def _recorded(executed: Path) -> dict[str, Any]:
    if not executed.exists():
        return {}
    return nbformat.read(executed, as_version=4).metadata.get("fedlab", {})


def execute(profile: str, notebooks: Path, chapters: Path, toc: Path, profiles: dict | None = None,
            force: bool | Iterable[str] = False, only: Iterable[str] | None = None, jobs: int = 1) -> list[str]:
    """Execute the toc's notebooks with a profile; returns the stems that were (re-)executed. `force`: True
    re-executes every notebook, a list of stems those (the others only when changed); `only`: these chapters
    and no other; `jobs`: chapters executed side by side (those of :data:`READS_RESULTS` always after the
    others, one at a time)."""
    if profile not in PROFILE_NAMES:
        raise ValueError(f"profile: unknown value {profile!r}; allowed: {', '.join(PROFILE_NAMES)}")
    profiles = load_profiles() if profiles is None else profiles
    chapters.mkdir(parents=True, exist_ok=True)
    ran = []
    stems = toc_chapters(toc)
    forced = set(stems) if force is True else set(force or ())
    unknown = sorted(forced - set(stems))
    if unknown:
        raise ValueError(f"chapters: unknown {', '.join(unknown)}; allowed: {', '.join(stems)}")
    order = execution_order([s for s in stems if only is None or s in set(only)])
    timings = _timings(profile)
    from tqdm import tqdm

    bar = tqdm(total=len(order), desc="the book", unit="chapter", disable=None)   # on a terminal only

    def due(stem: str) -> tuple[dict[str, Any], str] | None:
        params = profile_parameters(profiles, stem, profile)
        stamp = _stamp(notebooks / f"{stem}.ipynb", params, chapters / "results" if stem in READS_RESULTS else None)
        if stem not in forced and _recorded(chapters / f"{stem}.ipynb").get("stamp") == stamp:
            print(f"[book] {stem}: unchanged, kept", flush=True)
            bar.update(1)
            return None
        n = order.index(stem) + 1
        left = sum(timings.get(s, 0.0) for s in order[n - 1:])
        print(f"[book] {n}/{len(order)} {stem}: executing with the {profile!r} profile"
              + (f" (about {left / 60:.0f} min left for the book, by the last build's times)" if left else ""),
              flush=True)
        return params, stamp

    def finished(stem: str, seconds: float) -> None:
        timings[stem] = seconds
        _timings(profile, timings)
        ran.append(stem)
        bar.update(1)

    first = [s for s in order if s not in READS_RESULTS]
    if jobs > 1 and len(first) > 1:
        import concurrent.futures
        import multiprocessing

        # side by side, each chapter's kernel computes on its share of the cores: more threads than cores would
        # only wait on each other (the numbers do not depend on the thread count; see fedlab_core.kernels)
        share = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // jobs))}
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_set_environ, initargs=(share,)) as pool:
            futures = {}
            for stem in first:
                todo = due(stem)
                if todo is not None:
                    futures[pool.submit(_execute_guarded, notebooks, chapters, stem, profile, *todo)] = stem
            for future in concurrent.futures.as_completed(futures):
                seconds, error = future.result()
                if error:
                    raise RuntimeError(f"{futures[future]}: {error}")
                finished(futures[future], seconds)
        rest = [s for s in order if s in READS_RESULTS]
    else:
        rest = order
    for stem in rest:
        todo = due(stem)
        if todo is not None:
            finished(stem, _execute_one(notebooks, chapters, stem, profile, *todo))
    bar.close()
    return ran


def _literal(value: Any) -> str:
    """`value` as Python source in the notebooks' style (double-quoted strings)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def show_parameters_run(nb: nbformat.NotebookNode, params: dict[str, Any], profile: str) -> None:
    """Make an executed notebook's one visible parameters cell show the values it ran with: each value the
    profile changed replaces the default in place (the line's comment kept, the default named), a first
    line names the profile, and papermill's injected cell, which says the same, is removed from the page."""
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    lines = cell.source.splitlines()
    for node in reversed(ast.parse(cell.source).body):  # bottom up: earlier line numbers stay valid
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name not in params:
            continue
        try:
            default = ast.literal_eval(node.value)
        except ValueError:
            default = None
        if default == params[name]:
            continue
        first, last = node.lineno - 1, node.end_lineno - 1
        comment = lines[last].encode()[node.value.end_col_offset:].decode().partition("#")[2].strip()  # offsets: bytes
        was = " ".join(ast.get_source_segment(cell.source, node.value).split())
        note = (f"{comment} " if comment else "") + f"({profile} profile; book: {was})"
        lines[first:last + 1] = [f"{name} = {_literal(params[name])}  # {note}"]
    lines.insert(0, f"# the {profile} profile's values, as this page ran (book/profiles.yml)")
    cell.source = "\n".join(lines)
    for c in nb.cells:
        tags = c.metadata.get("tags", [])
        if "injected-parameters" in tags and "remove-cell" not in tags:
            c.metadata["tags"] = [*tags, "remove-cell"]


class _RunLines(logging.Handler):
    """Shows on the build's terminal, as they come, the lines a chapter's sweeps print about their runs
    (:mod:`fedlab_core.progress`), and nothing else of its output."""

    def __init__(self, stem: str):
        super().__init__(logging.INFO)
        self.stem = stem

    def emit(self, record: logging.LogRecord) -> None:
        for line in str(record.msg).splitlines():
            if line.startswith(progress.PREFIX):
                print(f"[book] {self.stem}: {line}", flush=True)


def drop_run_lines(nb: nbformat.NotebookNode) -> None:
    """Remove from an executed notebook the progress lines of its sweeps: the page shows results, not how
    long they took to compute (a chapter that read every run from the archive printed none)."""
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                out.text = "".join(line for line in out.text.splitlines(keepends=True)
                                   if not line.startswith(progress.PREFIX))
                if not out.text:
                    continue
            outputs.append(out)
        if "outputs" in cell:
            cell.outputs = outputs


def _execute_one(notebooks: Path, chapters: Path, stem: str, profile: str, params: dict[str, Any], stamp: str) -> float:
    """Execute one chapter with papermill and record its stamp and time in the executed notebook; returns the
    seconds it took."""
    import papermill

    source, target = notebooks / f"{stem}.ipynb", chapters / f"{stem}.ipynb"
    started = time.perf_counter()
    # The kernel must use the inline backend so figures land in the page; a headless MPLBACKEND
    # set for the test process would be inherited by the kernel and swallow them.
    backend = os.environ.pop("MPLBACKEND", None)
    relay, log = _RunLines(stem), logging.getLogger("papermill")
    level = log.level
    log.addHandler(relay)
    log.setLevel(logging.INFO)   # papermill logs a chapter's output at INFO: the relay picks the runs' lines
    try:
        papermill.execute_notebook(str(source), str(target), parameters=params, kernel_name="python3",
                                   cwd=str(chapters), progress_bar=False, request_save_on_cell_execute=False,
                                   log_output=True)
    finally:
        log.removeHandler(relay)
        log.setLevel(level)
        if backend is not None:
            os.environ["MPLBACKEND"] = backend
    nb = nbformat.read(target, as_version=4)
    drop_run_lines(nb)
    show_parameters_run(nb, params, profile)
    nb.metadata["fedlab"] = {"stamp": stamp, "profile": profile, "seconds": time.perf_counter() - started,
                             "executed": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    nbformat.write(nb, target)
    return nb.metadata["fedlab"]["seconds"]


def _set_environ(values: dict[str, str]) -> None:
    """Set environment variables in a process of :func:`execute`'s pool (its kernels inherit them)."""
    os.environ.update(values)


def _execute_guarded(*args: Any) -> tuple[float, str]:
    """:func:`_execute_one` in a process of :func:`execute`'s pool: (seconds, "") or (0, the error in one line),
    as an error raised there need not cross back to the parent intact."""
    try:
        return _execute_one(*args), ""
    except Exception as err:   # papermill's errors name the failing cell and the error raised in it
        if hasattr(err, "ename"):
            return 0.0, f"cell {err.exec_count}: {err.ename}: {err.evalue}"
        return 0.0, f"{type(err).__name__}: {err}"


# Chapters executed side by side per profile: the smoke profile's chapters compute their runs on one process each
# (WORKERS: 1), on their share of the cores' threads; the book profile's run their own sweeps on every core.
JOBS = {"smoke": 2}
TIMINGS = ROOT / "book" / "chapter_seconds.json"   # committed: the estimates work on a fresh clone


def _timings(profile: str, update: dict[str, float] | None = None) -> dict[str, float]:
    """The seconds each chapter took at its last execution with `profile` (read, or written with `update`);
    the book profile's only: another profile's would not estimate it."""
    if profile != "book":
        return {}
    if update is not None:
        from .store import _atomic_write
        _atomic_write(TIMINGS, lambda f: f.write(json.dumps({k: round(v, 1) for k, v in update.items()},
                                                             indent=1, sort_keys=True).encode()))
        return update
    return json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}


def write_status(chapters: Path, toc: Path) -> Path:
    """The execution-status page: profile, time and date of every chapter's last execution."""
    lines = ["# Execution status", "",
             "Every chapter is a notebook executed by papermill before the book is built. This table is",
             "regenerated at each build from the executed notebooks' metadata. A chapter is executed again",
             "only when its notebook, its parameters or the library changed, and federated runs that already",
             "finished are read from the run cache, so a re-execution can be much faster than the first.", "",
             "| chapter | profile | seconds | executed |", "| --- | --- | ---: | --- |"]
    total = 0.0
    for stem in toc_chapters(toc):
        meta = _recorded(chapters / f"{stem}.ipynb")
        total += meta.get("seconds", 0.0)
        lines.append(f"| [{stem}]({stem}.ipynb) | {meta.get('profile', '-')} | {meta.get('seconds', 0):.0f} "
                     f"| {meta.get('executed', '-')} |")
    lines += ["", f"Total: {total / 60:.1f} minutes.", ""]
    page = chapters / "status.md"
    page.write_text("\n".join(lines))
    return page


def read_glue(executed: Path) -> dict[str, Any]:
    """The values a notebook recorded with ``myst_nb.glue``, parsed back from its outputs."""
    values = {}
    for cell in nbformat.read(executed, as_version=4).cells:
        for out in cell.get("outputs", []):
            record = out.get("metadata", {}).get("scrapbook", {})
            mime = record.get("mime_prefix", "") + "text/plain"  # the prefix is empty for displayed values
            if "name" in record and mime in out.get("data", {}):
                name, text = record["name"], out["data"][mime]
                try:
                    values[name] = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    values[name] = text.strip("'\"")
    return values


def build_html(book: Path, config: Path, output: Path | None = None) -> Path:
    """Jupyter Book v1 HTML build that fails on warnings; returns the path of index.html."""
    command = [str(Path(sys.executable).with_name("jupyter-book")), "build", str(book), "--config", str(config),
               "--toc", str(book / "_toc.yml"), "--path-output", str(output or book), "-W", "--keep-going", "--all"]
    subprocess.run(command, check=True)
    return (output or book) / "_build" / "html" / "index.html"


def write_labs(book: Path) -> list[Path]:
    """The Labs part: the student versions, generated by nbgrader from ``labs/source`` (never the
    solutions), and the instructor notes page, into ``<book>/labs``. The labs are not executed: a
    student runs them."""
    from . import labs

    pages = labs.student_versions(book / "labs")
    notes = book / "labs" / "instructor_notes.md"
    notes.write_text(labs.instructor_notes())
    return [*pages, notes]


def build(profile: str = "book", book: Path = ROOT / "book", notebooks: Path = ROOT / "notebooks",
          config: Path = ROOT / "_config.yml", force: bool | Iterable[str] = False) -> Path:
    """Execute the notebooks, write the status page and the labs, and build the HTML. With the ``book``
    profile, every run the chapters compute (or find in the cache) is added to the archive."""
    if profile == "book":
        os.environ["FEDLAB_ARCHIVE"] = "write"   # the chapters' kernels and their sweeps' processes inherit it
    chapters = book / "chapters"
    execute(profile, notebooks, chapters, book / "_toc.yml", force=force, jobs=JOBS.get(profile, 1))
    write_status(chapters, book / "_toc.yml")
    write_labs(book)
    return build_html(book, config)


def stage(destination: Path) -> Path:
    """Copy the book's sources (not its executed chapters or build) to another folder; returns its book dir."""
    shutil.copytree(ROOT / "book", destination / "book", ignore=shutil.ignore_patterns("_build", "chapters", "labs"))
    shutil.copy(ROOT / "_config.yml", destination / "_config.yml")
    return destination / "book"


def compute(stem: str, hours: float | None = None, backend: str | None = None, profile: str = "book") -> int:
    """Compute one chapter's runs into the archive: execute it with `profile` (the book's, or the evidence being
    recomputed), every run it computes
    stored as it finishes; with `hours`, no run starts after that time (the runs in flight finish and are
    stored) and the command stops cleanly, so the next call continues where it stopped. `backend` "ray" sends
    the runs to the Ray cluster at $RAY_ADDRESS. Returns 0 once the chapter ran to its end, 3 when the time
    ran out first."""
    from papermill.exceptions import PapermillExecutionError

    from .store import Archive

    os.environ["FEDLAB_ARCHIVE"] = "write"
    if hours is not None:
        os.environ["FEDLAB_DEADLINE"] = str(time.time() + 3600 * hours)
    if backend is not None:
        os.environ["FEDLAB_BACKEND"] = backend
    archive, started = Archive(), time.perf_counter()
    before = sum(1 for _ in archive.entries())
    try:
        execute(profile, ROOT / "notebooks", ROOT / "book" / "chapters", ROOT / "book" / "_toc.yml", force=[stem],
                only=[stem])
        finished = True
    except PapermillExecutionError as err:
        if err.ename != "BudgetSpent":
            raise
        finished = False
    now = sum(1 for _ in archive.entries())
    print(f"[compute] {stem}: {now - before} runs added to the archive in {(time.perf_counter() - started) / 60:.1f} "
          f"min; it holds {now} runs ({archive.size() / 1e6:.1f} MB). "
          + ("The chapter ran to its end." if finished else "The time ran out: run the same command to continue."),
          flush=True)
    return 0 if finished else 3


def verify_archive(every: bool = False, rounds: int = 2) -> int:
    """Re-run the archived runs (:func:`fedlab_core.verification.verify`): the first `rounds` rounds of one run per
    distinct method, augmentation, dataset, model and partition scheme, or with `every` each run in full
    (resumable: finished checks are kept in the cache folder). Prints one line per run; returns 1 when a run's
    numbers differ where the kernels are those that computed it, or when a stored timing (:class:`Measurements`) is
    stale, else 0."""
    from .store import Archive, Measurements, default_cache_dir
    from .verification import verify

    archive = Archive()
    journal = default_cache_dir() / f"verified-{code_version()}.jsonl" if every else None
    checks = verify(archive=archive, rounds=None if every else rounds, every=every, journal=journal,
                    workers=os.cpu_count() or 1)
    for check in checks:
        print(f"[verify] {check}", flush=True)
    failed = [c for c in checks if not c.ok]
    elsewhere = sum(1 for c in checks if c.unavailable)   # computed on a device type this machine lacks
    rerun = [c for c in checks if not c.unavailable]
    print(f"[verify] {len(rerun)} archived runs re-run ({'in full' if every else f'first {rounds} rounds'}) of "
          f"{sum(1 for _ in archive.entries())} in {archive.folder}: "
          + (f"{len(failed)} differ: {', '.join(c.key for c in failed)}" if failed else "all bit-identical"
             if all(c.first_difference is None for c in rerun) else "differences only where the kernels differ")
          + (f"; {elsewhere} not checkable on this machine's devices" if elsewhere else ""))
    stale = Measurements().stale()
    for line in stale:
        print(f"[verify] measurement {line}: measure it anew (the chapter's REMEASURE = True, book profile)", flush=True)
    return 1 if failed or stale else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedlab_core.book", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="book", choices=PROFILE_NAMES)
    parser.add_argument("--verify", action="store_true",
                        help="re-run the first rounds of one archived run per method, data, model and split and "
                             "compare them bit for bit with the stored numbers (builds nothing)")
    parser.add_argument("--all", action="store_true", help="with --verify: every archived run, in full (resumable)")
    parser.add_argument("--compute", metavar="STEM", help="compute this chapter's runs into the archive with --profile "
                                                          "(book or evidence; builds nothing)")
    parser.add_argument("--hours", type=float, help="with --compute: start no run after this many hours")
    parser.add_argument("--backend", choices=("local", "ray"), help="with --compute: where the runs go (ray: $RAY_ADDRESS)")
    parser.add_argument("--force", action="store_true", help="re-execute every notebook")
    parser.add_argument("--chapters", nargs="+", default=(), metavar="STEM",
                        help="re-execute these chapters (the others only when changed)")
    args = parser.parse_args(argv)
    if args.all and not args.verify:
        parser.error("--all: goes with --verify")
    if args.verify:
        return verify_archive(every=args.all)
    stems = toc_chapters(ROOT / "book" / "_toc.yml")
    if (args.hours is not None or args.backend) and not args.compute:
        parser.error("--hours and --backend go with --compute")
    if args.hours is not None and not args.hours > 0:
        parser.error(f"--hours: must be a number > 0; got {args.hours:g}")
    if args.compute:
        if args.profile not in ("book", "evidence"):
            parser.error(f"--profile: --compute stores runs of the book or evidence profile; got {args.profile!r}")
        if args.compute not in stems:
            parser.error(f"--compute: unknown chapter {args.compute!r}; allowed: {', '.join(stems)}")
        return compute(args.compute, args.hours, args.backend, args.profile)
    unknown = sorted(set(args.chapters) - set(stems))
    if unknown:
        parser.error(f"--chapters: unknown {', '.join(unknown)}; allowed: {', '.join(stems)}")
    index = build(args.profile, force=True if args.force else args.chapters)
    print(f"[book] HTML: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
