"""The README's headline and docs/benchmarks.md's tables of the benchmarks it cites hold what the
kept result files (docs/benchmarks/NAME.json) say: a figure edited by hand, or a result re-run and
kept without rewriting the pages (``python benchmarks/figures.py``), fails here."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(figures):
    return figures.load()


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md", "docs/planning.md"])
def test_the_pages_hold_what_the_result_files_say(figures, results, page):
    text = (ROOT / page).read_text()
    assert figures.rewritten(text, figures.BLOCKS[page], results) == text, (
        f"{page}: run python benchmarks/figures.py")


def test_every_cited_result_says_on_what_code_it_was_taken(figures, results):
    for name, result in results.items():
        measured = result["measured"]
        assert measured["commit"] and not measured["commit"].endswith("+dirty"), (name, measured)
        assert measured["date"] and measured["cpus"] >= 1, (name, measured)
    assert set(results) == set(figures.CITED + figures.PLANNED)


def test_a_figure_edited_by_hand_or_a_result_kept_alone_is_caught(figures, results):
    """The check above can fail: one digit changed in the headline, or one result file changed
    without the pages rewritten."""
    readme = (ROOT / "README.md").read_text()
    start, end = figures.block(readme, "headline")
    block = readme[start:end]
    digit = next(i for i, c in enumerate(block) if c.isdigit() and i > block.index("- "))
    edited = readme[:start] + block[:digit] + str((int(block[digit]) + 1) % 10) + block[digit + 1:] + readme[end:]
    assert figures.rewritten(edited, figures.BLOCKS["README.md"], results) != edited

    moved = json.loads(json.dumps(results))
    row = next(r for r in moved["recompute_memory"]["rows"] if r["label"] == "mhc_block")
    row["bytes_ratio_vs_none"] += 0.01
    for page, writers in figures.BLOCKS.items():
        text = (ROOT / page).read_text()
        if "recompute_memory" in writers or page == "README.md":
            assert figures.rewritten(text, writers, moved) != text, page


def test_a_page_without_its_block_is_refused_in_one_line(figures, results):
    with pytest.raises(SystemExit, match=r"^figures: no '<!-- figures: headline, .*' \.\.\. '<!-- /figures -->' block$"):
        figures.rewritten("no markers here", figures.BLOCKS["README.md"], results)
