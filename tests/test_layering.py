"""The layer order of docs/architecture.md, kept: every import points down, no import cycles
(file or package level), every package and module on the map.

Imports are read with `ast` from the source, nothing is imported: module-level imports, lazy
ones inside functions and `if TYPE_CHECKING:` ones all count (a type two layers share lives
below both). Imports by name through importlib (the CLI's subcommand table in
entrypoints/cli.py, the model registry's table in models/registry.py) are not import
statements and are not seen; both name only modules of their own or lower layers.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "wideserve"
DOC = ROOT / "docs" / "architecture.md"

# Top to bottom. A module belongs to the longest entry that prefixes its name; it may import
# its own layer and any layer below, never one above. Same list in docs/architecture.md.
LAYERS: list[str] = [
    "wideserve.entrypoints",         # the `wideserve` CLI: subcommands and their flags
    "wideserve.sim",                 # the rack simulator
    "wideserve.bench",               # benchmark clients, datasets, workloads, metrics
    "wideserve.serving",             # OpenAI / Anthropic APIs, offline LLM, engine client, DP, P/D
    "wideserve.engine",              # engine core, scheduler, step worker, engine process, DP rank
    "wideserve.disagg",              # P/D KV connector (scheduler side and worker side)
    "wideserve.spec_decode",         # proposers, rejection sampler, the step's spec decoder
    "wideserve.structured_outputs",  # grammar compilation and per-step bitmasks
    "wideserve.text",                # tokenizer, detokenizer, chat templates
    "wideserve.worker",              # model runner, sampler, capture, loaders
    "wideserve.models",              # one package per model family, registry, interface
    "wideserve.layers",              # building blocks, attention backends, EP dispatch
    "wideserve.parallel",            # process groups, DP step sync, EPLB placement, transfer
    "wideserve.kv_cache",            # specs, groups, block pool, managers
    "wideserve.kernels",             # C++ CPU ops and their choice
    "wideserve.config",              # configuration objects
    "wideserve.utils",               # processes, threads, device transfer, optional deps
    "wideserve.types",               # plain shared types
    "wideserve",                     # the package root: __version__
]

# (importer, imported): why it may point up. Keep this list short.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("wideserve", "wideserve.serving.llm"):
        "the package's public API: `wideserve.LLM` is a PEP 562 lazy attribute of the root, "
        "imported only when asked for",
    ("wideserve", "wideserve.types.sampling_params"):
        "the package's public API: `wideserve.SamplingParams`, as above",
}


def _modules() -> dict[str, Path]:
    """Every module of the package; wideserve/assets/ is data (a bundled checkpoint may carry
    the Hugging Face remote-code config that belongs to it), not wideserve's code."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        if (PKG / "assets") in path.parents:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(mods: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every wideserve import, wherever it stands."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for name, path in mods.items():
        pkg = _package(name, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] == "wideserve":
                    dst = resolve(t)
                    if dst and dst != name:
                        found.append((name, dst, node.lineno))
    return found


def _layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS.index(best)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    nodes = sorted(set(edges) | {d for ds in edges.values() for d in ds})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _graph():
    mods = _modules()
    edges = [(s, d, ln) for s, d, ln in _imports(mods) if (s, d) not in EXCEPTIONS]
    return mods, edges


def test_every_module_has_a_layer():
    for name in _modules():
        assert any(name == p or name.startswith(p + ".") for p in LAYERS), name
    top = {n.split(".")[1] for n in _modules() if n.count(".") >= 1}
    unlisted = sorted(f"wideserve.{t}" for t in top if f"wideserve.{t}" not in LAYERS)
    assert not unlisted, f"top-level packages/modules not in LAYERS: {unlisted}"


def test_imports_point_down():
    _, edges = _graph()
    up = [f"{s}:{ln} imports {d} ({LAYERS[_layer(s)]} -> {LAYERS[_layer(d)]})"
          for s, d, ln in edges if _layer(d) < _layer(s)]
    assert not up, "imports against the layer order:\n" + "\n".join(up)


def test_no_file_level_cycles():
    _, edges = _graph()
    graph: dict[str, set[str]] = defaultdict(set)
    for s, d, _ in edges:
        graph[s].add(d)
    assert not _cycles(graph), f"import cycles between modules: {_cycles(graph)}"


def test_no_package_level_cycles():
    mods, edges = _graph()
    graph: dict[str, set[str]] = defaultdict(set)
    for s, d, _ in edges:
        a, b = _package(s, mods[s]), _package(d, mods[d])
        if a != b:
            graph[a].add(b)
    assert not _cycles(graph), f"import cycles between packages: {_cycles(graph)}"


def test_exceptions_are_still_needed():
    found = {(s, d) for s, d, _ in _imports(_modules())}
    stale = [k for k in EXCEPTIONS if k not in found]
    assert not stale, f"listed exceptions that no longer occur (remove them): {stale}"


def _doc_map() -> dict[str, set[str]]:
    """The module map of docs/architecture.md: package path (relative to wideserve/) -> the
    module file names listed under it. A package line starts, after its indentation, with
    `name/` and a space; it is nested in the nearest package line indented less. The `x.py`
    words that follow belong to it until the next package line."""
    text = DOC.read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    listed: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    current = None
    for line in block.splitlines():
        m = re.match(r"^(\s*)((?:\w+/)+)(?:\s|$)", line)
        if m:
            indent, name = len(m.group(1)), m.group(2).rstrip("/")
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if stack:
                current = f"{stack[-1][1]}/{name}".lstrip("/")
            else:
                current = "" if name == "wideserve" else f"../{name}"
            stack.append((indent, current))
            listed.setdefault(current, set())
        if current is not None:
            listed[current].update(re.findall(r"\b(\w+\.py)\b", line))
    return listed


def test_every_package_and_module_is_on_the_map():
    listed = _doc_map()
    missing = []
    for name, path in _modules().items():
        rel = path.parent.relative_to(PKG).as_posix()
        rel = "" if rel == "." else rel
        if rel not in listed:
            missing.append(f"package wideserve/{rel}/")
        elif path.name != "__init__.py" and path.name not in listed[rel]:
            missing.append(f"module {path.relative_to(ROOT)}")
    assert not missing, ("not in docs/architecture.md's module map:\n"
                         + "\n".join(sorted(set(missing))))


def test_the_doc_states_the_same_layer_order():
    text = DOC.read_text()
    block = text.split("## Layer order", 1)[1].split("```", 2)[1]
    names = re.findall(r"^\s*\d+\.?\s+(wideserve[\w.]*)", block, re.M)
    assert names == LAYERS, names
