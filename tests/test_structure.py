"""The package's shape: small modules, imports in one direction, a paging layer without TVM;
and benchmarks that import nothing from the tests.

Reads the sources with ``ast``; counts function-level imports as well as module-level ones
(a function-level import only hides a cycle, it does not break it).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys
from typing import Dict, List, Set

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "python" / "relax_kvcache"
MAX_LINES = 600


def _modules() -> Dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package (packages by __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str:
    """The package module ``name`` is or lies in (``relax_kvcache.x.Y`` -> ``relax_kvcache.x``)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imported(module: str, path: pathlib.Path) -> Dict[str, Set[str]]:
    """What ``module`` imports, anywhere in it: ``{"package": modules of ours, "external": top-level
    names of others}``. ``from .x import y`` counts as importing module ``x.y`` where that is a
    module, else ``x``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours: Set[str] = set()
    external: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                     for alias in node.names]
        else:
            continue
        for name in names:
            if name == "relax_kvcache" or name.startswith("relax_kvcache."):
                ours.add(_owner(name))
            else:
                external.add(name.split(".")[0])
    ours.discard(module)
    return {"package": ours, "external": external}


IMPORTS = {module: _imported(module, path) for module, path in MODULES.items()}
GRAPH = {module: found["package"] for module, found in IMPORTS.items()}


def strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def test_strongly_connected_finds_a_cycle():
    """The cycle finder itself: a cycle hidden behind a third module, and none in a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert cycles == [["a", "b", "c"]]
    assert not [c for c in strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) if len(c) > 1]


def test_import_graph_sees_function_level_and_relative_imports():
    """Edges the graph must hold: a function-level import (build's TVMScript factories) and a
    relative import from a subpackage (paging -> errors)."""
    assert "relax_kvcache.tir_kernels" in GRAPH["relax_kvcache.kernel_specs"]
    assert "relax_kvcache.errors" in GRAPH["relax_kvcache.paging.block_pool"]
    assert "relax_kvcache.paging.tree" in GRAPH["relax_kvcache.paging.state"]


def test_modules_are_small():
    """No module is over MAX_LINES physical lines."""
    sizes = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    over = {module: lines for module, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_no_import_cycles():
    """No two modules of the package import each other, directly or through others, counting
    imports inside functions."""
    cycles = [component for component in strongly_connected(GRAPH) if len(component) > 1]
    assert not cycles, f"import cycles among relax_kvcache modules: {cycles}"


def _reachable(module: str) -> Set[str]:
    seen, todo = {module}, [module]
    while todo:
        for succ in GRAPH[todo.pop()]:
            if succ not in seen:
                seen.add(succ)
                todo.append(succ)
    return seen


def test_paging_imports_no_tvm_in_its_sources():
    """Nothing the paging layer imports, at any depth and inside functions too, imports TVM."""
    closure = _reachable("relax_kvcache.paging") - {"relax_kvcache"}
    with_tvm = sorted(m for m in closure if IMPORTS[m]["external"] & {"tvm", "tvm_ffi"})
    assert not with_tvm, f"the paging layer reaches TVM through {with_tvm}"


def test_paging_imports_no_tvm_when_loaded():
    """Loading relax_kvcache.paging (without the package's __init__, which registers TVM
    functions) loads no TVM module."""
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('relax_kvcache'); package.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['relax_kvcache'] = package\n"
        "import relax_kvcache.paging\n"
        "state = relax_kvcache.paging.PagingState(4, 2)\n"
        "state.add_sequence(0); state.reserve_append([0], [3])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi'))\n"
        "assert not loaded, loaded\n"
        "assert relax_kvcache.paging.__file__.startswith(package.__path__[0])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_kernel_set_fields_are_the_catalogue_roles():
    """KernelSet has one kernel field per role of the catalogue, and nothing else takes a kernel."""
    from relax_kvcache.kernel_roles import CATALOGUE
    from relax_kvcache.kernel_set import KernelSet

    fields = [field.name for field in dataclasses.fields(KernelSet) if field.init]
    assert sorted(fields) == sorted(role.name for role in CATALOGUE)


def _test_modules() -> Set[str]:
    """Names a module in tests/ can be imported by (its files and packages)."""
    tests = REPO / "tests"
    return {path.stem for path in tests.glob("*.py")} | {path.name for path in tests.iterdir()
                                                         if (path / "__init__.py").exists()}


def _reaches_into_tests(source: str, test_modules: Set[str]) -> List[str]:
    """What in ``source`` imports a module of tests/ or names tests/ as a path: imports of those
    names, and string constants (docstrings aside) with a ``tests`` path component."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node)
                  for node in node.body[:1]}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in test_modules | {"tests"}]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in test_modules | {"tests"}:
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if "tests" in node.value.replace("\\", "/").split("/"):
                found.append(f"path {node.value!r} (line {node.lineno})")
    return found


def test_tests_into_benchmarks_check_finds_imports_and_paths():
    """The check itself: an import of a test module, a ``tests`` path in a sys.path line."""
    source = ('"""Docstring naming tests/ is fine."""\nimport sys\nimport reference_model\n'
              'from test_cache import Harness\nsys.path.insert(0, str(ROOT / "tests"))\n'
              'sys.path.append("../tests/support")\n')
    found = _reaches_into_tests(source, {"test_cache"})
    assert sorted(found) == ["from test_cache import ...", "path '../tests/support' (line 6)", "path 'tests' (line 5)"]


def test_benchmarks_import_nothing_from_tests():
    """No file in benchmarks/ imports a module of tests/ or puts tests/ on sys.path (the tests
    may import the benchmarks' modules, not the other way round)."""
    test_modules = _test_modules()
    offences = {path.name: found for path in sorted((REPO / "benchmarks").glob("*.py"))
                if (found := _reaches_into_tests(path.read_text(), test_modules))}
    assert not offences, f"benchmarks reaching into tests/: {offences}"
