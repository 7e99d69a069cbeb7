"""The Triton kernel modules are imported by name at call time (``fnppo.core.kernels.*_kernels()``), so a
CPU run never loads them: an attribute the library asks of them that they do not define would only fail on
a GPU. Here every ``accessor().name`` in fnppo's source is resolved against the accessor's module's source
(parsed, not imported: no Triton needed)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fnppo"


def _accessors() -> dict[str, str]:
    """``{function name: module}`` of ``fnppo/core/kernels/__init__.py``'s ``return importlib.import_module("...")``."""
    tree = ast.parse((PACKAGE / "core" / "kernels" / "__init__.py").read_text())
    out = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Return)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "attr", None) == "import_module"
                and isinstance(node.value.args[0], ast.Constant)
                and str(node.value.args[0].value).startswith("fnppo.")
            ):
                out[fn.name] = node.value.args[0].value
    return out


def _defined(module: str) -> set[str]:
    """Top-level names a module's source defines (functions, classes, assignments, imports)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _uses(accessors: dict[str, str]) -> list[tuple[str, int, str, str]]:
    """``(file, line, accessor, attribute)`` of every ``accessor().attribute`` and
    ``importlib.import_module("fnppo...").attribute`` in fnppo's source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)):
                continue
            call = node.value
            name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
            if name in accessors:
                found.append((str(path.relative_to(ROOT)), node.lineno, accessors[name], node.attr))
            elif name == "import_module" and call.args and isinstance(call.args[0], ast.Constant):
                target = str(call.args[0].value)
                if target.startswith("fnppo."):
                    found.append((str(path.relative_to(ROOT)), node.lineno, target, node.attr))
    return found


def test_every_kernel_attribute_the_library_asks_for_is_defined():
    accessors = _accessors()
    assert set(accessors) >= {"logprob_kernels", "linear_logprob_kernels", "distill_kernels", "rope_kernels"}
    uses = _uses(accessors)
    assert len(uses) >= 7, uses  # the calls were found (forward and backward of each op)
    missing = [(f, line, module, attr) for f, line, module, attr in uses if attr not in _defined(module)]
    assert not missing, f"attributes asked of kernel modules that they do not define: {missing}"
