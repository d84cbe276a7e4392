"""Dependencies point one way: graph <- proxy/tracer <- passes <- lower."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "symtrace"
LAYERS = {"graph": 0, "errors": 0, "proxy": 1, "shadow": 1, "side_effects": 1, "trace": 1, "capture": 1, "rollback": 1,
          "explain": 1, "transformer": 1,
          "passes": 2, "serialize": 2, "lower": 3, "interop": 4, "cli": 4, "__main__": 4}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1] if len(parts) > 1 else "", 0)


def _imports(path: pathlib.Path):
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            yield from names
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_imports_point_down_the_layers():
    bad = []
    for path in PKG.rglob("*.py"):
        if path == PKG / "__init__.py":  # the public facade re-exports every layer
            continue
        own = _layer(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
        for mod in _imports(path):
            if mod.startswith("symtrace.") and _layer(mod) > own:
                bad.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _module_graph():
    """Module -> the symtrace modules it imports (anywhere in the file, lazily or not); an
    import of a name from a package counts as an import of the package's module of that name
    when there is one. The public facade (symtrace/__init__.py) is left out."""
    names = set()
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    graph = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        package = parts[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                for a in node.names:
                    deps.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in names else mod)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in names and d not in (name, "symtrace")}
    graph.pop("symtrace", None)
    return graph


def test_no_import_cycles():
    graph = _module_graph()
    state, cycle = {}, []

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle.append(path[path.index(d):] + [d] if d in path else path + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, "import cycles inside symtrace:\n" + "\n".join(" -> ".join(c) for c in cycle)
