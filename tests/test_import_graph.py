"""No import cycles between kvconvert's modules nor between its packages, and the commands above the
library.

The graph is read from the source (ast), not from what happens to be imported at run time, and it
counts imports inside function bodies too: those keep `--help` fast but are edges all the same, and a
cycle hidden in a function body is still two modules that cannot be read or moved apart.

Only kvconvert.commands imports click, and no library module imports kvconvert.commands: the library
is driven by options models and callbacks, the command line is one layer on top of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed package -> folder in the checkout (pyproject's package-dir)
PACKAGES = {"kvconvert": ROOT / "kvconvert", "kvconvert.runtime": ROOT / "runtime", "kvconvert.kernels": ROOT / "kernels"}


def project_modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imported(path: Path, modules: dict[str, Path], name: str | None = None) -> set[str]:
    """Every module the file imports, anywhere in it (`from a import b` is a.b when b is one of `modules`,
    else a). Relative imports (`from .x import y`, the kernels' style) are resolved against `name`, the
    importing module's dotted name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, path.name == "__init__.py")
            if base:
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _absolute(node: ast.ImportFrom, name: str | None, is_package: bool) -> str | None:
    """The absolute module a `from ... import` names (None for a relative one without the importer's name)."""
    if node.level == 0:
        return node.module
    if name is None:
        return None
    parts = name.split(".") if is_package else name.split(".")[:-1]  # the package the importer sits in
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    return {name: {t for t in imported(path, modules, name) if t in modules and t != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph(project_modules())
    assert "kvconvert.quant.stream" in graph["kvconvert.quant.calibrate"]  # imported in calibrate_streamed


def test_the_graph_sees_relative_imports():
    graph = import_graph(project_modules())
    assert "kvconvert.kernels.dequant" in graph["kvconvert.kernels._launch"]  # from .dequant import DOT_PRECISIONS
    assert "kvconvert.kernels.append" in graph["kvconvert.kernels.cache_layout"]  # in a method: from .append import


def test_no_module_imports_itself_back():
    found = cycles(import_graph(project_modules()))
    assert not found, "import cycles (move the shared helper to the module that owns its concept): " + \
        "; ".join(" <-> ".join(c) for c in found)


def package_of(module: str) -> str:
    """A module's package: its first two dotted levels (kvconvert.quant.calibrate -> kvconvert.quant;
    a flat module such as kvconvert.recipe, and kvconvert itself, are their own)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[tuple[str, str], list]]:
    """The module graph collapsed onto packages: (package -> the other packages it imports,
    (package, package) -> the sorted module imports (importer, imported) behind that edge)."""
    packages, behind = {}, {}
    for module, targets in graph.items():
        source = packages.setdefault(package_of(module), set())
        for target in targets:
            packages.setdefault(package_of(target), set())
            edge = (package_of(module), package_of(target))
            if edge[0] != edge[1]:
                source.add(edge[1])
                behind.setdefault(edge, []).append((module, target))
    return packages, {edge: sorted(pairs) for edge, pairs in behind.items()}


def describe_cycle(component: list[str], behind: dict[tuple[str, str], list], most: int = 3) -> str:
    """The package edges inside one cycle, each with the module imports that make it."""
    lines = []
    for edge in sorted(e for e in behind if e[0] in component and e[1] in component):
        pairs = behind[edge]
        shown = ", ".join(f"{a} imports {b}" for a, b in pairs[:most])
        lines.append(f"  {edge[0]} -> {edge[1]}: {shown}{f' (+{len(pairs) - most} more)' if len(pairs) > most else ''}")
    return "cycle among " + ", ".join(component) + ":\n" + "\n".join(lines)


def test_the_package_graph_collapses_modules():
    # a.x -> b.z -> c -> a.y: no module imports itself back, yet packages a, b and c form a cycle
    graph = {"k.a.x": {"k.a.y", "k.b.z"}, "k.a.y": set(), "k.b": {"k.b.z"}, "k.b.z": {"k.c"}, "k.c": {"k.a.y"}}
    packages, behind = package_graph(graph)
    assert packages == {"k.a": {"k.b"}, "k.b": {"k.c"}, "k.c": {"k.a"}}  # within a package: no edge
    assert behind == {("k.a", "k.b"): [("k.a.x", "k.b.z")], ("k.b", "k.c"): [("k.b.z", "k.c")],
                      ("k.c", "k.a"): [("k.c", "k.a.y")]}
    assert cycles(graph) == [] and cycles(packages) == [["k.a", "k.b", "k.c"]]
    assert "k.c -> k.a: k.c imports k.a.y" in describe_cycle(["k.a", "k.b", "k.c"], behind)
    assert package_of("kvconvert.quant.calibrate") == "kvconvert.quant" and package_of("kvconvert") == "kvconvert"


def test_no_package_imports_another_back():
    """Each package (kvconvert.checkpoint, kvconvert.quant, kvconvert.runtime, kvconvert.recipe, ...)
    can be read, tested and moved with only the packages below it. Today's order, low to high:
    foundations (errors, kvformat, number_formats, kvmath, memory, resources, targets, ...), models/,
    engines/ < checkpoint < sources < kernels < runtime < quant < mla < eval < heal < recipe <
    pipeline / plan / budget < commands (README, Layout)."""
    packages, behind = package_graph(import_graph(project_modules()))
    found = cycles(packages)
    assert not found, ("package import cycles (move the helper to the package that owns its concept, or "
                       "invert the dependency):\n" + "\n".join(describe_cycle(c, behind) for c in found))


# The packages' order, low to high (README, Layout): a package imports only packages of its own layer or below,
# so each can be read and tested with what lies below it. A new package or flat module must take its place here.
LAYERS = (
    ("kvconvert", "errors", "progress"),
    ("kvformat", "kvmath", "number_formats", "ggml_formats", "memory", "device", "resources", "stage_options", "targets", "presets",
     "data", "text_sources", "token_stream", "st_header", "token_stats", "models", "engines"),  # foundations: formats, maths, the architectures,
    # the engines (stock vLLM's venv, llama.cpp's bindings)
    ("checkpoint",),
    ("sources", "model_info"),
    ("kernels",),
    ("runtime",),
    ("quant",),
    ("mla",),
    ("eval",),
    ("heal",),
    ("recipe",),
    ("plan", "budget", "pipeline"),
    ("commands", "cli"),
)


def layer_of(package: str) -> int | None:
    name = package.removeprefix("kvconvert.") if package != "kvconvert" else package
    return next((i for i, names in enumerate(LAYERS) if name in names), None)


def upward_edges(packages: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Package imports that point to a higher layer than the importer's."""
    return sorted((a, b) for a, targets in packages.items() for b in targets if layer_of(b) > layer_of(a))


def test_the_layer_check_sees_an_upward_import():
    assert upward_edges({"kvconvert.quant": {"kvconvert.checkpoint"}, "kvconvert.checkpoint": set()}) == []
    assert upward_edges({"kvconvert.checkpoint": {"kvconvert.mla"}, "kvconvert.mla": set()}) == \
        [("kvconvert.checkpoint", "kvconvert.mla")]


def test_every_package_imports_only_its_layer_and_below():
    packages, behind = package_graph(import_graph(project_modules()))
    unplaced = sorted(p for p in packages if layer_of(p) is None)
    assert not unplaced, f"give these packages their layer in LAYERS (tests/test_import_graph.py): {unplaced}"
    found = upward_edges(packages)
    assert not found, "imports of a higher layer (move the helper down to the package that owns it):\n" + "\n".join(
        f"  {a} -> {b}: " + ", ".join(f"{x} imports {y}" for x, y in behind[(a, b)][:3]) for a, b in found)


COMMANDS = "kvconvert.commands"
SHIM = "kvconvert.cli"  # `python -m kvconvert.cli` (accelerate and torchrun launch a module): imports commands.main


def in_commands(module: str) -> bool:
    return module == COMMANDS or module.startswith(COMMANDS + ".")


def test_the_import_reader_sees_click_in_a_function_body(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from click.testing import CliRunner\n    import click\n")
    assert imported(source, {}) == {"click.testing", "click"}


def test_only_the_commands_import_click():
    found = {name for name, path in project_modules().items() if not in_commands(name)
             and any(m == "click" or m.startswith("click.") for m in imported(path, {}))}
    assert not found, ("click outside kvconvert/commands/ (move the command there; a library function takes an "
                       "options model or an echo callback): " + ", ".join(sorted(found)))


def test_the_library_never_imports_the_commands():
    graph = import_graph(project_modules())
    assert any(in_commands(m) for m in graph[SHIM])  # the reader sees the one edge that is allowed
    found = {name for name, targets in graph.items()
             if not in_commands(name) and name != SHIM and any(in_commands(t) for t in targets)}
    assert not found, "library modules importing kvconvert.commands: " + ", ".join(sorted(found))

