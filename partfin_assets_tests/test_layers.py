"""The layer diagram of docs/architecture.md holds: no lower layer imports a higher one, no import cycles.

Read from the source (ast), so a violation is named by module and line before anything runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "partfin_assets"

# Top-level part of partfin_assets -> its layer. A module may import its own part and any
# part of a lower layer; parts of one layer (iceberg / sources, ingest / finalization) stay apart.
LAYERS = {
    "model": 0,
    "testing": 0,  # env-driven fault hooks and test processes: import nothing of partfin; only entry points import them
    "iceberg": 1,
    "sources": 1,
    "watermark": 2,
    "ingest": 3,
    "finalization": 3,
    "jobs": 4,
    "defs": 5,
    "cli": 5,
    "definitions": 6,
}
DAGSTER_ALLOWED = {"defs", "definitions"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


# "partfin_assets.<module>:<name>": a name pkgutil.resolve_name imports when it is needed (the CLI's command
# table, cli/__init__.py). An import all the same: its edge counts for layers and cycles like any other.
IMPORTED_BY_NAME = re.compile(r"(partfin_assets(?:\.\w+)*):\w+")
# the one module that imports by name: lazy loading in one table, never scattered through function bodies
LOADS_BY_NAME = {"partfin_assets.cli"}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in a file, those by name included."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    in_functions = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    for inner in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (named := IMPORTED_BY_NAME.fullmatch(node.value)):
            found += [(named.group(1), node.lineno, id(node) not in in_functions)]
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.module, node.lineno, id(node) in top_level)]
            found += [(n, node.lineno, id(node) in top_level) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
    return found


def partfin_edges() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for target, _, _ in imports(path):
            if target in known and target != module:
                edges[module].add(target)
    return edges


def test_every_part_has_a_layer():
    parts = {part_of(m) for m in modules() if m != "partfin_assets"}
    assert parts <= set(LAYERS), f"parts without a layer in the diagram: {sorted(parts - set(LAYERS))}"


def test_no_layer_imports_a_higher_one_or_a_sibling():
    wrong = []
    for module, targets in partfin_edges().items():
        source = part_of(module)
        for target in targets:
            other = part_of(target)
            if other != source and LAYERS[other] >= LAYERS[source]:
                wrong.append(f"{module} ({source}, layer {LAYERS[source]}) imports {target} ({other}, layer {LAYERS[other]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = partfin_edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_partfin_modules_are_imported_at_module_level_only():
    # a function-level import is how a cycle hides; none is needed
    deferred = [
        f"{module}:{line} imports {target}"
        for module, path in modules().items()
        for target, line, top in imports(path)
        if not top and target.startswith("partfin_assets")
    ]
    assert not deferred, "\n".join(sorted(set(deferred)))


def test_only_the_command_table_imports_by_name():
    """importlib / pkgutil.resolve_name / __import__ hide an import from every check above unless its target is
    written as a name IMPORTED_BY_NAME reads: one module does it, the CLI's command table."""
    loaders = {"importlib", "import_module", "resolve_name", "__import__"}
    wrong = [
        f"{module}:{node.lineno} uses {name}"
        for module, path in modules().items()
        if module not in LOADS_BY_NAME
        for node in ast.walk(ast.parse(path.read_text()))
        for name in [node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else
                     node.name if isinstance(node, ast.alias) else None]
        if name in loaders
    ]
    assert not wrong, "\n".join(wrong)


def test_the_command_table_names_what_it_imports():
    from partfin_assets.cli import COMMANDS, RUN

    edges = partfin_edges()["partfin_assets.cli"]
    assert {name.split(":")[0] for name in [*COMMANDS.values(), RUN]} <= edges


# the processes' entry points: only they install the environment-driven fault hooks of testing/
FAULT_INSTALLERS = {"partfin_assets.cli", "partfin_assets.definitions"}


def test_production_code_never_imports_testing():
    """Fault points call the hooks of model/faults.py; which hooks those are is the entry point's choice."""
    wrong = [
        f"{module}:{line} imports {target}"
        for module, path in modules().items()
        if part_of(module) != "testing" and module not in FAULT_INSTALLERS
        for target, line, _ in imports(path)
        if part_of(target) == "testing" and target.startswith("partfin_assets.")
    ]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_only_the_dagster_layer_imports_dagster():
    wrong = [
        f"{module}:{line} imports {target}"
        for module, path in modules().items()
        if part_of(module) not in DAGSTER_ALLOWED
        for target, line, _ in imports(path)
        if target == "dagster" or target.startswith("dagster.") or target.startswith("dagster_")
    ]
    assert not wrong, "\n".join(sorted(set(wrong)))


# ---- docs/architecture.md's "Layers and modules" section says the same as the code

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _documented_layout() -> tuple[str, str]:
    """(the layer diagram, the module table) of docs/architecture.md's Layers and modules section."""
    section = ARCHITECTURE.read_text().split("\n## Layers and modules\n", 1)[1].split("\n## ", 1)[0]
    diagram = section.split("```\n", 1)[1].split("```", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `"))
    return diagram, table


def test_documented_diagram_draws_every_part_at_its_layer():
    diagram, _ = _documented_layout()
    drawn = {}
    for line in diagram.splitlines():
        layer, *words = line.split()
        for word in words[:2]:  # the parts; the rest of the line is what they are
            part = word.rstrip("/").removesuffix(".py")
            if part in LAYERS:
                drawn[part] = int(layer)
    assert drawn == LAYERS


def test_documented_module_table_names_every_module():
    _, table = _documented_layout()
    rows = table.splitlines()
    missing = []
    for module, path in modules().items():
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        if f"`{relative}`" in table:
            continue
        package = f"`{path.parent.relative_to(PACKAGE).as_posix()}/`"
        if not any(package in row and f"`{path.stem}`" in row for row in rows):
            missing.append(relative)
    assert not missing, f"modules docs/architecture.md's module table does not name: {missing}"
