"""The package's shape, checked on its source: imports point down (no loop), the math imports torch and the
standard library only, hivemind stays under ``net/``, no module-global mutable state, no task without an
owner, and no module over ~400 lines without a reason in its docstring."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import p2ptrain

PKG = Path(p2ptrain.__file__).parent
LONG = 400
#: ``asyncio.create_task`` calls that are not on a TaskGroup, each with the object that owns the task.
OWNED_TASKS = {"p2ptrain.net.swarm": "the transport's background runner, cancelled and awaited by aclose()",
               "p2ptrain.net.streams": "a call's watch for its request leaving the host, cancelled and awaited as the "
                                       "call ends"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports, anywhere in its file (top level, functions, TYPE_CHECKING blocks)."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_pkg, node)
            for a in node.names:  # ``from . import cli`` imports a module; ``from .x import name`` the module x
                sub = f"{target}.{a.name}"
                out.add(sub if sub in MODULES else target)
    return out


def _internal(module: str) -> set[str]:
    return {m for m in _imports(module) if m in MODULES and m != module}


def test_no_import_loop() -> None:
    graph = {m: _internal(m) for m in MODULES}
    # A package's __init__ re-exporting its own submodules is not a loop of the layers.
    graph = {m: {d for d in deps if not (d.startswith(m + ".") and MODULES[m].name == "__init__.py")}
             for m, deps in graph.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    loops: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                loops.append([*path[path.index(d):], d] if d in path else [m, d])
            elif d not in seen:
                visit(d, [*path, d])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert not loops, "import loops: " + "; ".join(" → ".join(loop) for loop in loops)


def test_the_math_imports_torch_and_the_standard_library_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    for m in MODULES:
        layer = m.split(".")[1] if "." in m else ""
        if layer not in ("algo", "collective"):
            continue
        own = ("p2ptrain.collective",) if layer == "collective" else ("p2ptrain.algo", "p2ptrain.collective")
        for imp in _imports(m):
            if imp.startswith("p2ptrain"):
                assert imp.startswith(own), f"{m} imports {imp}"
            else:
                assert imp.split(".")[0] in allowed, f"{m} imports {imp}: only torch and the standard library"


def test_hivemind_is_imported_under_net_only() -> None:
    outside = [m for m in MODULES if not m.startswith("p2ptrain.net")
               and any(i.split(".")[0] == "hivemind" for i in _imports(m))]
    assert not outside, f"hivemind imported outside p2ptrain/net: {outside}"


def test_no_module_global_mutable_state() -> None:
    mutable_calls = {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.Global) for n in ast.walk(tree)), f"{m} rebinds a module global"
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            value = getattr(node, "value", None)
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in
                mutable_calls)
            for t in targets:
                if mutable and isinstance(t, ast.Name) and t.id != "__all__":
                    assert t.id.isupper(), f"{m}: module-level mutable {t.id!r} (a constant is UPPER_CASE, never mutated)"


def test_every_task_has_an_owner() -> None:
    """A task is made on a TaskGroup (``tg.create_task``), or by one of the owners listed in OWNED_TASKS."""
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f = node.func
            bare = isinstance(f.value, ast.Name) and f.value.id in ("asyncio", "loop")
            if f.attr == "ensure_future" or (f.attr == "create_task" and bare):
                assert m in OWNED_TASKS, f"{m}:{node.lineno}: a task no TaskGroup owns"


def test_long_modules_say_why() -> None:
    for m, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        if lines > LONG:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "Why it is long:" in doc, f"{m} has {lines} lines and no 'Why it is long:' in its docstring"
