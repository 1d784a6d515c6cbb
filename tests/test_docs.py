"""The documentation as written: every command of README.md, docs/*.md and tests/README.md.

Commands are read from the code blocks (and from inline code that starts with a command and has
arguments). A line of a ``bash`` / ``sh`` / ``console`` block must be a command this file knows
how to check, so none goes unchecked; a command in any other block is checked too. Each kind is
checked as far as is cheap and honest:

- ``lightning-mhc-train ...`` / ``python -m lightning_mhc[.cli].train ...``: the CLI's own check
  before launch (``lightning_mhc.cli.preflight.check_command_line``: Hydra composition, the
  schemas, the data, the machine, a checkpoint to resume from), in a scratch directory. A
  ``console`` transcript's printed message must be what the command prints. Placeholders are
  substituted, each for the reason given in ``_substitute``.
- ``python examples/...`` (and ``torchrun``): the script exists and a test runs it
  (``test_hydra.py::test_examples_run_as_written``, ``test_fabric.py``, ``test_parallelize.py``);
  its extra overrides (``sweep_recompute.py``) go through the CLI's check, its options must be
  ``argparse`` options of the script. ``python benchmarks/...``: the script and its options exist.
- ``lightning-mhc-export`` / ``lightning-mhc-generate``: the ``[project.scripts]`` entry point
  imports, the arguments parse; the slow test runs them for real.
- ``pip install``: the extras exist and a pinned requirement satisfies ``pyproject.toml`` (and is
  the Makefile's); ``make``: ``make -n`` knows the target and the modules it runs import;
  ``pytest``: the files, tests and markers exist.
- ``python`` blocks compile and their imports resolve; ``lightning_mhc.*`` names in inline code
  import; repository paths in inline code and relative links (with their anchors) exist; the
  strategy's argument table is its signature; the config-group table is ``cli/conf/``.

The slow test runs the smoke command ``lightning-mhc-train trainer=debug data=synthetic`` for real
and then the commands that need its checkpoint: resume and validate (checked with the real
checkpoint; validate run), ``load_from_checkpoint``, export and generate (run).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import re
import shutil
import shlex
import subprocess
import sys
import tomllib

import pytest

from script_runs import run_module_on_a_rank, run_source_on_a_rank
from subprocess_env import child_env
from train_cli import check_before_launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))  # lm_models: the documents' $HOME/llama
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENTRY_POINTS = PYPROJECT["project"]["scripts"]  # lightning-mhc-train = "lightning_mhc.cli.train:main", ...
PROGRAMS = (*ENTRY_POINTS, "python", "pip", "make", "torchrun", "pytest", "sbatch")
TORCHRUN_OPTIONS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--standalone", "--node-rank", "--rdzv-backend",
                    "--rdzv-endpoint", "--rdzv-id", "--master-addr", "--master-port"}
"""The torchrun options the documents may use (those the tests launch with, and c10d's rendezvous)."""
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHON_LANGS = {"python", "py"}
TRAIN_MODULES = ("lightning_mhc.cli.train",)
# what examples/sweep_recompute.py puts before the overrides it is given (checked against its source)
SWEEP_EXAMPLE_OVERRIDES = ["-m", "recompute=none,selective,mhc_block,full", "trainer=debug", "data=synthetic",
                           "logger=none"]
SMOKE = "lightning-mhc-train trainer=debug data=synthetic"
"""The documented smoke run the slow test runs for real; its checkpoint feeds the placeholders."""


# ------------------------------------------------------------------ reading the documents
@dataclasses.dataclass(frozen=True)
class Block:
    doc: pathlib.Path
    line: int  # 1-based line of the first content line
    lang: str  # "" for an indented block
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Command:
    doc: pathlib.Path
    line: int
    text: str
    output: tuple[str, ...] = ()  # a console transcript's printed lines
    inline: bool = False

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def code_blocks(doc: pathlib.Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced and indented code blocks of a document, and its prose paragraphs (line, text)."""
    lines = doc.read_text().split("\n")
    blocks, prose, paragraph, start = [], [], [], 0
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", line)
        if fence:
            indent, marker, lang = len(fence.group(1)), fence.group(2), fence.group(3).lower()
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(marker):
                body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
                j += 1
            assert j < len(lines), f"{doc}:{i + 1}: unclosed code fence"
            blocks.append(Block(doc, i + 2, lang, tuple(body)))
            i = j + 1
            continue
        if line.startswith("    ") and (i == 0 or not lines[i - 1].strip()) and not paragraph:
            body, j = [], i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                body.append(lines[j][4:])
                j += 1
            while body and not body[-1].strip():
                body.pop()
            blocks.append(Block(doc, i + 1, "", tuple(body)))
            i = j
            continue
        if line.strip():
            if not paragraph:
                start = i + 1
            paragraph.append(line)
        elif paragraph:
            prose.append((start, " ".join(paragraph)))
            paragraph = []
        i += 1
    if paragraph:
        prose.append((start, " ".join(paragraph)))
    return blocks, prose


def _joined(lines: tuple[str, ...], first: int):
    """Lines with ``\\``-continuations joined, with their line numbers."""
    out, buffer, at = [], "", None
    for k, line in enumerate(lines):
        if at is None:
            at = first + k
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        out.append((at, buffer + line))
        buffer, at = "", None
    return out


def _is_command(text: str) -> bool:
    words = text.split()
    return bool(words) and words[0] in PROGRAMS


def read_commands() -> tuple[list[Command], list[str]]:
    """Every command of the documents, and the lines of shell blocks that are no known command."""
    commands, unknown = [], []
    for doc in DOCS:
        blocks, prose = code_blocks(doc)
        for block in blocks:
            if block.lang in PYTHON_LANGS:
                continue
            lines = _joined(block.lines, block.line)
            if block.lang == "console":
                for k, (at, line) in enumerate(lines):
                    if line.startswith("$ "):
                        output = []
                        for _, after in lines[k + 1:]:
                            if after.startswith("$ "):
                                break
                            output.append(after)
                        commands.append(Command(doc, at, line[2:].strip(), tuple(output)))
                continue
            for at, line in lines:
                text = line.strip()
                if _is_command(text):
                    commands.append(Command(doc, at, text))
                elif block.lang in SHELL_LANGS and text and not text.startswith("#"):
                    unknown.append(f"{doc.relative_to(ROOT)}:{at}: {text}")
        for at, paragraph in prose:
            for span in re.findall(r"`([^`]+)`", paragraph):
                span = " ".join(span.split())
                if _is_command(span) and len(span.split()) > 1:  # a bare program name is a name
                    commands.append(Command(doc, at, span, inline=True))
    return commands, unknown


def python_blocks() -> list[Block]:
    return [b for doc in DOCS for b in code_blocks(doc)[0] if b.lang in PYTHON_LANGS]


COMMANDS, UNKNOWN = read_commands()
PLACEHOLDER_CHECKPOINT = re.compile(r"<checkpoint>|outputs/<date>/<time>(/checkpoints/[^\s\"']+)?")


def _kind(command: Command) -> str:
    argv = command.argv
    if argv[0] == "python" and argv[1:3] == ["-m", "pytest"] or argv[0] == "pytest":
        return "pytest"
    if argv[0] == "lightning-mhc-train" or argv[0] == "python" and argv[1:2] == ["-m"] and argv[2] in TRAIN_MODULES:
        return "train"
    if argv[0] == "torchrun" and "-m" in argv and argv[argv.index("-m") + 1] in TRAIN_MODULES:
        return "train"
    if argv[0] in ENTRY_POINTS:
        return argv[0]
    if argv[0] == "python" and argv[1:2] == ["-m"] or argv[0] == "torchrun" and "-m" in argv:
        return "module"
    if argv[0] in ("python", "torchrun"):
        return "script"
    return argv[0]  # pip, make


def _needs_checkpoint(command: Command) -> bool:
    return bool(PLACEHOLDER_CHECKPOINT.search(command.text))


# ------------------------------------------------------------------ the checks
def _substitute(argv: list[str], scratch: pathlib.Path, checkpoint: pathlib.Path | None = None,
                run_dir: pathlib.Path | None = None, run_overrides: tuple[str, ...] = ()) -> list[str]:
    """The placeholders of a documented command line, each replaced for a stated reason."""
    out = []
    for arg in argv:
        if arg == "...":  # "the run's own overrides": none here, the smoke run's in the slow test
            out.extend(run_overrides)
            continue
        arg = os.path.expandvars(arg)  # the shell expands $HOME (HOME is the scratch directory's)
        if arg.startswith("ckpt_path=") and PLACEHOLDER_CHECKPOINT.search(arg):
            # a run's checkpoint: the slow test uses the one its smoke run wrote; here `last`, which
            # the check before launch leaves to the run, so the rest of the line is checked
            arg = f"ckpt_path={checkpoint or 'last'}"
        if checkpoint is not None and PLACEHOLDER_CHECKPOINT.fullmatch(arg):  # lightning-mhc-export's argument
            arg = str(checkpoint)
        if arg.startswith("hydra.run.dir=") and "<date>/<time>" in arg:
            arg = f"hydra.run.dir={run_dir or scratch / 'outputs' / '2026-01-01' / '00-00-00'}"
        out.append(arg)
    leftover = [a for a in out if "<" in a and ">" in a]
    assert not leftover, f"a placeholder this test does not know how to substitute: {leftover}"
    return out


def _user_files(scratch: pathlib.Path, monkeypatch, text: str = "") -> None:
    """The user's own files the documents name: ``$HOME/corpus`` (a text folder: HOME points at the
    scratch directory, holding this repository's documents as text), ``notes.txt`` (the 188-byte
    file of the transcript in docs/cli.md) and, for a command ``text`` that names it,
    ``$HOME/llama`` (a small Llama's ``save_pretrained`` directory with the sample tokenizer) or
    ``$HOME/deepseek_v4`` or ``$HOME/hy_v4`` (tests/v4_utils.py's tiny DeepSeek-V4 or HY-V4, saved) or
    ``$HOME/v4_defaults`` (DeepSeek-V4's default config, no weights)."""
    home = scratch / "home"
    if "$HOME/llama" in text:
        from lm_models import save_sample_llama

        save_sample_llama(home / "llama")
    for name, config in (("deepseek_v4", "tiny_v4_config"), ("hy_v4", "tiny_hy_v4_config")):
        if f"$HOME/{name}" in text:
            import v4_utils
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_config(getattr(v4_utils, config)()).save_pretrained(home / name)
    if "$HOME/v4_defaults" in text:  # DeepSeek-V4's published shape: its config alone, no weights
        from transformers import DeepseekV4Config

        DeepseekV4Config().save_pretrained(home / "v4_defaults")
    (home / "corpus").mkdir(parents=True, exist_ok=True)
    (home / "corpus" / "docs.txt").write_text("\n".join(doc.read_text() for doc in DOCS))
    monkeypatch.setenv("HOME", str(home))
    (scratch / "notes.txt").write_text("far too short for one batch of 64-byte windows\n" * 4)  # 188 bytes


def _argparse_options(script: pathlib.Path, follow: bool = True) -> set[str]:
    """The options a script's argparse declares, its own or in a sibling module it imports them
    from (benchmarks share their arguments)."""
    options = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-"))
        sibling = script.parent / f"{node.module}.py" if isinstance(node, ast.ImportFrom) and node.module else None
        if follow and sibling is not None and sibling.is_file():
            options |= _argparse_options(sibling, follow=False)
    return options | {"-h", "--help"}


def _tests_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py")


def _megatron_data(args: list[str], scratch: pathlib.Path) -> None:
    """The indexed datasets a ``data=megatron`` command, or an experiment of the repository's conf/
    (copied into the scratch directory: the documents run from the repository root), names, as the
    documents' preprocess command writes them (the sample corpus, ``<prefix>_text_document``): that
    command is checked on its own."""
    import yaml

    from lightning_mhc.data.megatron import parse_blend
    from lightning_mhc.data.preprocess import preprocess

    if not (scratch / "conf").exists():
        shutil.copytree(ROOT / "conf", scratch / "conf")
    blend = next((a.split("=", 1)[1].strip("[]").split(",") for a in args if a.startswith("data.blend=")), None)
    if "data=megatron" not in args:
        blend = None
    experiment = next((ROOT / "conf" / "experiment" / f"{a.split('=', 1)[1]}.yaml" for a in args
                       if a.startswith("experiment=")), None)
    while blend is None and experiment is not None and experiment.is_file():  # the experiment, or one it includes
        values = yaml.safe_load(experiment.read_text())
        blend = (values.get("data") or {}).get("blend")
        included = [d for d in values.get("defaults", []) if isinstance(d, str) and d != "_self_"]
        experiment = experiment.parent / f"{included[0]}.yaml" if included else None
    if blend is None:
        return
    for prefix in parse_blend(blend)[0]:
        if prefix.endswith("_text_document") and not (scratch / f"{prefix}.idx").exists():
            preprocess("sample", scratch / prefix.removesuffix("_text_document"), tokenizer="sample",
                       append_eod=True, progress=False)


def _check_train(command, scratch, monkeypatch, capsys):
    argv = command.argv
    if "trainer=gpu" in argv and not _cuda():
        pytest.skip("trainer=gpu needs the GPUs it asks for (the check refuses it on a machine without)")
    if argv[0] == "torchrun":  # its options are torchrun's; the run's arguments follow the module
        _check_torchrun_options(argv[1:argv.index("-m")])
        argv = ["python", *argv[argv.index("-m"):]]
    args = argv[3:] if argv[0] == "python" else argv[1:]
    _megatron_data(args, scratch)
    if argv[0] == "python":
        assert importlib.util.find_spec(argv[2]) is not None, f"no module {argv[2]}"
    status, err = check_before_launch(_substitute(args, scratch), scratch, monkeypatch, capsys)
    if command.output:  # a transcript: the command is refused with the message shown
        expected = " ".join(" ".join(command.output).split()).replace("/home/me/", f"{scratch}/")
        expected = expected.removesuffix("...").strip()
        assert status == 2, f"expected to be refused, exit status {status}: {err}"
        printed = " ".join(err.split())
        assert printed.startswith(expected), f"printed:  {printed}\nexpected: {expected} ..."
    else:
        assert status == 0, f"exit status {status}:\n{err}"


def _check_script(command, scratch, monkeypatch, capsys):
    argv = command.argv
    at = next(k for k, a in enumerate(argv) if a.endswith(".py"))
    script, args = ROOT / argv[at], argv[at + 1:]
    assert script.is_file(), f"no script {argv[at]}"
    if argv[0] == "torchrun":
        _check_torchrun_options(argv[1:at])
    if script.parent.name == "examples":
        assert script.name in _tests_text(), f"no test runs {argv[at]}"
    if script.name == "sweep_recompute.py":
        source = script.read_text()
        assert all(repr(o).strip("'") in source for o in SWEEP_EXAMPLE_OVERRIDES[1:]), "the sweep's overrides moved"
        status, err = check_before_launch([*SWEEP_EXAMPLE_OVERRIDES, *args], scratch, monkeypatch, capsys)
        assert status == 0, err
        return
    unknown = {a.split("=")[0] for a in args if a.startswith("-")} - _argparse_options(script)
    assert not unknown, f"{argv[at]} has no option {sorted(unknown)}"
    assert not [a for a in args if "=" in a and not a.startswith("-")], "key=value arguments to a non-Hydra script"


def _entry_point(name: str):
    module, _, function = ENTRY_POINTS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _check_torchrun_options(options: list[str]) -> None:
    unknown = {a.split("=")[0] for a in options if a.startswith("-")} - TORCHRUN_OPTIONS
    assert not unknown, f"torchrun options no test uses: {sorted(unknown)}"


def _check_sbatch(command, scratch, monkeypatch, capsys):
    """``sbatch examples/<script> [overrides]``: the script exists, a test runs it (under a fake
    SLURM), and the overrides pass the CLI's check."""
    script = ROOT / command.argv[1]
    assert script.is_file() and script.parent.name == "examples", f"no script {command.argv[1]}"
    assert script.name in _tests_text(), f"no test runs {command.argv[1]}"
    status, err = check_before_launch(_substitute(command.argv[2:], scratch), scratch, monkeypatch, capsys)
    assert status == 0, f"exit status {status}:\n{err}"


def _check_export(command, scratch, monkeypatch, capsys):
    main = _entry_point("lightning-mhc-export")
    with pytest.raises(SystemExit) as usage:
        main(["--help"])
    assert usage.value.code == 0
    positional = [a for a in command.argv[1:] if not a.startswith("-")]
    assert len(positional) == 2 and "checkpoint out" in capsys.readouterr().out.replace("\n", " "), positional


def _check_generate(command, scratch, monkeypatch, capsys):
    _entry_point("lightning-mhc-generate")
    from lightning_mhc.cli.generate import parse_args

    parse_args(command.argv[1:])  # keys, types and required arguments (the model is loaded in the slow test)


def _check_preprocess(command, scratch, monkeypatch, capsys):
    """Run for real (the sample corpus takes seconds) in the scratch directory: it writes the pair."""
    monkeypatch.chdir(scratch)
    _entry_point("lightning-mhc-preprocess")([*command.argv[1:], "--no-progress"])
    args = command.argv
    prefix, keys = args[args.index("--output-prefix") + 1], ["text"]
    if "--json-keys" in args:
        keys = [a for a in args[args.index("--json-keys") + 1:] if not a.startswith("-")][:1]
    for key in keys:
        assert (scratch / f"{prefix}_{key}_document.bin").is_file() and (scratch / f"{prefix}_{key}_document.idx").is_file()
    assert "documents" in capsys.readouterr().out


def _check_pip(command, scratch, monkeypatch, capsys):
    from packaging.requirements import Requirement

    argv = command.argv
    assert argv[1] == "install", argv
    extras = PYPROJECT["project"]["optional-dependencies"]
    requirements = {Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
    for spec in argv[2:]:
        if spec == "-e":
            continue
        local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
        if local:
            missing = set((local.group(1) or "").split(",")) - set(extras) - {""}
            assert not missing, f"pyproject.toml has no extra {sorted(missing)}"
            continue
        requirement = Requirement(spec)
        assert requirement.name in requirements, f"{spec}: not a dependency of the package"
        pinned = next(iter(requirement.specifier)).version
        assert requirements[requirement.name].specifier.contains(pinned), f"{spec} does not satisfy pyproject.toml"
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"CPU_TORCH \?= {re.escape(spec)}$", makefile, re.M), f"the Makefile installs another {spec}"


def _check_make(command, scratch, monkeypatch, capsys):
    proc = subprocess.run(["make", "-n", *command.argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    modules = re.findall(r" -m ([\w.]+)", proc.stdout)
    scripts = re.findall(r" ([\w/]+\.py)\b", proc.stdout)
    assert modules or scripts, proc.stdout
    for script in scripts:
        assert (ROOT / script).is_file(), f"make {command.argv[1]} runs a missing script {script}"
    for module in modules:
        if module == "pip":  # a find_spec("pip") in this process makes setuptools' distutils shim fall back to the
            continue         # stdlib's for good (its spec_for_pip), and a later `import setuptools` then fails
        assert importlib.util.find_spec(module) is not None, f"make {command.argv[1]} runs a missing module {module}"


def _check_pytest(command, scratch, monkeypatch, capsys):
    argv = command.argv[3:] if command.argv[0] == "python" else command.argv[1:]
    markers = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    k = 0
    while k < len(argv):
        arg = argv[k]
        if arg == "-m":
            words = set(re.findall(r"\w+", argv[k + 1])) - {"and", "or", "not"}
            assert words <= markers, f"unregistered markers {sorted(words - markers)}"
            k += 2
            continue
        if not arg.startswith("-"):
            path, _, test = arg.partition("::")
            assert (ROOT / path).exists(), f"no {path}"
            assert not test or f"def {test.split('[')[0]}(" in (ROOT / path).read_text(), f"no test {test} in {path}"
        k += 1


def _check_module(command, scratch, monkeypatch, capsys):
    argv = command.argv
    if argv[0] == "torchrun":
        _check_torchrun_options(argv[1:argv.index("-m")])
    module = argv[argv.index("-m") + 1]
    assert importlib.util.find_spec(module) is not None, f"no module {module}"


def _check_plan(command, tmp_path, monkeypatch, capsys):
    """``lightning-mhc-plan``: run as written (its entry point in this process; it counts from
    the config, no weights read) and succeed; ``$HOME`` expanded as the shell would."""
    from lightning_mhc.cli.plan import main

    monkeypatch.chdir(tmp_path)
    main(_substitute(command.argv[1:], tmp_path))


CHECKS = {"train": _check_train, "lightning-mhc-plan": _check_plan, "script": _check_script, "lightning-mhc-export": _check_export,
          "lightning-mhc-preprocess": _check_preprocess,
          "lightning-mhc-generate": _check_generate, "pip": _check_pip, "make": _check_make,
          "pytest": _check_pytest, "module": _check_module, "sbatch": _check_sbatch}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------ tests
def test_the_documents_hold_commands():
    """The extraction finds the commands (a parser that finds nothing would make every test pass)."""
    kinds = {_kind(c) for c in COMMANDS}
    assert {"train", "script", "lightning-mhc-export", "lightning-mhc-generate", "lightning-mhc-preprocess", "pip",
            "make", "pytest"} <= kinds
    assert len(COMMANDS) >= 40, len(COMMANDS)
    assert any(c.output for c in COMMANDS), "no console transcript found"
    readme = (ROOT / "README.md").read_text().split("\n")
    assert readme[2].split("#")[0].strip() == "make train" and readme[3].split("#")[0].strip() == "make test", \
        "README.md starts with the make train / make test lines (CI runs make test)"
    assert len(readme) <= 251, f"README.md has {len(readme)} lines (at most 250)"


def test_every_shell_line_is_a_known_command():
    assert not UNKNOWN, "lines of shell blocks this test cannot check:\n" + "\n".join(UNKNOWN)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_command_as_written(command, tmp_path, monkeypatch, capsys):
    _user_files(tmp_path, monkeypatch, command.text)
    kind = _kind(command)
    assert kind in CHECKS, f"{command.text!r}: no check for {kind!r} commands"
    CHECKS[kind](command, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: f"{b.doc.relative_to(ROOT)}:{b.line}")
def test_python_block_compiles_and_imports(block):
    """Snippets use names the reader supplies (``loader``, ``config``), so they are not run; they
    must parse, and what they import must exist."""
    source = "\n".join(block.lines)
    tree = ast.parse(compile(source, f"{block.doc.name}:{block.line}", "exec", ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{node.module} has no {missing}"


def _inline_spans():
    for doc in DOCS:
        for line, paragraph in code_blocks(doc)[1]:
            for span in re.findall(r"`([^`]+)`", paragraph):
                yield doc, line, " ".join(span.split())


def test_named_objects_import():
    """``lightning_mhc.x.y`` in the text: a module, or an attribute of one."""
    problems = []
    for doc, line, span in _inline_spans():
        name = re.fullmatch(r"(lightning_mhc(?:\.\w+)+)(?:\(.*\))?", span)
        if not name:
            continue
        parts = name.group(1).split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                problems.append(f"{doc.relative_to(ROOT)}:{line}: {span}")
            break
    assert not problems, "names that do not import:\n" + "\n".join(problems)


ROOTS = ("lightning_mhc", "tests", "docs", "examples", "benchmarks", "docker")
PACKAGE_DIRS = tuple(p.name for p in (ROOT / "lightning_mhc").iterdir() if p.is_dir() and p.name != "__pycache__")
OUTPUT_PATHS = ("benchmarks/results/",)  # written by the benchmarks, not in the repository


def test_repository_paths_exist():
    problems = []
    for doc, line, span in _inline_spans():
        if " " in span or "/" not in span or "<" in span or span.startswith(OUTPUT_PATHS):
            continue
        path = span.rstrip(".,:;")
        if path.split("/")[0] not in ROOTS + PACKAGE_DIRS:
            continue
        if not any(list(base.glob(path)) if re.search(r"[*?[]", path) else (base / path).exists()
                   for base in (ROOT, ROOT / "lightning_mhc")):
            problems.append(f"{doc.relative_to(ROOT)}:{line}: {span}")
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def _anchors(doc: pathlib.Path) -> set[str]:
    blocks, _ = code_blocks(doc)
    in_code = {b.line + k for b in blocks for k in range(-1, len(b.lines) + 1)}
    anchors = set()
    for number, line in enumerate(doc.read_text().split("\n"), 1):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and number not in in_code:
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_relative_links_resolve():
    problems = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists():
                problems.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not problems, "\n".join(problems)


def _table_first_column(text: str, after_heading: str) -> list[str]:
    section = text.split(after_heading, 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|", section.split("\n## ", 1)[0], re.M)
    return rows


def _arguments(strategy: type) -> list[str]:
    """The keyword arguments of a strategy that are ours, in its signature's order: the settings'
    fields and its own (not ``settings``, the whole value, nor its Lightning base's)."""
    lightning_base = next(cls for cls in strategy.__mro__ if cls.__module__.startswith("lightning."))
    theirs = set(inspect.signature(lightning_base.__init__).parameters) | {"self", "settings"}
    return [name for name in inspect.signature(strategy.__init__).parameters if name not in theirs]


def test_strategy_arguments_are_documented():
    """docs/trainer.md's table and the README's list name exactly the Trainer strategy's arguments,
    in order; Fabric's are the same less the two preemption settings (docs/fabric.md)."""
    from lightning_mhc.fabric import MHCParallelStrategy as FabricStrategy
    from lightning_mhc.lightning import MHCParallelStrategy

    arguments = _arguments(MHCParallelStrategy)
    table = _table_first_column((ROOT / "docs" / "trainer.md").read_text(), "## `MHCParallelStrategy`")
    assert table == arguments, (table, arguments)
    readme = (ROOT / "README.md").read_text()
    listed = re.findall(r"`(\w+)`", readme.split("**Strategy arguments**", 1)[1].split("\n- ", 1)[0])
    assert listed == arguments, (listed, arguments)
    preemption = ["save_on_preemption", "preemption_grace_s"]
    assert _arguments(FabricStrategy) == [a for a in arguments if a not in preemption]


# ------------------------------------------------------------------ the supported versions
_OPERATOR_ORDER = (">=", ">", "==", "~=", "<=", "<", "!=")


def _range(specifier) -> str:
    """``>=2.4,<3`` as the README writes it: ``>= 2.4, < 3``."""
    specs = sorted(specifier, key=lambda spec: _OPERATOR_ORDER.index(spec.operator))
    return ", ".join(f"{spec.operator} {spec.version}" for spec in specs)


def _supported() -> list[tuple[str, str, str, list[str], object]]:
    """``(package, README label, required range, tested versions, SpecifierSet)`` per row of
    pyproject.toml's ``[tool.lightning_mhc.tested]``, in its order."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = PYPROJECT["project"]
    core = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    extras = {name: {Requirement(r).name: Requirement(r) for r in reqs}
              for name, reqs in project["optional-dependencies"].items() if name != "dev"}
    rows = []
    for package, tested in PYPROJECT["tool"]["lightning_mhc"]["tested"].items():
        if package == "python":
            label, specifier = "Python", SpecifierSet(project["requires-python"])
        elif package in core:
            label, specifier = package, core[package].specifier
        else:
            extra = next(name for name, reqs in extras.items() if package in reqs)
            label, specifier = f"{package} (extra `{extra}`)", extras[extra][package].specifier
        rows.append((package, label, _range(specifier), tested, specifier))
    return rows


def test_the_supported_versions_have_one_source():
    """README.md's Install table is pyproject.toml's required ranges and ``[tool.lightning_mhc.tested]``
    row by row; each tested version is in its range; every x.y.z version the Install section, the
    Makefile's CPU torch and benchmarks/gpu_check.py's GPU wheels name is a tested one."""
    rows = _supported()
    expected = [f"| {label} | {required} | {'; '.join(tested)} |" for _, label, required, tested, _ in rows]
    install = (ROOT / "README.md").read_text().split("## Install\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in install.splitlines() if line.startswith("| ")][1:]  # past the header row
    assert table == expected, "README.md's Install table, from pyproject.toml:\n" + "\n".join(expected)
    for package, _, required, tested, specifier in rows:
        outside = [version for version in tested if version not in specifier]
        assert not outside, f"{package}: tested {outside} outside its range {required}"
    versions = {version for _, _, _, tested, _ in rows for version in tested}
    named = set(re.findall(r"(?<![\d.])\d+\.\d+\.\d+(?![\d.])", install.split("```bash")[0] + install.split("```")[-1]))
    assert named <= versions, f"README.md's Install section names untested versions {sorted(named - versions)}"
    tested = {package: versions for package, _, _, versions, _ in rows}
    cpu_torch = re.search(r"^CPU_TORCH \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert cpu_torch in tested["torch"], f"the Makefile installs torch {cpu_torch}, tested: {tested['torch']}"
    wheels = re.search(r"^GPU_WHEELS = \((.*)\)$", (ROOT / "benchmarks" / "gpu_check.py").read_text(), re.M).group(1)
    for name, version in re.findall(r'"([\w-]+)==([\w.]+)"', wheels):
        assert name not in tested or version in tested[name], f"gpu_check.py pins {name}=={version}: tested {tested[name]}"


def test_config_group_table_is_the_config_folder():
    from lightning_mhc.cli.preflight import CONF_DIR

    table = (ROOT / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))
    groups = {p.name: {f.stem for f in p.glob("*.yaml")} for p in pathlib.Path(CONF_DIR).iterdir() if p.is_dir()}
    assert set(rows) == set(groups), (sorted(rows), sorted(groups))
    for group, options in groups.items():
        assert set(re.findall(r"`(\w+)`", rows[group])) == options, (group, rows[group], options)


def test_the_model_families_the_docs_list_are_the_codes():
    """``model=hf`` (docs/cli.md) and the built-in plans (docs/bring_your_own_model.md) list every
    family of ``lightning_mhc.any_model.families.FAMILIES`` (the ``model_type``s ``plan="auto"``
    takes, MoE ones included) and no other: a family added to the code fails here until the
    documents name it."""
    from lightning_mhc.any_model.families import FAMILIES

    lists = {"cli.md": r"any family `parallelize` knows \(its `config.model_type`:(.*?)\):",
             "bring_your_own_model.md": r"`TPPlan`\s*\(\[`lightning_mhc/any_model/plan.py`\].*?\)\. Built in:(.*?)\. Styles:"}
    for name, pattern in lists.items():
        found = re.search(pattern, (ROOT / "docs" / name).read_text(), re.S)
        assert found, f"docs/{name}: the list of families is not where this test reads it"
        listed = set(re.findall(r"`(\w+)`", found.group(1)))
        assert listed == set(FAMILIES), (name, sorted(set(FAMILIES) - listed), sorted(listed - set(FAMILIES)))


# ------------------------------------------------------------------ the slow end-to-end run
def _run_entry_point(name: str, args: list[str], cwd: pathlib.Path, timeout: float = 300):
    """A console script as ``[project.scripts]`` declares it (what pip's wrapper calls)."""
    module, _, function = ENTRY_POINTS[name].partition(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=child_env())


def _entry_point_on_a_rank(name: str, args: list[str], cwd: pathlib.Path) -> str:
    """A console script's function (``[project.scripts]``) on a rank forked from the preloaded fork
    server, for the commands whose subject is what they compute, write and print; returns what it
    printed. How a console script starts is checked apart: ``test_command_as_written`` (the entry
    points import and parse their arguments) and ``test_wheel.py`` (the installed command)."""
    module, _, function = ENTRY_POINTS[name].partition(":")
    return run_module_on_a_rank(module, *args, cwd=cwd, function=function, program=name)


@pytest.mark.slow
def test_checkpoint_commands_end_to_end(tmp_path, monkeypatch, capsys):
    """The smoke run for real; then every command that names a run's checkpoint, with its. Each
    line is first checked as the CLI checks it before launch, then run on a forked rank."""
    smoke = [c for c in COMMANDS if c.text.split("#")[0].strip() == SMOKE]
    assert smoke, f"the documents no longer hold {SMOKE!r}"
    run_overrides = tuple(shlex.split(SMOKE)[1:])
    status, err = check_before_launch(list(run_overrides), tmp_path, monkeypatch, capsys)
    assert status == 0, err
    _entry_point_on_a_rank("lightning-mhc-train", list(run_overrides), tmp_path)
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))
    checkpoint = json.loads((run_dir / "summary.json").read_text())["last_checkpoint"]
    checkpoint = pathlib.Path(checkpoint)
    assert (checkpoint / "metadata.json").is_file()
    monkeypatch.setenv("HOME", str(tmp_path))

    needing = [c for c in COMMANDS if _needs_checkpoint(c)]
    assert {_kind(c) for c in needing} >= {"train", "lightning-mhc-export"}, [c.text for c in needing]
    exported = False
    for command in needing:
        argv = _substitute(command.argv, tmp_path, checkpoint, run_dir, run_overrides)
        if _kind(command) == "train":  # resume / validate: the CLI's check with the real checkpoint
            status, err = check_before_launch(argv[1:], tmp_path, monkeypatch, capsys)
            assert status == 0, f"{command.id}: {err}"
            if "mode=validate" in argv:  # and evaluating it for real
                _entry_point_on_a_rank("lightning-mhc-train", argv[1:], tmp_path)
        elif _kind(command) == "lightning-mhc-export":
            _entry_point_on_a_rank("lightning-mhc-export", argv[1:], tmp_path)
            out = tmp_path / argv[2]
            assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
            exported = True
        else:
            raise AssertionError(f"{command.id}: no end-to-end step for {command.text!r}")
    assert exported

    for command in [c for c in COMMANDS if _kind(c) == "lightning-mhc-generate"]:
        printed = _entry_point_on_a_rank("lightning-mhc-generate", command.argv[1:], tmp_path)
        prompt = dict(a.split("=", 1) for a in command.argv[1:])["prompt"]
        assert printed.startswith(prompt), printed[:200]

    loads = [b for b in python_blocks() if any("load_from_checkpoint(" in line for line in b.lines)]
    assert loads, "the documents no longer load a checkpoint in one process"
    for block in loads:
        source = PLACEHOLDER_CHECKPOINT.sub(str(checkpoint), "\n".join(block.lines))
        source += "\nprint(type(module).__name__, sum(p.numel() for p in module.parameters()))"
        printed = run_source_on_a_rank(source, tmp_path)
        assert printed.startswith("MHCGPTModule"), printed[:200]


@pytest.mark.slow
def test_quick_start_on_real_data_lowers_the_validation_loss(tmp_path):
    """The README's real-data quick start, both commands as written and for real: preprocess the
    sample corpus with the sample BPE, then train the tiny model on it; the validation loss at the
    end is below the one before training."""
    readme = [c for c in COMMANDS if c.doc.name == "README.md"]
    preprocess = next(c for c in readme if _kind(c) == "lightning-mhc-preprocess")
    train = next(c for c in readme if _kind(c) == "train" and "data=megatron" in c.argv)
    proc = _run_entry_point("lightning-mhc-preprocess", preprocess.argv[1:], tmp_path)
    assert proc.returncode == 0 and "tokens/s, 2 workers" in proc.stdout, proc.stderr[-3000:]
    proc = _run_entry_point("lightning-mhc-train", train.argv[1:], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"quick start on the sample corpus: val loss {summary['initial_val_loss']:.3f} -> "
          f"{summary['final_val_loss']:.3f} in {summary['steps']} steps")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
