"""The map of the rooms (docs/rooms.md) against the package's imports: each room imports only the
rooms and heavy packages its row allows, the map itself has no circle and no arrow up a floor, and
``distributed`` loaded whole pulls in nothing above it. Reads files only (one short subprocess)."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import lightning_mhc
from subprocess_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_mhc"
GUARDED = ("lightning", "hydra", "omegaconf")
"""The heavy packages a room may import only where the map's last column names them."""


def read_map() -> dict[str, dict]:
    """``{room: {"floor": int, "rooms": set, "packages": set}}`` from docs/rooms.md's table."""
    rows = re.findall(r"^\| *(\d+) \| `(\w+)` \|[^|]*\|([^|]*)\|([^|]*)\|$",
                      (ROOT / "docs" / "rooms.md").read_text(), re.M)
    assert rows, "docs/rooms.md: no table of rooms"
    return {room: dict(floor=int(floor), rooms=set(re.findall(r"`(\w+)`", allowed)),
                       packages=set(re.findall(r"`(\w+)`", packages)))
            for floor, room, allowed, packages in rows}


def room_of(path: pathlib.Path) -> str:
    """The room a file of the package belongs to: its folder, or its name for a top-level file."""
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at the top or inside a function, absolute; a name taken from
    the package itself (``from lightning_mhc import X``) counts as its room's import (the lazy
    ``__getattr__`` of lightning_mhc/__init__.py loads it from there)."""
    names = set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1]).split(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            if base == "lightning_mhc":
                names.update(lightning_mhc._PUBLIC.get(alias.name, f"lightning_mhc.{alias.name}")
                             for alias in node.names)
    return names


def forbidden_imports(rooms: dict[str, dict]) -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue  # the package's face: no room is imported when it is
        room = room_of(path)
        if room not in rooms:
            problems.append(f"{path.relative_to(ROOT)}: room {room!r} is not in docs/rooms.md")
            continue
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "lightning_mhc" and len(parts) > 1 and parts[1] != room \
                    and parts[1] not in rooms[room]["rooms"]:
                problems.append(f"{path.relative_to(ROOT)} imports {module}: room {room!r} may not import "
                                f"{parts[1]!r}")
            if parts[0] in GUARDED and parts[0] not in rooms[room]["packages"]:
                problems.append(f"{path.relative_to(ROOT)} imports {module}: room {room!r} may not import "
                                f"the package {parts[0]!r}")
    return problems


def test_every_import_is_one_the_map_allows():
    rooms = read_map()
    folders = {room_of(p) for p in PACKAGE.iterdir() if p.name != "__init__.py" and not p.name.startswith(("_", "."))
               and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert folders == set(rooms), ("rooms in the package and in docs/rooms.md differ", folders ^ set(rooms))
    problems = forbidden_imports(rooms)
    assert not problems, "\n".join(problems)


def test_the_map_has_no_circle_and_no_arrow_up():
    """Each room may import only rooms on lower floors; so the allowed imports cannot loop."""
    rooms = read_map()
    for room, row in rooms.items():
        unknown = row["rooms"] - set(rooms)
        assert not unknown, (room, unknown)
        up = [other for other in row["rooms"] if rooms[other]["floor"] >= row["floor"]]
        assert not up, f"{room} (floor {row['floor']}) may import {up} on its floor or above"


def test_distributed_imports_nothing_above_it_when_loaded():
    """``distributed`` loaded whole pulls in no guarded package and no room its row does not name."""
    code = ("import pkgutil, importlib, sys, lightning_mhc.distributed as d\n"
            "for m in pkgutil.walk_packages(d.__path__, 'lightning_mhc.distributed.'): importlib.import_module(m.name)\n"
            "print(sorted({n.split('.')[0] if not n.startswith('lightning_mhc.') else n.split('.')[1] "
            "for n in sys.modules}))")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(ast.literal_eval(proc.stdout.strip().splitlines()[-1]))
    rooms = read_map()
    above = (set(rooms) - rooms["distributed"]["rooms"] - {"distributed"}) | set(GUARDED)
    assert not loaded & above, sorted(loaded & above)


def read_passes() -> list[tuple[str, list[str], str]]:
    """``[(pass, [function or Class.method], file)]`` from docs/rooms.md's table of ``parallelize``'s passes."""
    text = (ROOT / "docs" / "rooms.md").read_text()
    section = text[text.index("## Inside `any_model`: the passes of `parallelize`"):]
    rows = re.findall(r"^\| ([^|`]+?) \| ((?:`[\w.]+`(?:, )?)+) \| `(\w+\.py)` \|$", section, re.M)
    assert rows, "docs/rooms.md: no table of parallelize's passes"
    return [(name, re.findall(r"`([\w.]+)`", functions), file) for name, functions, file in rows]


def test_each_pass_of_parallelize_lives_in_its_dimensions_file_and_the_conductor_calls_it():
    """Each function of a pass is defined in the file the map names, and ``model.py`` (the
    conductor) calls it: a pass moved back into the conductor, or one the conductor no longer
    runs, fails."""
    folder = PACKAGE / "any_model"
    conductor = ast.parse((folder / "model.py").read_text())
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
              for node in ast.walk(conductor) if isinstance(node, ast.Call)}
    conductor_defs = {node.name for node in conductor.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    problems = []
    for name, functions, file in read_passes():
        tree = ast.parse((folder / file).read_text())
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {f"{node.name}.{item.name}" for node in tree.body if isinstance(node, ast.ClassDef)
                    for item in node.body if isinstance(item, ast.FunctionDef)}
        for function in functions:
            if function not in defined:
                problems.append(f"{name}: {function} is not defined in any_model/{file}")
            if function.rpartition(".")[2] not in called:
                problems.append(f"{name}: the conductor (any_model/model.py) does not call {function}")
            if function in conductor_defs:
                problems.append(f"{name}: {function} is defined in the conductor, not in its pass's file")
    assert not problems, "\n".join(problems)
