"""The package's import graph, read from the source (nothing is imported): no
module imports, however indirectly, a module that imports it back, and no
product module imports the test scaffolding in ``tensorhub.testing``.

Every import counts: at module level, inside a function, and under
``if TYPE_CHECKING:`` (a circle a type checker sees is still two modules that
cannot be read, moved or tested one without the other). A package counts as
its ``__init__``; importing a submodule does not count as importing its
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tensorhub

ROOT = Path(tensorhub.__file__).parent


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source."""
    known = modules()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in known.items():
        here = name if is_package else name.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{package}.{base}" if base else package
                # "from a import b": module a.b if there is one, else a name in module a
                found.update(owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known else owner(base)
                             for alias in node.names)
        graph[name] = {m for m in found if m is not None and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    found = circles(graph)
    described = ["\n  ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles:\n  " + "\n\n  ".join(described)


def test_only_tests_import_the_test_scaffolding():
    importers = sorted(m for m, deps in import_graph().items() if "tensorhub.testing" in deps)
    assert importers == [], f"product modules importing tensorhub.testing (use tensorhub.local): {importers}"


def test_the_graph_sees_every_kind_of_import():
    """The checks above are only as good as this reading of the source."""
    graph = import_graph()
    assert "tensorhub.client.rpc" in graph["tensorhub.client.puller"]  # module level
    assert "tensorhub.client.hub" in graph["tensorhub"]  # a package's __init__
    assert "tensorhub.local.hubcalls" in graph["tensorhub.local.hubprocess"]  # from a import name
    assert "tensorhub.netns" in graph["tensorhub.local.hubprocess"]  # inside a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
