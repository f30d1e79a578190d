"""The shape of the package: its import graph, its public names, its files, and its settings.

- no import cycle among hierps modules, type-only and function-level imports included;
- the modules stand on a ladder of layers (:data:`LAYERS`, lowest first), each module on exactly
  one rung, and every import (type-only and function-level ones, and imports of the package
  itself, included) goes to the same rung or one below: a type a lower layer needs lives there;
- ``hierps.bench`` and ``hierps.demo`` use what users can: no private module of another package;
- ``hierps.__all__`` is exactly what the package exports, and every name in it resolves;
- the repository tree matches the import tree (module name <-> file, under the two source roots:
  ``plugin/`` holds ``hierps`` and ``integrations/`` holds ``hierps.integrations``);
- the store settings have one source: ``hierps.config.StoreSettings``.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import hierps
from hierps.config import StoreSettings, parse_setting

REPO = Path(__file__).resolve().parent.parent
# (source root, the directory of the package tree it holds)
SOURCE_ROOTS = (
    (REPO / "plugin", REPO / "plugin" / "hierps"),
    (REPO / "integrations", REPO / "integrations" / "hierps" / "integrations"),
)
ROOT = "hierps"
# Package -> the source root holding it (setup.cfg's package_dir): the longest prefix decides.
PACKAGE_ROOTS = {"hierps": REPO / "plugin", "hierps.integrations": REPO / "integrations"}


def _module_name(root: Path, path: Path) -> str:
    """plugin/hierps/x/_y.py -> hierps.x._y; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _implied_paths(name: str) -> list[Path]:
    """The files module ``name`` may be, by its name: under the root of its longest package prefix."""
    prefix = max((p for p in PACKAGE_ROOTS if name == p or name.startswith(p + ".")), key=len)
    base = PACKAGE_ROOTS[prefix].joinpath(*name.split("."))
    return [base.with_suffix(".py"), base / "__init__.py"]


def _discover() -> tuple[dict[str, Path], list[str]]:
    """(every hierps module -> its file, from the files of both source roots; files that do not
    belong where they are)."""
    modules: dict[str, Path] = {}
    problems = []
    for root, tree in SOURCE_ROOTS:
        for path in sorted(tree.rglob("*.py")):
            name = _module_name(root, path)
            if name in modules:
                problems.append(f"{name} defined twice: {modules[name]} and {path}")
            if path not in _implied_paths(name):
                problems.append(f"{path}: module {name} belongs under {_implied_paths(name)[0].parent}")
            modules.setdefault(name, path)
    return modules, problems


MODULES, MISPLACED = _discover()


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int

    def where(self) -> str:
        return f"{MODULES[self.source].relative_to(REPO)}:{self.line}"


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(
    name: str, source: str | None = None, is_package: bool | None = None, modules: Collection[str] = ()
) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every import in module ``name``: top level, under
    ``if TYPE_CHECKING:``, inside functions; relative imports resolved; ``from pkg import x``
    names ``pkg.x`` when that is a module. ``source`` etc. default to the file in the tree."""
    modules = modules or MODULES
    if source is None:
        source = MODULES[name].read_text()
    if is_package is None:
        is_package = _is_package(name)
    tree = ast.parse(source, filename=name)
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                full = f"{base}.{node.module}" if node.module else base
            else:
                full = node.module or ""
            for alias in node.names:
                sub = f"{full}.{alias.name}"
                yield (sub if sub in modules else full), node.lineno


def _is_hierps(name: str) -> bool:
    return name == ROOT or name.startswith(ROOT + ".")


def _edges(into_root: bool = False) -> tuple[list[Edge], list[Edge]]:
    """(edges between hierps modules, imports of hierps names that are no module in the tree).

    Edges into the root package are left out unless ``into_root``: every submodule is below it for
    the import system, so they are no cycle to break, but ``import hierps`` still has its layer."""
    edges, dangling = [], []
    for source in MODULES:
        for target, line in _imports(source):
            if not _is_hierps(target):
                continue
            if target not in MODULES:
                dangling.append(Edge(source, target, line))
            elif target != source and (into_root or target != ROOT):
                edges.append(Edge(source, target, line))
    return edges, dangling


def _cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component with more than one module."""
    graph: dict[str, list[Edge]] = {m: [] for m in MODULES}
    for e in edges:
        graph[e.source].append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.target not in index:
                connect(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(MODULES):
        if v not in index:
            connect(v)

    cycles = []
    for comp in components:
        start = min(comp)
        # Shortest way back to ``start`` inside the component (breadth first).
        came: dict[str, Edge | None] = {start: None}
        frontier, back = [start], None
        while frontier and back is None:
            nxt = []
            for v in frontier:
                for e in sorted(graph[v], key=lambda e: e.target):
                    if e.target not in comp:
                        continue
                    if e.target == start:
                        back = e
                        break
                    if e.target not in came:
                        came[e.target] = e
                        nxt.append(e.target)
                if back is not None:
                    break
            frontier = nxt
        assert back is not None
        path = [back]
        while came[path[-1].source] is not None:
            path.append(came[path[-1].source])
        cycles.append(path[::-1])
    return cycles


def _describe(cycle: list[Edge]) -> str:
    steps = "\n".join(f"    {e.source} -> {e.target}  ({e.where()})" for e in cycle)
    return " -> ".join([cycle[0].source, *(e.target for e in cycle)]) + "\n" + steps


# -- (a) import graph ---------------------------------------------------------------------------
def test_the_tree_holds_the_expected_modules():
    # The discovery itself: both roots found, and a sample of names as the paths imply them.
    assert {"hierps", "hierps._store", "hierps.sharding._sharded", "hierps.tiers"} <= set(MODULES)
    assert {"hierps.integrations", "hierps.integrations.config"} <= set(MODULES)
    assert MODULES["hierps.integrations.config"] == SOURCE_ROOTS[1][1] / "config.py"


def test_imports_are_found_everywhere_and_resolved():
    source = """
from __future__ import annotations
import os
import hierps.rows._ids
from typing import TYPE_CHECKING
from . import _c
from ._d import thing
from .. import config
from ..rows import _table, TableInfo
if TYPE_CHECKING:
    from hierps.tiers._reader import CheckpointReader

def f():
    from hierps.storage import _reads
    import hierps.errors as errors
"""
    modules = {"hierps.pkg._c", "hierps.pkg._d", "hierps.config", "hierps.rows", "hierps.rows._table"}
    found = {t for t, _ in _imports("hierps.pkg.mod", source, False, modules | set(MODULES)) if _is_hierps(t)}
    assert found == {
        "hierps.rows._ids",
        "hierps.pkg._c",  # from . import _c: a module
        "hierps.pkg._d",  # from ._d import thing: the module, not ``thing``
        "hierps.config",  # from .. import config
        "hierps.rows._table",  # a module named in a from-import
        "hierps.rows",  # ... and a name that is no module: the package
        "hierps.tiers._reader",  # under TYPE_CHECKING
        "hierps.storage._reads",  # inside a function
        "hierps.errors",
    }
    # In a package's __init__, ``from . import x`` is relative to the package itself.
    assert {t for t, _ in _imports("hierps.pkg", "from . import _c", True, modules)} == {"hierps.pkg._c"}


def test_edges_resolve_to_modules_and_leave_out_the_root_package():
    edges, _ = _edges()
    targets = {(e.source, e.target) for e in edges}
    # ``from hierps.tiers._reader import CheckpointReader``: an edge to the module, not the package.
    assert ("hierps.sharding._commits", "hierps.tiers._reader") in targets
    # ``from hierps.rows import _ids``: ``_ids`` is a module, so the edge goes to it.
    assert ("hierps._core", "hierps.rows._ids") in targets
    assert not any(e.target == ROOT for e in edges)


def test_no_import_cycles_among_hierps_modules():
    edges, _ = _edges()
    cycles = _cycles(edges)
    assert not cycles, f"{len(cycles)} import cycle(s) among hierps modules:\n" + "\n".join(
        _describe(c) for c in cycles
    )


def test_every_hierps_import_names_a_module_or_package_in_the_tree():
    _, dangling = _edges()
    assert not dangling, "imports of hierps modules that are not in the tree:\n" + "\n".join(
        f"    {e.source} imports {e.target}  ({e.where()})" for e in dangling
    )


# -- (b) the ladder of layers -------------------------------------------------------------------
# Lowest first: (name, the prefixes of its modules). A prefix names a module and every module
# below it (``hierps.rows`` names ``hierps.rows._ids``); the root package names itself only.
LAYERS: list[tuple[str, set[str]]] = [
    # What everything may raise, and the fault points of the crash tests: no hierps import.
    ("errors", {"hierps.errors", "hierps._faults"}),
    ("config", {"hierps.config"}),
    # What a row is; and small tensor helpers (torch only), used from the tiers up.
    # ... and a loader's position as checkpoints keep it (JSON).
    ("rows", {"hierps.rows", "hierps._tensors", "hierps._position"}),
    ("storage", {"hierps.storage"}),
    # The tiers, serving from exports, the modules users touch and the store protocol they talk to.
    (
        "tiers / serving / modules",
        {"hierps.tiers", "hierps.serving", "hierps.modules", "hierps.interface", "hierps.metrics"},
    ),
    ("core", {"hierps._core"}),
    ("lifecycle", {"hierps.lifecycle"}),
    ("training", {"hierps.training"}),
    # The façade and the parts only it composes: rows by key, and durability.
    ("store", {"hierps._store", "hierps._rows", "hierps._checkpoints"}),
    ("sharding", {"hierps.sharding"}),
    # hierps/__init__.py: the public names, Store and ShardedStore among them.
    ("package", {"hierps"}),
    # hierps.deepspeed is hierps.integrations.deepspeed under its short name.
    # hierps.online: the stream of log files and the publisher of deltas, on the public API.
    ("integrations", {"hierps.integrations", "hierps.deepspeed", "hierps.online"}),
    ("demo", {"hierps.demo"}),
    # The benches, and capacity planning (sizes from the tiers, the DeepSpeed section, the bench's
    # machine probes), which the scale bench checks against what it measures.
    ("bench / planning", {"hierps.bench", "hierps.bench_dist", "hierps.planning"}),
    ("cli", {"hierps.cli"}),
]
# Packages that use only what users can: no private module (last part ``_x``) of another package.
PUBLIC_API_ONLY = ("hierps.bench", "hierps.demo")


def _names(prefix: str, name: str) -> bool:
    """Whether ``prefix`` names module ``name``: itself, or (but for the root) a module below it."""
    return name == prefix or (prefix != ROOT and name.startswith(prefix + "."))


def _layers_of(name: str, layers: list[tuple[str, set[str]]] = LAYERS) -> list[int]:
    """The index of every layer with a prefix naming ``name`` (one, in a sound ladder)."""
    return [i for i, (_, prefixes) in enumerate(layers) if any(_names(p, name) for p in prefixes)]


def _layer(name: str) -> int:
    """The layer of ``name``; -1 when it has none or several (the test of the ladder says which)."""
    layers = _layers_of(name)
    return layers[0] if len(layers) == 1 else -1


def _upward(edges: Iterable[Edge], layer: Callable[[str], int] = _layer) -> list[str]:
    """One line per edge that goes to a higher layer than its source's (modules on one layer each)."""
    return [
        f"{e.where()}: {e.source} (layer {LAYERS[layer(e.source)][0]!r}) imports {e.target} "
        f"(layer {LAYERS[layer(e.target)][0]!r}, higher)"
        for e in edges
        if -1 < layer(e.source) < layer(e.target)
    ]


def _private_reaches(edges: Iterable[Edge]) -> list[str]:
    """One line per import, from a package of :data:`PUBLIC_API_ONLY`, of another package's private module."""
    out = []
    for e in edges:
        home = next((p for p in PUBLIC_API_ONLY if _names(p, e.source)), None)
        if home is not None and not _names(home, e.target) and e.target.rpartition(".")[2].startswith("_"):
            out.append(f"{e.where()}: {e.source} imports the private module {e.target}")
    return out


def test_every_module_stands_on_exactly_one_layer():
    misplaced = {name: [LAYERS[i][0] for i in _layers_of(name)] for name in sorted(MODULES)}
    misplaced = {name: layers for name, layers in misplaced.items() if len(layers) != 1}
    assert not misplaced, (
        "modules on no layer of LAYERS, or on more than one (module: layers); give each one place in "
        f"tests/test_architecture.py: {misplaced}"
    )
    unused = sorted(p for _, prefixes in LAYERS for p in prefixes if not any(_names(p, m) for m in MODULES))
    assert not unused, f"prefixes in LAYERS that name no module of the tree: {unused}"


def test_the_layer_check_finds_an_upward_edge():
    # A synthetic import of the command line by the errors module, and one down that is fine.
    up, down = Edge("hierps.errors", "hierps.cli", 7), Edge("hierps.cli", "hierps.errors", 3)
    assert _upward([down]) == []
    (line,) = _upward([up, down])
    assert line.startswith(f"{Path('plugin', 'hierps', 'errors.py')}:7: hierps.errors (layer 'errors')")
    assert "hierps.cli (layer 'cli', higher)" in line
    # Same layer: allowed both ways; the root package stands above sharding, below integrations.
    assert (
        _upward([Edge("hierps.modules", "hierps.interface", 1), Edge("hierps.interface", "hierps.tiers", 1)])
        == []
    )
    assert _upward([Edge("hierps.sharding", ROOT, 1)]) and not _upward([Edge("hierps.integrations", ROOT, 1)])
    # A prefix names the modules below it, not a sibling whose name merely starts with it.
    assert _layers_of("hierps.bench._worker") == _layers_of("hierps.bench_dist") != _layers_of("hierps.cli")
    assert _layers_of("hierps.rows._ids") == _layers_of("hierps.rows")
    assert (
        _layers_of("hierps.nowhere") == []
        and len(_layers_of("hierps.x", [*LAYERS, ("x", {"hierps.x"})])) == 1
    )


def test_every_import_goes_to_the_same_layer_or_below():
    edges, _ = _edges(into_root=True)
    up = _upward(edges)
    assert not up, (
        f"{len(up)} import(s) up the ladder of layers (LAYERS, lowest first); move the type the lower "
        "layer needs down to it:\n" + "\n".join(f"    {line}" for line in up)
    )


def test_the_private_module_check_finds_a_reach():
    bench_worker, storage = (
        Edge("hierps.bench.dropin", "hierps.bench._worker", 1),
        Edge("hierps.demo.app", "hierps.storage._reads", 2),
    )
    assert _private_reaches([bench_worker]) == []  # its own package's private module
    assert _private_reaches([Edge("hierps.demo.app", "hierps.storage", 2)]) == []
    assert _private_reaches([Edge("hierps._store", "hierps.storage._reads", 2)]) == []  # not bench or demo
    (line,) = _private_reaches([storage, bench_worker])
    assert "hierps.demo.app imports the private module hierps.storage._reads" in line


def test_bench_and_demo_use_only_public_modules():
    edges, _ = _edges(into_root=True)
    reaches = _private_reaches(edges)
    assert not reaches, (
        "bench and demo use what users can: export the name from its package (with __all__), or "
        "move the check into tests:\n" + "\n".join(f"    {line}" for line in reaches)
    )


# -- (c) public names ---------------------------------------------------------------------------
def _exported_by_init() -> set[str]:
    """The public names ``hierps/__init__.py`` binds from hierps modules, or defines itself."""
    tree = ast.parse(MODULES[ROOT].read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or _is_hierps(node.module or "")):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def test_all_has_no_duplicates():
    assert len(hierps.__all__) == len(set(hierps.__all__))


def test_every_name_in_all_resolves():
    missing = [name for name in hierps.__all__ if not hasattr(hierps, name)]
    assert not missing, f"hierps.__all__ lists names that hierps does not have: {missing}"


def test_every_name_in_all_is_importable():
    failed = {}
    for name in hierps.__all__:
        try:
            exec(f"from hierps import {name}", {})
        except ImportError as exc:
            failed[name] = str(exc)
    assert not failed, f"`from hierps import NAME` fails for: {failed}"
    namespace: dict[str, object] = {}
    exec("from hierps import *", namespace)
    assert set(hierps.__all__) <= set(namespace)


def test_all_is_exactly_the_public_names_the_package_exports():
    exported = _exported_by_init()
    listed = set(hierps.__all__)
    assert listed == exported, (
        f"listed in hierps.__all__ but not exported: {sorted(listed - exported)}; "
        f"exported but not listed: {sorted(exported - listed)}"
    )


def test_public_names_come_from_their_modules():
    # Runtime side of the same check: each exported object is the one its module defines.
    for name in sorted(_exported_by_init()):
        obj = getattr(hierps, name)
        module = getattr(obj, "__module__", None)
        if module is not None and _is_hierps(module) and module != ROOT:
            assert getattr(importlib.import_module(module), name, None) is obj, name


# -- (d) the tree matches the import tree -------------------------------------------------------
def test_every_file_is_where_its_module_name_puts_it():
    assert not MISPLACED, "\n".join(MISPLACED)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_resolves_to_the_file_its_name_implies(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"{name}: not importable"
    assert spec.origin is not None
    implied = [p for p in _implied_paths(name) if p.exists()]
    assert implied == [MODULES[name]], (name, implied)
    assert Path(spec.origin).resolve() == implied[0].resolve(), (
        f"{name} imports from {spec.origin}, but its name implies {implied[0]}"
    )


def test_every_directory_of_modules_is_a_package():
    missing = sorted(
        str(d.relative_to(REPO))
        for _, tree in SOURCE_ROOTS
        for d in {p.parent for p in tree.rglob("*.py")}
        if not (d / "__init__.py").exists()
    )
    assert not missing, f"directories of hierps modules without __init__.py: {missing}"


def test_setup_cfg_packages_match_the_tree():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].split("\n") if p.strip()}
    packages = {name for name in MODULES if _is_package(name)}
    assert listed == packages, (
        f"setup.cfg lists {sorted(listed - packages)} that are no package in the tree; "
        f"it misses {sorted(packages - listed)}"
    )
    package_dir = {}
    for line in cfg["options"]["package_dir"].split("\n"):
        if "=" in line:
            key, _, value = line.partition("=")
            package_dir[key.strip()] = value.strip()
    for name in sorted(packages):
        key = max((k for k in package_dir if k == "" or name == k or name.startswith(k + ".")), key=len)
        rest = name[len(key) :].lstrip(".").split(".") if name != key else []
        directory = REPO / package_dir[key] / Path(*rest) if rest else REPO / package_dir[key]
        assert directory / "__init__.py" == MODULES[name], (name, directory)


# -- (e) the settings have one source -----------------------------------------------------------
def _settings_defaults() -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(StoreSettings):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def test_store_settings_defaults_equal_store_init_defaults():
    defaults = _settings_defaults()
    assert StoreSettings() == StoreSettings(**defaults)
    params = inspect.signature(hierps.Store.__init__).parameters
    kwargs = {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(kwargs) == set(defaults), (
        f"Store() takes {sorted(set(kwargs) - set(defaults))} that StoreSettings lacks; "
        f"StoreSettings has {sorted(set(defaults) - set(kwargs))} that Store() does not take"
    )
    # Store() takes raw values ("1GiB", "adagrad"): compared as StoreSettings.parse reads them.
    differ = {
        name: (p.default, defaults[name])
        for name, p in kwargs.items()
        if parse_setting(name, p.default) != defaults[name]
    }
    assert not differ, f"Store() defaults differ from StoreSettings (Store, StoreSettings): {differ}"


def test_store_settings_defaults_equal_hierarchical_ps_config_defaults():
    from hierps.integrations.config import STORE_SETTINGS, HierarchicalPSConfig

    defaults = _settings_defaults()
    fields = HierarchicalPSConfig.model_fields
    shared = set(fields) & set(defaults)
    # Every store setting but the device (each rank picks its own) is a key of the section.
    assert set(STORE_SETTINGS) == set(defaults) - {"device"}
    assert set(STORE_SETTINGS) <= shared
    differ = {
        name: (fields[name].get_default(call_default_factory=True), defaults[name])
        for name in sorted(shared)
        if parse_setting(name, fields[name].get_default(call_default_factory=True)) != defaults[name]
    }
    assert not differ, f"HierarchicalPSConfig defaults differ from StoreSettings (config, settings): {differ}"
    # And a section that sets nothing yields the StoreSettings defaults.
    section = HierarchicalPSConfig(path="/tmp/unused")
    assert {name: getattr(section, name) for name in STORE_SETTINGS} == {
        n: defaults[n] for n in STORE_SETTINGS
    }
