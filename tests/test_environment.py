"""The environment: environment.yml mirrors pyproject.toml, so conda users get the same pins; the kernels
the notebooks run in keep their messages but one warning."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_mirrors_pyproject_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]).union(*project["optional-dependencies"].values())
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip = {m.group(1) for line in lines if (m := re.match(r"\s+- ([A-Za-z].*)$", line))}
    assert wanted <= pip, f"missing from environment.yml: {sorted(wanted - pip)}"
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_the_kernels_drop_the_tcp_warning_and_the_shutdown_interrupt_and_keep_every_other_message(tmp_path):
    import logging
    import runpy

    logger = logging.getLogger("IPKernelApp")
    before = list(logger.filters)
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())
    handler = Keep()
    logger.addHandler(handler)
    try:
        runpy.run_path(str(ROOT / "book" / "ipython_kernel_config.py"))
        logger.warning("Kernel is running over TCP without encryption. All communication ...")
        logger.error("KeyboardInterrupt caught in kernel.")      # jupyter_client's interrupt before shutdown
        logger.warning("Starting the kernel at pid: 1")
        logger.error("Failed to load connection file")
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = before
    assert kept == ["Starting the kernel at pid: 1", "Failed to load connection file"]
