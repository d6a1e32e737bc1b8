"""The package's imports form no cycle: every `import` of a cllm module, at a module's top or
inside a function (an import placed in a function to dodge a cycle is still a cycle)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The cllm modules `path` imports anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package up
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported(path, set(paths)) for name, path in paths.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def core_importers() -> set[str]:
    """The modules that import the compiled core (cllm.llama._core), anywhere in them."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if "cllm.llama._core" in names:
                found.add(module_name(path))
    return found


def test_only_the_engine_and_the_embedder_import_the_core():
    """The HTTP layer reaches llama.cpp through them (the benchmark's engine-direct series
    loads the core itself, to set its threads' wait policy first)."""
    assert core_importers() == {"cllm.engine.engine", "cllm.engine.embedder", "cllm.bench.direct"}


def test_the_package_imports_form_no_cycle():
    edges = graph()
    assert "cllm.app.server" in edges and "cllm.http.common" in edges["cllm.app.server"]
    assert cycle(edges) is None, " -> ".join(cycle(edges))


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# Each wing may import its own modules and those of the wings listed before it, never one after
# it: the shared modules, the native core's package, the engine, the HTTP plumbing, the API
# protocols, the app, scale-out, the command line. The benchmark stands beside them all.
LAYERS = (("cllm", "cllm.config", "cllm.errors", "cllm.models"), ("cllm.llama",),
          ("cllm.engine",), ("cllm.http",), ("cllm.protocols",), ("cllm.app",),
          ("cllm.scaleout",), ("cllm.serve",))


def layer(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or (p != "cllm" and module.startswith(p + ".")) for p in prefixes):
            return rank
    return None


def test_every_module_belongs_to_a_wing():
    assert {m for m in graph() if layer(m) is None and not m.startswith("cllm.bench")} == set()


def test_no_wing_imports_a_wing_above_it():
    upward = {(a, b) for a, targets in graph().items() for b in targets
              if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)}
    assert upward == set()


def test_the_protocols_are_imported_only_by_the_apps():
    importers = {a for a, targets in graph().items()
                 if any(layer(b) == 4 for b in targets) and layer(a) != 4}
    assert importers <= {"cllm.app.server", "cllm.scaleout.ray_app"}
