"""The package's shape, read from the source: layers that only import downwards, no import cycle,
no mtp_viz import inside a function (the way a cycle hides), and no file a reader cannot hold.

A module belongs to the layer of the longest name in LAYERS that is it or contains it; a new
module that fits no name fails the test until it is placed."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mtp_viz"
MAX_LINES = 350

# Highest first, with the modules and packages of mtp_viz in each ("__init__": the package's own).
# A module may import from its own layer and the layers below it, never above.
LAYERS = (
    ("entry", "__main__ cli"),  # the command line
    ("ui", "ui"),  # Gradio layout and callbacks
    ("viz", "viz"),  # traces → HTML, figures, tables
    ("applications", "bench deploy llama_peers llama_worker peers profile quality serving training"),
    ("runner", "compiled_choice prepare runner"),  # a request → a strategy's run → a trace
    ("strategies", "strategies"),  # decoding algorithms yielding steps
    ("loading", "loading weights_auto"),  # a model and its drafters: resolve, read, derive, format, kernels
    # weight formats, drafters, the lean forward and its caches, the registry
    (
        "engine",
        "cache cuda_graphs drafters format_linear gguf_codes kernel_plan kv_slots lean projections quant registry "
        "row_plan static static_graph weights",
    ),
    (
        "foundation",
        "__init__ child clock detok errors kernels labels linear_plan machine measured native paths prompts sampling "
        "schedule served_costs theory trace visibility",
    ),
)
LAYERS = tuple(
    (what, tuple("mtp_viz" if n == "__init__" else f"mtp_viz.{n}" for n in names.split())) for what, names in LAYERS
)

# The UI's tabs: each is composed by ui.app and shares through ui's common modules, never another tab.
TABS = ("mtp_viz.ui.explore", "mtp_viz.ui.compare", "mtp_viz.ui.theory_tab", "mtp_viz.ui.bench_tab")
TABS += ("mtp_viz.ui.deploy_tab",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The mtp_viz modules an import statement loads (`from mtp_viz.ui import jobs` loads
    mtp_viz.ui.jobs; `from mtp_viz.trace import Step` loads mtp_viz.trace)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return [n for n in names if n in MODULES]


def imports_in(module: str, source: str) -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, at module level) for every mtp_viz import in one module's source."""
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    return [
        (module, target, node.lineno, id(node) in top)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for target in imported(module, node)
    ]


def imports() -> list[tuple[str, str, int, bool]]:
    return [edge for m, p in MODULES.items() for edge in imports_in(m, p.read_text(encoding="utf-8"))]


def layer_of(module: str) -> int | None:
    """Index in LAYERS (0 = highest) of the longest declared name that is or contains `module`."""
    best = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            inside = module.startswith(name + ".") and name != "mtp_viz"  # the package's __init__ holds only itself
            if (module == name or inside) and (best is None or len(name) > len(best[1])):
                best = (index, name)
    return best[0] if best else None


def upward(edges: list[tuple[str, str, int, bool]]) -> list[str]:
    """The imports of a higher layer than the importer's own."""
    return [
        f"{src} (layer {LAYERS[layer_of(src)][0]!r}) imports {dst} (layer {LAYERS[layer_of(dst)][0]!r}), line {line}"
        for src, dst, line, _ in edges
        if layer_of(src) is not None and layer_of(dst) is not None and layer_of(dst) < layer_of(src)
    ]


def cycle(edges: list[tuple[str, str, int, bool]]) -> list[str] | None:
    """One import cycle (a → b → … → a), or None."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges:
        graph.setdefault(dst, set())
        if src != dst:
            graph.setdefault(src, set()).add(dst)
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    assert upward(imports()) == []


def test_no_tab_imports_another_tab():
    assert [(src, dst) for src, dst, _, _ in imports() if src in TABS and dst in TABS and src != dst] == []


def test_no_import_cycle():
    assert cycle(imports()) is None


def test_mtp_viz_is_imported_at_module_level_only():
    """An import inside a function hides a cycle from the reader; only third-party packages that
    are optional (spaces on a ZeroGPU Space) or heavy may be imported late."""
    late = [f"{src} line {line}: {dst}" for src, dst, line, top in imports() if not top]
    assert late == []


def test_no_file_is_longer_than_a_reader_can_hold():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checks_see_what_they_look_for():
    """Planted violations: an upward import and a cycle through a function-level import are found."""
    source = "from mtp_viz.ui import jobs\nfrom mtp_viz import loading\n\ndef f():\n    from mtp_viz import trace\n"
    planted = imports_in("mtp_viz.trace", source)
    assert [(line, dst, top) for _, dst, line, top in planted] == [
        (1, "mtp_viz.ui.jobs", True),
        (2, "mtp_viz.loading", True),
        (5, "mtp_viz.trace", False),
    ]
    assert upward([("mtp_viz.trace", "mtp_viz.ui.jobs", 1, True)]) != []
    assert upward([("mtp_viz.ui.jobs", "mtp_viz.trace", 1, True)]) == []
    assert layer_of("mtp_viz.strategies.speculative") == layer_of("mtp_viz.strategies")
    assert layer_of("mtp_viz.not_placed_yet") is None
    loop = [("mtp_viz.kernels", "mtp_viz.loading", 9, False), ("mtp_viz.loading", "mtp_viz.kernels", 1, True)]
    assert cycle(loop) == ["mtp_viz.kernels", "mtp_viz.loading", "mtp_viz.kernels"]
    assert cycle(loop[1:]) is None
