"""Dependencies point one way: graph <- proxy/tracer <- passes <- lower."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "symtrace"
LAYERS = {"graph": 0, "errors": 0, "proxy": 1, "shadow": 1, "side_effects": 1, "tracer": 1, "capture": 1,
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
