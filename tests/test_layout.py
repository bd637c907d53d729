"""The import rule of the package, checked by walking every module's imports (function-level ones too).

    cli, console -> daemon -> {study, publish} -> measure -> {engine, workload} -> errors, units, locations, configfile
    cli -> boundary -> errors
    sim -> {engine, workload, measure}
    sim.advisor -> study    (the simulator as a study's advisor: it implements study/advisor.py's Advisor)

A module may import its own component and anything below it, never above or beside it: the
study knows nothing of publishing, the engine nothing of SLOs, the simulator nothing of Optuna
(but for its advisor, which refits on a study's trials). An engine kind names its advisor as a
"module:function" string, imported on first use as kinds are, so the study never imports the simulator.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

BASE = {"errors", "units", "locations", "configfile", "__init__"}  # autotune/__init__.py holds only __version__
ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "errors": set(),
    "units": {"errors"},
    "locations": set(),
    "configfile": {"errors", "units"},
    "boundary": set(),  # outside exceptions into ours, at the command boundary
    "engine": {"errors", "units", "locations"},
    "workload": {"errors", "units", "locations"},
    "measure": {"engine", "workload"},
    "sim": {"engine", "workload", "measure"},
    "study": {"measure", "engine", "workload"},
    "publish": {"measure", "engine", "workload"},
    "daemon": {"study", "publish", "measure", "engine", "workload"},
    "console": {"study", "publish", "measure", "engine", "workload"},
    "cli": {"boundary", "console", "daemon", "study", "publish", "measure", "engine", "workload", "sim"},
    "__main__": {"cli"},
}


# modules allowed more than their component: module -> extra components
MODULES: dict[str, set[str]] = {"autotune.sim.advisor": {"study"}}


def component(module: str) -> str:
    """autotune.study.runner -> study; autotune.cli -> cli; autotune -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_nodes(tree: ast.AST):
    """Every node, less what sits under ``if TYPE_CHECKING:`` (annotations only: no dependency at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(path: Path, annotations: bool = False) -> set[str]:
    """The autotune modules ``path`` imports at run time (and for type checking too, with ``annotations``)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("autotune")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autotune") and not node.level:
            found.add(node.module)
            if node.module == "autotune":  # from autotune import x: a submodule or a name of the root
                found |= {f"autotune.{a.name}" for a in node.names if (PACKAGE / a.name).exists()
                          or (PACKAGE / f"{a.name}.py").exists()}
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        yield ".".join(rel.parts).removesuffix(".__init__"), path


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_module_imports_only_below_it(module, path):
    me = component(module)
    assert me in ALLOWED, f"{module}: a new top-level component; give it a place in the rule above"
    allowed = ALLOWED[me] | BASE | {me} | MODULES.get(module, set())
    bad = sorted(m for m in imports_of(path) if component(m) not in allowed)
    assert not bad, f"{module} ({me}) imports {bad}: the rule allows only {sorted(allowed)}"


def test_the_walk_sees_imports():
    # the rule above is only as good as the walk: it must see the imports it judges
    runner = PACKAGE / "study" / "runner.py"
    assert {"autotune.measure.session", "autotune.engine.failures"} <= imports_of(runner)
    assert "autotune.study.records" in imports_of(PACKAGE / "cli" / "study.py")  # imported inside a function
    assert component("autotune.daemon.loop") == "daemon" and component("autotune") == "__init__"
    assert "autotune.engine.failures" not in imports_of(PACKAGE / "errors.py")  # only for type checking there


def test_no_import_cycle_anywhere():
    """The imports drawn as a graph (a package's own ``__init__`` aside), those for type checking included, have no
    cycle: each module can be read knowing only what it imports."""
    graph = {module: {m for m in imports_of(path, annotations=True) if m != module} for module, path in modules()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            raise AssertionError(f"an import cycle: {' -> '.join(cycle)}")
        if module in done or module not in graph:
            return
        for m in sorted(graph[module]):
            visit(m, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_every_test_file_is_on_the_map_in_docs_testing():
    """docs/testing.md maps each package to its tests: a new test file goes on it (a ``name_*`` there covers a
    family), so a newcomer finds a module's tests from one page."""
    docs = PACKAGE.parent / "docs" / "testing.md"
    on_map = docs.read_text().split("## Where a module's tests are", 1)[1]
    families = [w.removesuffix("*") for w in on_map.split() if w.startswith("test_") and w.endswith("*")]
    files = sorted(p.stem for p in (PACKAGE.parent / "tests").glob("test_*.py"))
    missing = [f for f in files if f not in on_map and not any(f.startswith(fam) for fam in families)]
    assert not missing, f"not on docs/testing.md's map of tests: {missing}"
