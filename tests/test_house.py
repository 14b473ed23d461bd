"""The house rules docs/architecture.md states, read from the code's own imports.

- the arrows run one way: rfork -> planner, rfork -> backends; backends and planner import neither;
- rfork imports the planner through its doors: planner.contract (the client side) and planner;
- rfork imports the transport through its doors: `backends` and the paths its `__all__` lists
  (subpackages: backends.kv, .nccl, ...), taking only names their `__all__` lists;
- the installed packages never import the harness (bench/: benchmarks, simulator, process harness),
  which the wheel does not ship; rfork/cli/checkout_commands.py alone loads it by name, in a checkout;
- the planner's and the transport's tests run without rfork and without the harness;
- no import cycle between modules;
- the project's own code is imported inside a function only where start-up time needs it (command
  modules, the SGLang plugin), with a comment saying so;
- every import of the project's own modules resolves (mypy is told to ignore missing imports).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ("rfork", "backends", "planner", "migrations")  # the wheel ships them (migrations/ in planner/)
HARNESS = "bench"
PACKAGES = (*INSTALLED, HARNESS)
# may import project code inside functions: `rfork --help` and SGLang's processes import them at start-up
EDGES = (
    "rfork/cli/",
    "bench/",
    "rfork/integrations/hook/",
    "rfork/integrations/sglang/",
    "rfork/integrations/vllm/",
    "rfork/weights/blake3_tensor.py",  # its Triton kernel needs triton, an optional package
    "rfork/env_secrets.py",  # the hooks' settings import it when vLLM loads its plugins (no planner yet)
)
ALLOWED_ARROWS = {
    "rfork": {"rfork", "planner", "backends"},
    "backends": {"backends"},
    "planner": {"planner"},
    "migrations": {"migrations", "planner"},
    HARNESS: {HARNESS, "rfork", "planner", "backends"},
}
# where the installed code may name the harness: the door `rfork demo|bench|simulate` opens in a checkout
HARNESS_DOOR = "rfork/cli/checkout_commands.py"
# test packages that must run without rfork, and the test helpers they import (followed through tests.*)
WITHOUT_RFORK = ("tests/planner", "tests/backends")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if "versions" in parts:  # Alembic revisions are loaded by Alembic, not imported
                continue
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _own(name: str | None) -> bool:
    return bool(name) and str(name).split(".")[0] in PACKAGES


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (not under `if TYPE_CHECKING:`, not in functions)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.Try):
            out += [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or not node.module:
        return []
    # `from pkg import module` imports the module; `from module import name` the module
    subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
    return subs or [node.module]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[name] = {t for n in _top_level_imports(tree) for t in _targets(n) if _own(t) and t in MODULES}
    return graph


def test_the_arrows_run_one_way() -> None:
    wrong = []
    for name, deps in _graph().items():
        for dep in deps:
            if dep.split(".")[0] not in ALLOWED_ARROWS[name.split(".")[0]]:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, wrong


def test_no_import_cycle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_project_code_is_imported_inside_functions_only_at_the_edges_with_a_reason() -> None:
    wrong = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            local = [
                n
                for n in ast.walk(fn)
                if isinstance(n, (ast.Import, ast.ImportFrom)) and any(_own(t) for t in _targets(n))
            ]
            if not local:
                continue
            first = min(n.lineno for n in local)
            if not rel.startswith(EDGES):
                wrong.append(f"{rel}:{first} (not an edge module)")
                continue
            said = [
                ln
                for ln in lines[fn.lineno - 1 : first - 1]
                if ln.strip().startswith("#") and ("start-up" in ln or "optional" in ln)
            ]
            if not said:
                wrong.append(f"{rel}:{first} (no comment saying why)")
    assert not wrong, wrong


@pytest.mark.parametrize("package", ["rfork", "backends", "planner", HARNESS, "tests"])
def test_every_import_of_the_projects_own_modules_resolves(package: str) -> None:
    missing = []
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and _own(node.module)
                or (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."))
            ):
                assert node.module is not None
                if importlib.util.find_spec(node.module) is None:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
    assert not missing, missing


def test_rfork_imports_the_planner_through_its_doors() -> None:
    """rfork imports the planner's contract from `planner.contract` and the in-process server from
    `planner`; only `rfork planner serve` reaches into the server room (its app, the policy names)."""
    doors = {"planner", "planner.contract"}
    serve = {"planner.app", "planner.selection"}
    wrong = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "rfork":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                if module.split(".")[0] != "planner" or module in doors:
                    continue
                if path.name == "planner_serve.py" and module in serve:
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
    assert not wrong, wrong


def _written_all(module: str) -> list[str]:
    """The `__all__` a module writes out (a list of strings) in its source."""
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} writes out no __all__")


def _backends_doors() -> dict[str, set[str]]:
    """The backends modules rfork may import, each with the names it may take from it: `backends`,
    and each path that `backends.__all__` lists (a subpackage, whose `__init__` is its door)."""
    doors = {"backends": set(_written_all("backends"))}
    for name in sorted(doors["backends"]):
        path = MODULES.get(f"backends.{name}")
        if path is not None and path.name == "__init__.py":
            doors[f"backends.{name}"] = set(_written_all(f"backends.{name}"))
    return doors


def test_the_transport_doors_are_backends_and_its_paths() -> None:
    doors = _backends_doors()
    assert {"backends", "backends.kv", "backends.nccl"} <= set(doors), sorted(doors)
    assert "backends.layout" not in doors  # a module, not a path: its names come through `backends`


def test_rfork_imports_the_transport_through_its_doors() -> None:
    """Every import of backends in rfork (top level, in functions, under TYPE_CHECKING) names a door,
    `backends` or a path its `__all__` lists (backends.kv, backends.nccl, ...), and takes from it only
    names that door's `__all__` lists: never a module behind it (backends.layout, backends.gpu.staging),
    so moving one never breaks rfork."""
    doors = _backends_doors()
    wrong = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "rfork":
            continue
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wrong += [
                    f"{where}:{node.lineno} imports {a.name} (not a door)"
                    for a in node.names
                    if a.name.split(".")[0] == "backends" and a.name not in doors
                ]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] != "backends":
                    continue
                if node.module not in doors:
                    wrong.append(f"{where}:{node.lineno} imports {node.module} (not a door)")
                    continue
                wrong += [
                    f"{where}:{node.lineno} takes {a.name} from {node.module}, whose __all__ does not list it"
                    for a in node.names
                    if a.name not in doors[node.module]
                ]
    assert not wrong, "\n".join(wrong)


def _all_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file: top level, in functions, under TYPE_CHECKING."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _names_harness_by_string(path: Path) -> list[int]:
    """Lines where the file imports by name (importlib.import_module, __import__) a module of bench/."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] == HARNESS
        ):
            lines.append(node.lineno)
    return lines


def test_the_installed_packages_never_import_the_harness() -> None:
    wrong = []
    for pkg in INSTALLED:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            wrong += [f"{rel}:{n} {m}" for n, m in _all_imports(path) if m.split(".")[0] == HARNESS]
            if rel != HARNESS_DOOR:
                wrong += [f"{rel}:{n} (by name)" for n in _names_harness_by_string(path)]
    assert not wrong, wrong
    assert _names_harness_by_string(ROOT / HARNESS_DOOR), "the door moved: update HARNESS_DOOR"


def _test_helper(module: str) -> Path | None:
    """The file of a `tests.*` module, if there is one."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_planner_and_transport_tests_import_neither_rfork_nor_the_harness() -> None:
    """Their files, the conftest.py above them and every tests.* helper they reach, followed transitively."""
    todo = [p for d in WITHOUT_RFORK for p in (ROOT / d).rglob("*.py")]
    todo += [ROOT / "tests" / "conftest.py", ROOT / "tests" / "__init__.py"]
    seen: set[Path] = set()
    wrong = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, module in _all_imports(path):
            top = module.split(".")[0]
            if top in ("rfork", HARNESS):
                wrong.append(f"{path.relative_to(ROOT)}:{line} {module}")
            elif top == "tests":
                helper = _test_helper(module) or _test_helper(module.rpartition(".")[0])
                if helper is not None:
                    todo.append(helper)
    assert not wrong, wrong
    assert ROOT / "tests" / "tiny_llama.py" in seen  # the KV tests' model: helpers outside are followed
