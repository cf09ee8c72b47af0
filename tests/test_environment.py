"""environment.yml mirrors pyproject.toml, so conda users get the same pins."""
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
