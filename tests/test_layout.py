"""The package's layout: no import cycles, a folder per process, and torch only where a process trains."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gnnray"
# A folder is a process (gnnray/__init__.py); what each may import from the package (besides itself and the
# shared top-level modules). The driver plans and measures with the sampler, and reads torch-free modules of
# train/; Ray Train's controller side (controller/) builds an elastic group's stream as the driver does.
ALLOWED = {
    "data": set(),
    "store": {"data"},
    "sampler": {"data", "store"},
    "models": {"sampler"},  # the CPU dropout mask draws with the sampler's mixer (pick.mix, pick.Threads)
    "train": {"data", "store", "sampler", "models"},
    "inference": {"data", "store", "sampler", "models", "train"},
    "controller": {"data", "store", "sampler", "train", "driver"},
    "driver": {"data", "store", "sampler", "models", "train", "inference", "controller"},
}
# The processes that train: only their folders import torch at module level.
TORCH_FOLDERS = {"train", "models", "inference"}
# DGL's sampler runs in sampler actors, and only with --sampler graphbolt: DGL needs torch.
TORCH_EXCEPTIONS = {"gnnray.sampler.graphbolt"}
# The predict job's driver loads the checkpoint's model itself (jobs/predict.py; the training driver does not).
TORCH_DRIVERS = {"gnnray.driver.predict_job"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the gnnray modules it imports anywhere in its body (lazy imports in functions count)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gnnray"):
                for alias in node.names:  # `from gnnray.x import y` imports module gnnray.x.y if it exists
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("gnnray"))
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(path: Path) -> set[str]:
    """The modules ``path`` imports when it is imported: its top-level statements (``try`` and ``if`` bodies
    included, ``if TYPE_CHECKING`` left out), not the imports inside functions and classes."""
    modules = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            modules.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)) and not _type_checking(node):
            todo += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return modules


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return []


def test_no_import_cycles():
    assert find_cycle(import_graph()) == []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_folders_import_only_the_stages_before_them():
    wrong = []
    for module, targets in import_graph().items():
        folder = module.split(".")[1] if module.count(".") >= 2 else None
        for t in targets:
            other = t.split(".")[1] if t.count(".") >= 2 else None
            if folder and other and other != folder and other not in ALLOWED[folder]:
                wrong.append(f"{module} imports {t}")
    assert wrong == []


def test_the_readmes_data_path_names_existing_files():
    """A reader follows one batch by the file names of README.md#what-runs-where: each must be a file (a bare
    name is read in the folder the stage runs in, so it need only end a path of the package)."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    diagram = readme.partition("## What runs where")[2].partition("```")[2].partition("```")[0]
    named = set(re.findall(r"[\w/]+\.py", diagram))
    files = [p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.parent.glob("[gj]*/**/*.py")]
    assert len(named) >= 15
    assert sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files)) == []


def test_the_console_imports_no_torch():
    """The driver's console reads the run's files: it needs their names (``gnnray.run_storage``), not torch."""
    import subprocess
    import sys

    code = "import sys, gnnray.driver.console; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_module_names_are_unique():
    """No two modules share a file name: in the package a name says which side it serves, and pytest imports
    test files by their base name (two ``test_x.py`` in different folders stop the whole collection)."""
    for root in (PACKAGE, PACKAGE.parent / "tests"):
        names = [p.name for p in root.rglob("*.py") if p.name != "__init__.py"]
        assert sorted({n for n in names if names.count(n) > 1}) == [], root


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of an attribute chain rooted at a name, else ``""``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def private_ray(source: str) -> list[str]:
    """What ``source`` reaches of Ray's private modules and names: imports and ``ray._x`` attribute chains."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names.append(_dotted(node))
    private = lambda n: n.startswith("ray.core.generated") or any(  # noqa: E731
        p.startswith("_") and not p.startswith("__") for p in n.split("."))
    return sorted({n for n in names if n.split(".")[0] == "ray" and private(n)})


def test_private_ray_is_used_in_one_module():
    """Ray's internals go through gnnray/ray_internals.py, beside the pin in stack.py that makes them safe."""
    uses = {path.relative_to(PACKAGE).as_posix(): private_ray(path.read_text()) for path in PACKAGE.rglob("*.py")}
    assert {p: u for p, u in uses.items() if u and p != "ray_internals.py"} == {}
    assert uses["ray_internals.py"]  # the checker sees them where they are
    assert private_ray("import ray._private.state\nfrom ray.train.torch.config import _TorchBackend\n"
                       "ray._private.worker.get_dashboard_url()\nactor._actor_id.hex()\nimport ray.train") == [
        "ray._private", "ray._private.state", "ray._private.worker", "ray._private.worker.get_dashboard_url",
        "ray.train.torch.config._TorchBackend"]


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_only_the_training_processes_import_torch_at_module_level():
    """``train/``, ``models/`` and ``inference/`` import torch at module level; ``sampler/graphbolt.py`` is the
    one exception. Everything else (the driver, the sampler actors, Ray Train's controller side, the contracts
    they share) imports torch only inside the functions that need it."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    direct = {m for m, p in modules.items() if any(n == "torch" or n.startswith("torch.")
                                                   for n in module_level_imports(p))}
    assert {m for m in direct if _folder(m) not in TORCH_FOLDERS} == TORCH_EXCEPTIONS
    assert {"gnnray.train.loop", "gnnray.models.model", "gnnray.inference.layerwise_task"} <= direct


def test_what_the_other_processes_import_loads_no_torch():
    """Nor does a module outside those folders load torch through the gnnray modules it imports at module level
    (a torch-free module of ``train/`` the driver reads stays torch-free): what the rule above leaves to hold."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {m: {t for t in module_level_imports(p) if t in modules and t != m} for m, p in modules.items()}
    torch = {m for m, p in modules.items()
             if any(n == "torch" or n.startswith("torch.") for n in module_level_imports(p))}

    def loads_torch(m: str, seen: set) -> bool:
        if m in torch:
            return True
        seen.add(m)
        return any(loads_torch(t, seen) for t in edges[m] if t not in seen)

    light = [m for m in modules if _folder(m) not in TORCH_FOLDERS and m not in TORCH_EXCEPTIONS | TORCH_DRIVERS]
    assert sorted(m for m in light if loads_torch(m, set())) == []
    assert loads_torch("gnnray.driver.predict_job", set())  # the checker follows imports through modules


def test_no_module_is_over_450_lines():
    assert {p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450} == {}
