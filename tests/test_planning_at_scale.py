"""docs/planning.md's answers at scale are the planner's: the kept file
(docs/benchmarks/planning_at_scale.json, which ``benchmarks/planning_at_scale.py`` wrote by running the
page's ``lightning-mhc-plan`` commands, and from which ``benchmarks/figures.py`` writes the page's
tables) equals a fresh plan of the same commands; the planner is deterministic, so any difference is
a changed planner or an edited figure (tests/test_figures.py holds the page to the file)."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEPT = ROOT / "docs" / "benchmarks" / "planning_at_scale.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh():
    """Every answer the page cites, planned now (the script's own ``answers``; its ``_harness``
    import path undone afterwards)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        return _load("planning_at_scale").answers()


def _kept() -> dict:
    kept = json.loads(KEPT.read_text())
    kept.pop("measured")
    return kept


def test_the_kept_answers_are_a_fresh_plan(fresh):
    assert _kept() == fresh, "the planner's answers changed: run python benchmarks/planning_at_scale.py"


def test_an_edited_figure_is_caught(fresh):
    """One byte more in one answer: the file no longer equals the plan, and the page written from it
    differs from the page."""
    edited = _kept()
    edited["questions"]["torchtitan_n4"]["asked"]["activation_bytes"] += 10**7
    assert edited != fresh
    figures = _load("figures")
    results = {**figures.load(), "planning_at_scale": edited}
    page = (ROOT / "docs" / "planning.md").read_text()
    assert figures.rewritten(page, figures.BLOCKS["docs/planning.md"], results) != page
