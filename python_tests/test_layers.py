"""The package's layers, from its modules' own imports: no module imports one of a higher
layer, and no two modules import each other, directly or round a longer circle.

Layers, lowest first (a module's layer is its first folder, or its name at the top):
    base          config, _platform, models, workloads (import nothing of the package)
    ops           ops/ (the ops, their checks and fakes, and their backends reference/ and triton/)
    loop          loop/ (generate, drafters, planner, cost model, logits processing, the HF adapter)
    heads         heads/ (learned drafters)
    integrations  integrations/ (our loop and drafters inside transformers' generate, vLLM)
    methods       methods (the named methods the command line and benchmarks share)
    benchmarks    benchmarks/
    top           cli, __main__, and the package's __init__ (the public API)
Imports are read from the source (every `import` and `from ... import`, at module level or
inside functions), so a new module or a new import is checked without editing this file;
only a new top-level folder or module needs its layer named here.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specdec_kernels"
LAYERS = (("base", {"config", "_platform", "models", "workloads"}),
          ("ops", {"ops", "_C"}),
          ("loop", {"loop"}),
          ("heads", {"heads"}),
          ("integrations", {"integrations"}),
          ("methods", {"methods"}),
          ("benchmarks", {"benchmarks"}),
          ("top", {"cli", "__main__", "__init__"}))
RANK = {name: rank for rank, (_, names) in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    """'specdec_kernels.loop.generate' for loop/generate.py; a package's __init__ is the package."""
    parts = ("specdec_kernels",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    """Every module of the package: name -> (path, is a package)."""
    return {module_name(p): (p, p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, is_package: bool, known: dict) -> set:
    """The package's modules that `name` imports (relative imports resolved; `from x import y`
    names the module x.y when y is a module, else x)."""
    found = set()
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import specdec_kernels.ops.verify` etc.
                target = target.rpartition(".")[0]
            if target.startswith("specdec_kernels") and target != name:
                found.add(target)
    return found


def graph() -> dict:
    known = modules()
    return {name: imports(name, path, is_pkg, known) for name, (path, is_pkg) in known.items()}


def layer(name: str) -> int:
    """The module's layer rank: its first part below the package (the package itself: top)."""
    parts = name.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    if first not in RANK:
        pytest.fail(f"{name}: its folder or module {first!r} has no layer; name it in LAYERS")
    return RANK[first]


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_no_upward_import():
    upward = [f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})"
              for a, targets in graph().items() for b in sorted(targets)
              if layer(b) > layer(a) and not b.startswith(a + ".")]  # a package may import its own modules
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def find_cycle(edges: dict):
    """One import circle as a list of modules (first == last), or None (depth-first search)."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return None


def test_no_import_circle():
    # A package's __init__ importing its own submodules is how packages export names, and every
    # submodule's import runs its parents' __init__ first: those edges are not circles.
    edges = {a: {b for b in targets if not b.startswith(a + ".")} for a, targets in graph().items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checker_finds_circles_and_upward_imports():
    # The search itself, on made-up graphs: a circle of three, and none.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert layer("specdec_kernels.cli") > layer("specdec_kernels.benchmarks.e2e.runner") > layer("specdec_kernels.loop.generate")
    assert layer("specdec_kernels.ops.reference.verify") == layer("specdec_kernels.ops.verify") < layer("specdec_kernels.loop.hf")
