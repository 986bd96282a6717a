"""The package's import graph, read from the source (no import runs): no module imports
one that imports it back, imports point down the layers of ``docs/design.md`` (the
exceptions are listed here and there), and only the optimizer and the transport import
Horovod. A change that breaks one of these fails here, naming the import."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ssfusion_hvd"

#: top (0) to bottom; a module's layer is that of its longest matching prefix
LAYERS = {
    "ssfusion_hvd": 0, "ssfusion_hvd.optimizer": 0,
    "ssfusion_hvd.agreement": 1, "ssfusion_hvd.arguments": 1, "ssfusion_hvd.consistency": 1,
    "ssfusion_hvd.registry": 1, "ssfusion_hvd.recipe": 1, "ssfusion_hvd.state": 1,
    "ssfusion_hvd.transaction": 1, "ssfusion_hvd.world": 1,
    "ssfusion_hvd.ddp": 0,
    "ssfusion_hvd.schemes": 2, "ssfusion_hvd.profile": 2,
    "ssfusion_hvd.core": 3, "ssfusion_hvd.moments": 3, "ssfusion_hvd.sparsify": 3,
    "ssfusion_hvd.rules": 3,
    "ssfusion_hvd.ops": 4, "ssfusion_hvd.kernels": 4, "ssfusion_hvd.plan": 4,
}
#: imports that point up, each with its reason (docs/design.md, "Layers")
UPWARD = {
    # SyncConfig's default recipe (plain error feedback) for a scheme built without one,
    # imported where it is made
    ("ssfusion_hvd.schemes.base", "ssfusion_hvd.recipe"),
}
HOROVOD_USERS = {"ssfusion_hvd.optimizer", "ssfusion_hvd.core.transport"}


def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not name.startswith("ssfusion_hvd.examples"):  # the examples are users
            out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict):
    """(target, at module level) for every import of ``name``; imports under
    ``if TYPE_CHECKING:`` are not run and are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    if alias.name != "_C":  # the extension, not a Python module
                        yield (sub if sub in modules else base), top
            yield from walk(child, top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))

    yield from walk(ast.parse(path.read_text()), True)


def _layer(name: str) -> int:
    return LAYERS[max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)]


def _graph():
    modules = _modules()
    edges = {m: set() for m in modules}
    all_edges = {m: set() for m in modules}
    horovod = set()
    for name, path in modules.items():
        for target, top in _imports(name, path, modules):
            if target.split(".")[0] == "horovod":
                horovod.add(name)
            if target in modules and target != name:
                all_edges[name].add(target)
                if top:
                    edges[name].add(target)
    return modules, edges, all_edges, horovod


def _cycle(edges: dict):
    """One cycle of ``edges`` as a list of modules, or None."""
    state = {}

    def visit(v, path):
        state[v] = "open"
        for w in sorted(edges[v]):
            if state.get(w) == "open":
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w, path + [w])
                if found:
                    return found
        state[v] = "done"
        return None

    for v in sorted(edges):
        if v not in state:
            found = visit(v, [v])
            if found:
                return found
    return None


def test_no_import_cycle():
    _, edges, all_edges, _ = _graph()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))
    # nor one that only a function-local import closes
    assert _cycle(all_edges) is None, " -> ".join(_cycle(all_edges))


def test_imports_point_down_the_layers():
    modules, _, all_edges, _ = _graph()
    upward = {(a, b) for a in all_edges for b in all_edges[a]
              if _layer(b) < _layer(a) and not (a.startswith(b + ".") and b + "." in a + ".")}
    assert upward == UPWARD, f"imports pointing up the layers: {sorted(upward - UPWARD)}"


def test_only_the_optimizer_and_the_transport_import_horovod():
    _, _, _, horovod = _graph()
    assert horovod == HOROVOD_USERS, sorted(horovod)


def test_the_checks_see_the_imports():
    """The reader itself: it finds imports the tests above rely on (a parser that saw
    nothing would pass them)."""
    _, edges, all_edges, horovod = _graph()
    assert "ssfusion_hvd.core.transport" in edges["ssfusion_hvd.optimizer"]
    assert "ssfusion_hvd.recipe" in all_edges["ssfusion_hvd.schemes.base"]
    assert "ssfusion_hvd.recipe" not in edges["ssfusion_hvd.schemes.base"]  # function-local
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def _drawing() -> str:
    """The import graph at the top level of the package (a subpackage is one node; every
    import, function-local ones too), one line per node, in layer order."""
    modules, _, all_edges, _ = _graph()

    def unit(m):
        return m.split(".")[1] if "." in m else "__init__"

    def key(u):
        return (_layer("ssfusion_hvd" if u == "__init__" else f"ssfusion_hvd.{u}"), u)

    out = {unit(m): set() for m in modules}
    for a, targets in all_edges.items():
        out[unit(a)] |= {unit(b) for b in targets} - {unit(a)}
    return "\n".join(f"{u:<12} ->{' ' if out[u] else ''}{', '.join(sorted(out[u], key=key))}"
                     for u in sorted(out, key=key))


def test_design_md_draws_the_import_graph_as_it_is():
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    drawn = text.split("<!-- import-graph -->\n```\n")[1].split("\n```\n<!-- /import-graph -->")[0]
    assert drawn == _drawing(), "docs/design.md's import graph is stale; it is now:\n" + _drawing()
