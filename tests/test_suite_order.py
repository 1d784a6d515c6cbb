"""The suite's own schedule (tests/conftest.py): under ``make test``'s two workers the files are
handed out longest first, so the last ones left are short and neither worker waits long on the
other."""
from __future__ import annotations

import pathlib
import types

from conftest import LONGEST_FILES, pytest_collection_modifyitems

TESTS = pathlib.Path(__file__).parent


def _items(*files: tuple[str, int]) -> list:
    return [types.SimpleNamespace(path=TESTS / name, name=f"{name}::{i}") for name, count in files
            for i in range(count)]


def test_every_file_in_the_order_is_one_of_the_suites():
    """A file renamed or removed would fall silently out of the order (and back to the end)."""
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    assert [name for name in LONGEST_FILES if not (TESTS / name).is_file()] == []


def test_a_worker_sorts_the_longest_files_first_then_the_rest_by_their_number_of_tests():
    """The named files first in their order, the others most tests first; every file's tests
    together and in their order. One process (no xdist worker) keeps pytest's order."""
    first, second = LONGEST_FILES[:2]
    collected = _items(("test_few.py", 1), (second, 2), ("test_many.py", 3), (first, 1), ("test_some.py", 2))
    items = list(collected)
    pytest_collection_modifyitems(types.SimpleNamespace(), items)
    assert items == collected
    pytest_collection_modifyitems(types.SimpleNamespace(workerinput={"workerid": "gw0"}), items)
    assert [item.name for item in items] == [
        f"{first}::0", f"{second}::0", f"{second}::1", "test_many.py::0", "test_many.py::1", "test_many.py::2",
        "test_some.py::0", "test_some.py::1", "test_few.py::0"]
