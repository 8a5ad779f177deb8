"""The import graph keeps the layers (docs/ARCHITECTURE.md): kernels <- ops <- tune <- the public facade
(overlap_tp/__init__.py) <- megatron <- training; bench is imported by nothing in the library. Read from
the sources (every import statement, also those inside functions), so a lazy import cannot hide an
upward dependency; and one import in a fresh interpreter checks what the op layer pulls in at run time."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> the package name it is installed as (setup.py's package_dir)
PACKAGES = {"overlap_tp": "overlap_tp", "kernels": "overlap_tp.kernels",
            "megatron_patches": "overlap_tp.megatron_patches", "launch": "overlap_tp.launch"}
LAYERS = [   # lowest first; a module may import its own layer and those below
    ("kernels", ("overlap_tp.kernels",)),
    ("ops", ("overlap_tp.ops",)),
    ("tune", ("overlap_tp.tune",)),
    ("facade", ("overlap_tp",)),
    ("megatron", ("overlap_tp.megatron", "overlap_tp.megatron_patches")),
    ("training", ("overlap_tp.training", "overlap_tp.launch")),
    ("bench", ("overlap_tp.bench",)),
]


def layer_of(module: str):
    best = None
    for index, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix), name)
    return None if best is None else (best[0], best[2])


def library_modules():
    """{module name: path} of every library source file."""
    modules = {}
    for folder, package in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__pycache__" in dirpath:
                continue
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for f in files:
                if f.endswith(".py"):
                    name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                    modules[name] = os.path.join(dirpath, f)
    return modules


def imports_of(path, module, is_package):
    """(imported module, line, at module level) for every import in the file, relative ones resolved."""
    tree = ast.parse(open(path).read(), path)
    top_level = set(id(node) for node in tree.body)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([base] if base else []))
            found.append((base, node.lineno, id(node) in top_level))
            # `from package import submodule` imports the submodule too
            found += [(f"{base}.{alias.name}", node.lineno, id(node) in top_level) for alias in node.names]
    return found


def _graph():
    modules = library_modules()
    edges = {}
    for name, path in modules.items():
        for target, line, top in imports_of(path, name, path.endswith("__init__.py")):
            if target in modules:
                edges.setdefault(name, []).append((target, line, top))
    return modules, edges


def test_no_module_imports_a_higher_layer():
    modules, edges = _graph()
    upward = []
    for name, targets in edges.items():
        mine = layer_of(name)
        assert mine is not None, f"{name} belongs to no layer: add it to LAYERS"
        for target, line, _ in targets:
            theirs = layer_of(target)
            if theirs[0] > mine[0]:
                upward.append(f"{name}:{line} ({mine[1]}) imports {target} ({theirs[1]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_bench_is_imported_by_nothing_in_the_library():
    _, edges = _graph()
    bad = [f"{name}:{line} imports {target}" for name, targets in edges.items() if layer_of(name)[1] != "bench"
           for target, line, _ in targets if layer_of(target)[1] == "bench"]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    """No cycle among module-level imports (a package counts as its __init__)."""
    _, edges = _graph()
    graph = {name: sorted({t for t, _, top in targets if top and t != name}) for name, targets in edges.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            # a submodule's parent package is imported before it: importing the parent is no cycle
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_op_layer_loads_nothing_above_it():
    """Importing every op module pulls in no tuner, benchmark, telemetry or Megatron module (the
    facade's own __init__ runs first, so it must load only the op layer and the tuner)."""
    code = ("import sys, overlap_tp.ops.gemm_rs, overlap_tp.ops.ag_gemm, overlap_tp.ops.expert\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('overlap_tp.bench', 'overlap_tp.training', "
            "'overlap_tp.megatron', 'megatron')))\n"
            "print(bad)\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
