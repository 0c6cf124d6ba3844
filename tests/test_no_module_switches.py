"""Behaviour switches are config fields, never module globals (docs/architecture.md, "The
model contract and the pluggable parts"; issue: 9 module-level switches changed behaviour
for every engine of a process).

A switch is a module-level ALL_CAPS name bound to a boolean: `USE_CPU_KERNEL = True`, or
`FAST = os.environ.get("X") == "1"`. Two checks, by stdlib `ast`:
- no module under wideserve/ defines one (the per-engine KernelConfig, the per-module
  `cpu_kernel` fields and PagedAttentionConfig replaced them);
- no code in wideserve/, tests/, benchmarks/ or tools/ flips one from outside:
  `module.UPPER = <boolean>` or `[monkeypatch.]setattr(module, "UPPER", <boolean>)`.
Tuning constants (sizes, thresholds, registries) stay module constants; tests may still
monkeypatch those.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Boolean constants that are not switches: the documented default of a config field, which
# the field overrides per engine (and nothing rebinds: the second check).
DEFAULTS = {
    # LoadConfig.decode_capture=None on the CPU resolves to it; True/False set it per engine
    ("wideserve/worker/decode_capture.py", "CPU_DEFAULT"),
}


def _is_caps(name: str) -> bool:
    return name.isupper() and not name.startswith("__")


def _is_boolean(node: ast.expr) -> bool:
    """A literal True/False, a comparison, `not x`, or an and/or of booleans."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, bool)
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return True
    if isinstance(node, ast.BoolOp):
        return all(_is_boolean(v) for v in node.values)
    return False


def module_switches(tree: ast.Module) -> list[str]:
    """Module-level ALL_CAPS names bound to a boolean in this module."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name) and _is_caps(t.id) and _is_boolean(value):
                found.append(t.id)
    return found


def outside_flips(tree: ast.Module) -> list[str]:
    """`x.UPPER = <boolean>` and `setattr(x, "UPPER", <boolean>)` anywhere in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_boolean(node.value):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and _is_caps(t.attr) \
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"{ast.unparse(t)} = ... (line {node.lineno})")
        if isinstance(node, ast.Call) and len(node.args) >= 3:
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else ""
            key = node.args[1]
            if name == "setattr" and isinstance(key, ast.Constant) \
                    and isinstance(key.value, str) and _is_caps(key.value) \
                    and _is_boolean(node.args[2]):
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def _files(*folders: str) -> list[Path]:
    return sorted(p for d in folders for p in (ROOT / d).rglob("*.py"))


def test_detectors_find_the_old_switches() -> None:
    """The checks below can fail: the forms the old tree used are found."""
    old = ast.parse("USE_CPU_KERNEL = True\nFUSED = os.environ.get('F', '1') == '1'\n"
                    "LIMIT = 16\nNAME = 'x'\n")
    assert module_switches(old) == ["USE_CPU_KERNEL", "FUSED"]
    flips = ast.parse("pab.USE_CPU_KERNEL = variant == 'kernel'\n"
                      "monkeypatch.setattr(pab, 'USE_CPU_KERNEL', False)\n"
                      "monkeypatch.setattr(pab, 'MATMUL_MAX_ROWS', 0)\n"
                      "self.ENABLED = True\npab.MATMUL_MAX_ROWS = 0\n")
    assert len(outside_flips(flips)) == 2


def test_no_module_level_switches_in_wideserve() -> None:
    bad = {}
    for p in _files("wideserve"):
        rel = str(p.relative_to(ROOT))
        names = [n for n in module_switches(ast.parse(p.read_text(), rel))
                 if (rel, n) not in DEFAULTS]
        if names:
            bad[rel] = names
    assert not bad, f"module-level boolean switches (make them config fields): {bad}"


def test_nothing_flips_a_module_switch_from_outside() -> None:
    bad = {str(p.relative_to(ROOT)): flips
           for p in _files("wideserve", "tests", "benchmarks", "tools")
           if (flips := outside_flips(ast.parse(p.read_text(), str(p))))}
    assert not bad, f"module switches set from outside (set the config field): {bad}"
