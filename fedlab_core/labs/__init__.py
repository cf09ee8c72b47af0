"""Course labs: the checks their notebooks run, and the student and solution sets built with nbgrader.

Each lab's source is one notebook in nbgrader's layout, ``labs/source/<lab>/<lab>.ipynb``: the
solutions sit between nbgrader's ``### BEGIN SOLUTION`` and ``### END SOLUTION`` markers and the
autograded cells call the check functions of this package, one module per lab. A check runs the
student's code on small cases against :mod:`fedlab_core` and, when something is wrong, raises
:class:`LabCheckError` with one sentence saying what and what was expected.

:func:`build_sets` runs nbgrader itself (``generate_assignment`` for the student version,
``generate_solution`` for the teacher's), so the two never drift apart.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
COURSE = ROOT / "labs"
# what nbgrader writes into a course folder (git-ignored)
GENERATED = ("release", "solution", "submitted", "autograded", "feedback", "gradebook.db", ".ipynb_checkpoints")


class LabCheckError(AssertionError):
    """A check found the student's answer wrong; the message says what and what was expected."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`LabCheckError` with `message` unless `condition` holds."""
    if not condition:
        raise LabCheckError(message)


def close(answer, expected, what: str, atol: float = 1e-6, rtol: float = 1e-5) -> np.ndarray:
    """The answer as a float array, after checking its shape and values against `expected`.

    The message names `what`, the first entry that differs, and the two values there.
    """
    try:
        got = np.asarray(answer.detach().cpu() if hasattr(answer, "detach") else answer, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise LabCheckError(f"{what}: expected an array of numbers, got {type(answer).__name__} ({error})") from None
    want = np.asarray(expected.detach().cpu() if hasattr(expected, "detach") else expected, dtype=np.float64)
    require(got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}")
    require(bool(np.isfinite(got).all()), f"{what}: contains NaN or infinite values")
    bad = ~np.isclose(got, want, atol=atol, rtol=rtol)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f" at index {at if len(at) > 1 else at[0]}" if got.ndim else ""
        raise LabCheckError(f"{what}: {got[at]:.6g}{where}, expected {want[at]:.6g}")
    return got


def simulate(config, algorithm=None, augment=None, progress: bool = False):
    """The run `config` describes (data, split, model, schedule) with `algorithm` and `augment` (e.g. a
    student's) in place of the config's: a :class:`~fedlab_core.engine.Simulation` on the CPU, so that a
    student's own code runs on the engine. ``simulate(config, algorithm).run().rows`` is the log, one row per
    round. Like :func:`fedlab_core.run`, it computes with one torch thread (set for this process): a small
    model trains fastest that way, and a busy machine slows it least."""
    import torch

    from ..engine import Simulation
    from ..runs import build

    torch.set_num_threads(1)
    built = build(config, torch.device("cpu"))
    return Simulation(algorithm or built.algorithm, built.federation, built.model, seed=config.seed,
                      num_rounds=config.num_rounds, fraction=config.fraction,
                      clients_per_round=config.clients_per_round, eval_every=config.eval_every,
                      augment=augment or built.augment, progress=progress)


def passed(message: str) -> None:
    """Tell the student a check passed."""
    print(f"✔ {message}")


def labs(course: Path = COURSE) -> list[str]:
    """The labs' names, in order: the folders of ``<course>/source``."""
    return sorted(p.name for p in (course / "source").iterdir() if (p / f"{p.name}.ipynb").exists())


def tiny_parameters(lab: str, course: Path = COURSE) -> dict:
    """The parameters that make a lab run in seconds (``labs/profiles.yml``), for the tests."""
    return (yaml.safe_load((course / "profiles.yml").read_text()) or {})[lab]["tiny"]


# nbgrader's converters run in one process for every lab: one import of nbgrader, not one per lab and step
_GENERATE = """
import sys
from nbgrader.apps import NbGraderAPI
from nbgrader.apps.api import capture_log, temp_attrs
from nbgrader.converters import GenerateAssignment, GenerateSolution
from traitlets.config.loader import PyFileConfigLoader

api = NbGraderAPI(config=PyFileConfigLoader("nbgrader_config.py", path=".").load_config())
steps = [{"generate_assignment": GenerateAssignment, "generate_solution": GenerateSolution}[s]
         for s in sys.argv[1].split(",")]
for lab in sys.argv[2:]:
    for converter in steps:
        with temp_attrs(api.coursedir, assignment_id=lab):
            app = converter(coursedir=api.coursedir, parent=api)
            app.force = True
            done = capture_log(app)
        if not done["success"]:
            sys.exit(f"nbgrader {converter.__name__} {lab} failed:\\n{done.get('log', '')}{done.get('error', '')}")
"""


def build_sets(course: Path = COURSE, solutions: bool = True) -> dict[str, Path]:
    """Generate the student (``release/``) and solution (``solution/``) versions of the labs with nbgrader
    (its ``generate_assignment`` and ``generate_solution``, all labs in one process).

    Returns ``{"release": folder, "solution": folder}`` (the release folder only, with ``solutions``
    False). The solutions are written as the sources are, unexecuted (``labs/nbgrader_config.py``): the whole
    set takes about 25 s on 2 cores, most of it nbgrader's import and gradebook; the instructor notes are
    written beside them (``solution/INSTRUCTOR_NOTES.md``).
    """
    # nbgrader runs alembic (its database migrations) by name: the environment's scripts come first
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    steps = "generate_assignment,generate_solution" if solutions else "generate_assignment"
    done = subprocess.run([sys.executable, "-c", _GENERATE, steps, *labs(course)], cwd=course, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr.strip() or f"nbgrader failed with exit status {done.returncode}")
    if not solutions:
        return {"release": course / "release"}
    (course / "solution" / "INSTRUCTOR_NOTES.md").write_text(instructor_notes(course))
    return {"release": course / "release", "solution": course / "solution"}


NOTES_HEADER = """# Notes for instructors

The labs are Jupyter notebooks in [nbgrader](https://nbgrader.readthedocs.io)'s format. Their sources
(with the solutions) live in `labs/source/` of the repository, outside the book; `make labs` writes the
student versions to `labs/release/` and the solutions to `labs/solution/`, both generated by nbgrader, and
these notes beside the solutions. A course that grades with nbgrader can use the folder as its course
directory: students' submissions go to `labs/submitted/` and `nbgrader autograde <lab>` scores the check
cells. The pages of this part are the student versions; each page offers its notebook for download
(the download button at the top). A student opens them with `make lab`.

Each lab's first code cell holds its parameters (tagged `parameters`, so papermill can change them); the
defaults are what a student runs on a laptop. The times below are for the solution notebook with those
defaults on a 2-core CPU machine; a student needs the time to read and write code on top.
"""


def instructor_notes(course: Path = COURSE) -> str:
    """The instructor notes page: :data:`NOTES_HEADER` and each lab's ``labs/notes/<lab>.md``, in order."""
    missing = [lab for lab in labs(course) if not (course / "notes" / f"{lab}.md").exists()]
    if missing:
        raise FileNotFoundError(f"labs/notes: no instructor notes for {', '.join(missing)}")
    return "\n".join([NOTES_HEADER, *((course / "notes" / f"{lab}.md").read_text() for lab in labs(course))])


def student_versions(destination: Path, course: Path = COURSE) -> list[Path]:
    """The student versions, generated by nbgrader in a scratch copy of the course (so that nothing is
    written into it) and copied to `destination`: the book shows them."""
    destination.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "labs"
        shutil.copytree(course, copy, ignore=shutil.ignore_patterns(*GENERATED))
        release = build_sets(copy, solutions=False)["release"]
        return [Path(shutil.copy(release / lab / f"{lab}.ipynb", destination / f"{lab}.ipynb")) for lab in labs(copy)]
