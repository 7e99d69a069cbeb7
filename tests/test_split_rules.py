"""The split rules are found in their folder: a new rule is its module (and its test), exported by
``fnppo.batching`` with no line to add (``fnppo/core/batching/splits/__init__.py``)."""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
from pathlib import Path

import pytest

import fnppo.batching
from fnppo.core.batching import splits
from fnppo.core.batching.splits.base import Split

FOLDER = Path(splits.__file__).parent
RULE_MODULES = sorted(p.stem for p in FOLDER.glob("*.py") if p.stem not in ("__init__", "base"))
PROTOCOL = [name for name in vars(Split) if not name.startswith("_")]  # fixed_count, refusal, count, group


def _is_rule(obj: object) -> bool:
    return inspect.isclass(obj) and obj is not Split and all(hasattr(obj, name) for name in PROTOCOL)


def test_the_protocol_is_what_the_check_reads():
    assert sorted(PROTOCOL) == ["count", "fixed_count", "group", "refusal"]
    assert RULE_MODULES and {"count", "flops", "size", "tokens"} <= set(RULE_MODULES)


@pytest.mark.parametrize("name", RULE_MODULES)
def test_every_rule_of_the_folder_is_exported_by_fnppo_batching(name):
    """Each module of the folder (read from the files, not from the package) defines its rules and
    names exactly them in its ``__all__``; each is exported by ``fnppo.batching``."""
    module = importlib.import_module(f"{splits.__name__}.{name}")
    defined = sorted(n for n, obj in vars(module).items() if _is_rule(obj) and obj.__module__ == module.__name__)
    assert defined, f"{module.__name__} defines no split rule"
    assert sorted(getattr(module, "__all__", ())) == defined, f"{module.__name__}.__all__ is not its rule class(es)"
    for rule in defined:
        assert getattr(fnppo.batching, rule) is getattr(module, rule)
        assert rule in fnppo.batching.__all__ and rule in splits.__all__


def test_the_package_exports_the_rules_in_module_order_once():
    expected = tuple(n for name in RULE_MODULES for n in importlib.import_module(f"{splits.__name__}.{name}").__all__)
    assert splits.__all__ == expected  # a tuple: nothing adds to it after import
    state = {k: v for k, v in vars(splits).items() if not k.startswith("__")}
    assert not [k for k, v in state.items() if isinstance(v, (list, dict, set))], "no registry: nothing mutable"
    exported = fnppo.batching.__all__
    assert len(exported) == len(set(exported))
    assert {"Split", "Item", *expected} <= set(exported)


PLANTED = '''
import dataclasses

from fnppo.core.batching.splits.base import contiguous

__all__ = ["ByHalves"]


@dataclasses.dataclass(frozen=True)
class ByHalves:
    """Two contiguous micro-batches."""

    @property
    def fixed_count(self):
        return 2

    def refusal(self, item, layout):
        return None

    def count(self, items, layout):
        return 2

    def group(self, items, count, layout):
        return contiguous([it.size for it in items], count)
'''


def _import_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, str]):
    """The package copied under another name, with ``extra`` modules written beside its rules."""
    copy = tmp_path / "planted_splits"
    shutil.copytree(FOLDER, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in extra.items():
        (copy / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "planted_splits"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        return importlib.import_module("planted_splits")
    finally:  # the copy's modules leave with the test (monkeypatch restores only what it changed)
        for name in [m for m in sys.modules if m.split(".")[0] == "planted_splits"]:
            del sys.modules[name]


def test_a_new_rule_module_is_picked_up_with_no_other_edit(tmp_path, monkeypatch):
    planted = _import_copy(tmp_path, monkeypatch, {"halves": PLANTED})
    rule = planted.ByHalves
    assert rule.__module__ == "planted_splits.halves" and _is_rule(rule)
    # in the order of the module names: count, flops, halves, size, tokens
    modules = sorted([*RULE_MODULES, "halves"])
    by_module = {name: importlib.import_module(f"{splits.__name__}.{name}").__all__ for name in RULE_MODULES}
    assert planted.__all__ == tuple(n for m in modules for n in (["ByHalves"] if m == "halves" else by_module[m]))
    plan = fnppo.batching.split_batch(
        [fnppo.batching.Sample.from_lists([1], [2, 3]) for _ in range(4)], rule()
    )  # the planner takes it like a built-in rule
    assert plan.microbatches == ((0, 1), (2, 3))


def test_a_rule_module_without_all_is_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(ImportError, match=r"planted_splits\.halves has no __all__"):
        _import_copy(tmp_path, monkeypatch, {"halves": PLANTED.replace('__all__ = ["ByHalves"]', "")})
