"""The import graph of ``planekv``: no cycles, and dependencies between its parts point down.

Every module under ``planekv/`` is parsed with :mod:`ast`. Every ``import`` and ``from ... import``
counts, at module level, inside a function (a lazy import is still a dependency) or under
``if TYPE_CHECKING:``, relative ones resolved; so does ``importlib.import_module("planekv....")`` /
``__import__("planekv....")`` with a literal name. ``from package import name`` is an edge to
``package.name`` when that is a module, else to ``package`` (its ``__init__``). Module names built
at run time (``_SUBCOMMAND_MODULES`` in ``planekv.cli``, ``_LAZY_READERS`` in ``planekv.models.hf``)
are not seen; both point down.

The layers, from the ground up. A part may import only parts of a *lower* layer; parts that share
a layer may not import each other.

0. ``planekv`` (the root ``__init__``: the version; imports nothing)
1. ``kvstore``: the ground (format, codec, planes, calibration, errors, the atomic write)
2. ``kernels``: builds on kvstore only
3. ``tiering`` and ``settings``, side by side. Tiering builds on kvstore and on kernels for its zero-copy
   promotion kernel (``kernels.host_gather``, imported where a promotion runs on the device: Triton is
   optional); settings is the one settings model (imports no other part); services and above may use it
4. ``services`` and ``models``, side by side. Services build on tiering, kvstore and settings;
   models on kvstore and kernels (``hf.get_reader("triton")`` loads ``planekv.kernels``). The code
   has neither importing the other, so they share a layer rather than being stacked (services <
   models would let a model runner import the HTTP services, which nothing needs).
5. ``evaluation``: builds on models, kvstore and settings (the control plane's URL: it registers
   calibrations over HTTP, never by importing services)
6. ``orchestration`` and ``bench``, side by side: may use all of the above. ``bench`` (the benchmark
   harnesses) times the kernels and reads the evaluation's frozen K/V split
7. ``demo`` (``planekv/demo.py``): kvstore, and evaluation and models for the real-model run
8. ``cli`` (``planekv/cli.py``): the command, on top of everything, the demo included (it imports
   ``planekv.demo``, so the two cannot share a layer)
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "planekv"  # this checkout's package, whatever is installed

LAYERS: dict[str, int] = {
    "planekv": 0,
    "planekv.kvstore": 1,
    "planekv.kernels": 2,
    "planekv.tiering": 3,
    "planekv.settings": 3,
    "planekv.services": 4,
    "planekv.models": 4,
    "planekv.evaluation": 5,
    "planekv.orchestration": 6,
    "planekv.bench": 6,
    "planekv.demo": 7,
    "planekv.cli": 8,
}



def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _literal_import_call(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("x")`` / ``import_module("x")`` / ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _resolve_from(package: str, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <node.module> import ...`` written in ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, modules: Collection[str]) -> set[str]:
    """The planekv modules ``module`` imports: ``import a.b`` is an edge to the deepest of ``a.b``,
    ``a`` that is a module; ``from a import n`` to ``a.n`` if that is a module, else to ``a``."""

    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str | None] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [deepest(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(package, node)
            found += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else deepest(base) for a in node.names]
        elif isinstance(node, ast.Call) and (target := _literal_import_call(node)):
            found.append(deepest(target))
    return {m for m in found if m is not None and m != module}


def import_graph() -> dict[str, set[str]]:
    """module -> the planekv modules it imports."""
    modules = all_modules()
    return {mod: imports_of(mod, path, modules) for mod, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def part_of(module: str) -> str:
    """The layered part a module belongs to: ``planekv.<sub-package>`` or a top-level module."""
    return ".".join(module.split(".")[:2])


def test_every_part_has_a_layer():
    unknown = sorted({part_of(m) for m in all_modules()} - set(LAYERS))
    assert not unknown, f"give these parts of planekv a layer in LAYERS (and the docstring): {unknown}"


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    lines = []
    for comp in cycles:
        members = set(comp)
        edges = [f"    {a} -> {b}" for a in comp for b in sorted(graph[a] & members)]
        lines.append(f"  cycle among {comp}:\n" + "\n".join(edges))
    assert not cycles, "import cycles (lazy imports count):\n" + "\n".join(lines)


def test_dependencies_point_down():
    bad = []
    for mod, deps in sorted(import_graph().items()):
        src = part_of(mod)
        for dep in sorted(deps):
            dst = part_of(dep)
            if dst != src and LAYERS.get(dst, 99) >= LAYERS.get(src, -1):
                bad.append(f"  {mod} -> {dep}  ({src}, layer {LAYERS.get(src)}, may not import {dst}, "
                           f"layer {LAYERS.get(dst)})")
    assert not bad, "imports that do not point down the layers (see this test's docstring):\n" + "\n".join(bad)


def test_the_walker_sees_lazy_relative_and_literal_imports(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from . import sib\n"
                   "from ..up import thing\n"
                   "def f():\n"
                   "    from .sib import name\n"
                   "    import pkg.deep.leaf\n"
                   "    importlib.import_module('pkg.other')\n")
    modules = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.sib", "pkg.up", "pkg.deep", "pkg.other"}
    assert imports_of("pkg.sub.mod", src, modules) == {"pkg.sub.sib", "pkg.up", "pkg.deep", "pkg.other"}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
