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


def test_the_library_has_no_import_cycles():
    """No module of fedlab_core imports, at run time, one that imports it back (directly or through others):
    imports under TYPE_CHECKING, for annotations only, are not followed."""
    import ast
    from collections import defaultdict
    from pathlib import Path

    import fedlab_core

    root = Path(fedlab_core.__file__).parent
    graph: dict[str, set[str]] = defaultdict(set)

    class Imports(ast.NodeVisitor):
        def __init__(self, module: str, package: str):
            self.module, self.package = module, package

        def visit_If(self, node: ast.If) -> None:
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                self.generic_visit(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = self.package.split(".")[:len(self.package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                graph[self.module].update([target] if node.module else [f"{target}.{a.name}" for a in node.names])

    for path in root.rglob("*.py"):
        parts = ["fedlab_core", *path.relative_to(root).with_suffix("").parts]
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        Imports(module, module if path.name == "__init__.py" else module.rsplit(".", 1)[0]).visit(ast.parse(path.read_text()))

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert len(graph) > 20
    cycles = {m: sorted(n for n in graph[m] if m in reached(n)) for m in graph if m != "fedlab_core" and m in reached(m)}
    assert not cycles, f"import cycles: {cycles}"


def test_the_convergence_test_sits_below_the_engine_and_the_verdicts():
    """The plateau test is a pure function of a curve in a module of its own, which imports nothing of the
    library; the engine stops runs with it without importing the verdicts."""
    import ast
    from pathlib import Path

    import fedlab_core
    from fedlab_core import convergence, engine, verdicts

    root = Path(fedlab_core.__file__).parent

    def relative_imports(name):
        tree = ast.parse((root / f"{name}.py").read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}

    assert relative_imports("convergence") == set()
    assert "convergence" in relative_imports("engine") and "verdicts" not in relative_imports("engine")
    assert engine.stop_round is convergence.stop_round and convergence.plateaued is verdicts.plateaued
