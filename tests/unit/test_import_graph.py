"""The import graph among pagedllm's modules has no cycle, counting imports inside functions too.

Every module under pagedllm/ is parsed with `ast` (nothing is imported). An edge A -> B is an import in A, at
any depth (module level, function, method, `if TYPE_CHECKING:`), that names module B: `import pagedllm.x.y`,
`from pagedllm.x import y` (B is `pagedllm.x.y` if that is a module, else `pagedllm.x`), or the relative forms.

One thing is not counted, and this is deliberate: the implicit import of the parent packages. Importing
`pagedllm.engine.llm` runs `pagedllm/__init__.py` first, and that file re-exports `LLM` from
`pagedllm.engine.llm`; counting the implicit edge would make every module of the package a cycle with the
package's `__init__`. An explicit `from pagedllm import X` or `import pagedllm` does count (an edge to
`pagedllm`, i.e. its `__init__`), so a module that the package `__init__` re-exports cannot import it back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

PACKAGE_ROOT = Path(pagedllm.__file__).resolve().parent
PACKAGE = "pagedllm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# Extension modules built from pagedllm/csrc by the install (setup.py).
EXTENSIONS = {"pagedllm._C"}


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The pagedllm modules that `module` imports explicitly, anywhere in its source."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, path.name == "__init__.py", node.level, node.module)
            else:
                base = node.module or ""
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    found -= EXTENSIONS  # compiled by the install, no Python source: they import nothing of ours
    unknown = found - modules
    assert not unknown, f"{module} imports modules that do not exist: {sorted(unknown)}"
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    names = set(modules)
    return {name: imports_of(name, path, names) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None. Iterative DFS with three colours."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if colour[start] != white:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        colour[start] = grey
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = black
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if colour[nxt] == grey:
                return path[path.index(nxt) :] + [nxt]
            if colour[nxt] == white:
                colour[nxt] = grey
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # cli.py imports LLM inside its command functions only; the graph must still see it.
    assert PACKAGE in graph["pagedllm.entrypoints.cli"]
    assert "pagedllm.engine.arg_utils" in graph["pagedllm.entrypoints.cli"]
    assert "pagedllm.model.config_loader" in graph["pagedllm.engine.arg_utils"]


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_pagedllm_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
