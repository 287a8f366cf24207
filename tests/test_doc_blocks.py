"""Every code block in the documentation works as written: README.md, docs/**/*.md, recipes/**/*.md and
examples/**/*.md, found anew at every run (a new page is covered with no edit here).

- ```python blocks compile (default run) and run, each in a fresh interpreter in a scratch folder that
  sees the repository's top-level files (``recipes/...`` resolves, nothing is written into the checkout)
  (``-m slow``: the README's training sample alone takes ~10 s). A block runs at the scale it is
  written at; an HTML comment on the line before it may set environment variables that the block
  reads for its tiny scale, ``<!-- tiny: NAME=VALUE ... -->``, or exclude it where running is impossible
  here, ``<!-- not-run: REASON -->`` (needs a GPU, vLLM, the hub). Exclusions must give a reason.
- ```bash / ```sh / ```console blocks: every ``ncgrpo <command> ...`` invocation (also ``.venv/bin/ncgrpo``,
  ``python -m ncgrpo.cli``, ``accelerate launch ... -m ncgrpo.cli``) parses with the command line's own
  parser, so the command and each flag exist (``[--optional]`` brackets and ``...`` are the reader's);
  ``python -m ncgrpo.X`` names a module that exists; ``python FILE`` / ``bash FILE`` name files that exist.
  A block marked ``<!-- run -->`` is also run line by line in the scratch folder and must succeed.
- Paths that docstrings in ``src/`` give as ``src/ncgrpo/...`` or ``ncgrpo/...`` exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
DIRECTIVE = re.compile(r"^\s*<!--\s*(not-run|tiny|run)\b:?\s*(.*?)\s*-->\s*$")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directive: str | None = None  # not-run | tiny | run
    argument: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    files = {ROOT / "README.md"}
    for folder in ("docs", "recipes", "examples"):
        files.update(p for p in (ROOT / folder).rglob("*.md") if p.is_file())
    return sorted(files)


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body, i = i, [], i + 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""
        ):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        d = DIRECTIVE.match(before)
        block = Block(path, start + 1, lang.lower(), "\n".join(body) + "\n")
        if d:
            block.directive, block.argument = d.group(1), d.group(2)
            if block.directive == "tiny":
                block.env = dict(kv.split("=", 1) for kv in block.argument.split())
        found.append(block)
    return found


def all_blocks(langs: set[str]) -> list[Block]:
    return [b for f in doc_files() for b in blocks(f) if b.lang in langs]


PYTHON = all_blocks({"python", "py"})
SHELL_BLOCKS = all_blocks(SHELL)


def _sandbox(tmp_path: Path) -> Path:
    """A scratch folder that sees the checkout's top-level entries (read through symlinks)."""
    box = tmp_path / "cwd"
    box.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs"):
            (box / entry.name).symlink_to(entry)
    return box


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    bin_dir = str(Path(sys.executable).parent)  # `ncgrpo` is the venv's console script
    full_env["PATH"] = bin_dir + os.pathsep + full_env.get("PATH", "")
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------ python
def test_the_blocks_are_found() -> None:
    ids = {b.id for b in PYTHON}
    assert any(i.startswith("README.md:") for i in ids), ids  # the library sample
    assert any(i.startswith("docs/") for i in ids), ids


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_compiles(block: Block) -> None:
    if block.directive == "not-run":
        assert len(block.argument) >= 10, f"{block.id}: <!-- not-run: ... --> needs its reason"
    compile(block.code, block.id, "exec")


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path) -> None:
    if block.directive == "not-run":
        pytest.skip(f"not run here: {block.argument}")
    box = _sandbox(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    proc = _run([sys.executable, str(script)], box, block.env)
    assert proc.returncode == 0, f"{block.id} failed as written:\n{(proc.stdout + proc.stderr)[-4000:]}"


def test_few_exclusions() -> None:
    """Exclusions stay the exception: at most a quarter of the Python blocks, each with its reason."""
    excluded = [b for b in PYTHON if b.directive == "not-run"]
    assert len(excluded) <= max(2, len(PYTHON) // 4), [b.id for b in excluded]


# ------------------------------------------------------------------------------------------- shell
def _logical_lines(code: str) -> list[str]:
    out, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if line.startswith(("$ ", "> ")):  # a console prompt
            line = line[2:]
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return [line for line in out if line.strip() and not line.lstrip().startswith("#")]


def _commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    tokens, cmds, current = list(lexer), [], []
    for t in tokens:
        if t and set(t) <= set(";&|"):
            cmds.append(current)
            current = []
        else:
            current.append(t)
    cmds.append(current)
    return [c for c in cmds if c]


def _ncgrpo_argv(cmd: list[str]) -> list[str] | None:
    """The arguments after the `ncgrpo` program in one command, or None if it does not call ncgrpo."""
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):  # VAR=value prefixes
        cmd = cmd[1:]
    if cmd and Path(cmd[0]).name == "ncgrpo":
        return cmd[1:]
    for k, t in enumerate(cmd[:-1]):
        if t == "-m" and cmd[k + 1] in ("ncgrpo", "ncgrpo.cli"):
            return cmd[k + 2 :]
    return None


def _reader_notation(argv: list[str]) -> list[str]:
    cleaned = [t.replace("[", "").replace("]", "") for t in argv if t not in ("...", "…")]
    return [t for t in cleaned if t]


def _unknown_flags(argv: list[str]) -> str:
    """What is wrong with the command or its flags, by the parser's own tables ('' when nothing)."""
    import argparse

    from ncgrpo.cli import build_parser

    parser, rest = build_parser(), [t for t in argv if t != "--debug"]
    while rest:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        if rest[0] not in subs[0].choices:
            return f"no command {rest[0]!r}"
        parser, rest = subs[0].choices[rest[0]], rest[1:]
    if hasattr(parser, "_materialize"):  # ConfigParser adds the dataclass fields' flags when first used
        parser._materialize()
    known = {o for a in parser._actions for o in a.option_strings}
    bad = [t.split("=", 1)[0] for t in rest if t.startswith("--") and t.split("=", 1)[0] not in known]
    return f"unknown flags {bad}" if bad else ""


def _module_exists(name: str) -> bool:
    rel = Path("src", *name.split("."))
    return (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__main__.py").is_file()


def _check_command(cmd: list[str], where: str) -> list[str]:
    problems = []
    argv = _ncgrpo_argv(cmd)
    if argv is not None and any(t in ("...", "…") for t in argv):
        # "the rest as above": the flags given must exist; the required ones may be elided
        unknown = _unknown_flags(_reader_notation(argv))
        if unknown:
            problems.append(f"{where}: `ncgrpo {' '.join(argv)}`: {unknown}")
        return problems
    if argv is not None:
        from ncgrpo.cli import build_parser

        try:
            build_parser().parse_args(_reader_notation(argv))
        except SystemExit as e:
            if e.code not in (0, None):
                problems.append(f"{where}: `ncgrpo {' '.join(argv)}` does not parse (exit {e.code})")
        except Exception as e:  # noqa: BLE001 - a ConfigError names the unknown flag
            problems.append(f"{where}: `ncgrpo {' '.join(argv)}`: {type(e).__name__}: {e}")
        return problems
    exe = Path(cmd[0]).name
    if exe.startswith("python") and len(cmd) > 2 and cmd[1] == "-m" and cmd[2].startswith("ncgrpo"):
        if not _module_exists(cmd[2]):
            problems.append(f"{where}: `python -m {cmd[2]}`: no such module in src/")
    elif exe.startswith("python") or exe == "bash":
        script = next((t for t in cmd[1:] if not t.startswith("-")), None)
        if script and script.endswith((".py", ".sh")) and not (ROOT / script).is_file():
            problems.append(f"{where}: `{exe} {script}`: no such file in the repository")
    return problems


def test_shell_blocks_are_found() -> None:
    assert any(
        _ncgrpo_argv(c) for b in SHELL_BLOCKS for line in _logical_lines(b.code) for c in _commands(line)
    )


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.id)
def test_shell_block_commands_exist(block: Block, capsys) -> None:
    problems = []
    for line in _logical_lines(block.code):
        try:
            cmds = _commands(line)
        except ValueError as e:  # unbalanced quotes
            problems.append(f"{block.id}: cannot split {line!r}: {e}")
            continue
        for cmd in cmds:
            problems += _check_command(cmd, block.id)
    capsys.readouterr()  # --help text of a parsed `--help` line
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if b.directive == "run"], ids=lambda b: b.id)
def test_marked_shell_block_runs(block: Block, tmp_path) -> None:
    box = _sandbox(tmp_path)
    for line in _logical_lines(block.code):
        proc = _run(["bash", "-c", line], box, block.env)
        assert proc.returncode == 0, f"{block.id}: `{line}` failed:\n{(proc.stdout + proc.stderr)[-4000:]}"


# -------------------------------------------------------------------------------------- docstrings
DOCSTRING_PATH = re.compile(r"``((?:src/)?ncgrpo/[\w./-]+)``")


def test_paths_in_docstrings_exist() -> None:
    missing = []
    for py in sorted((ROOT / "src" / "ncgrpo").rglob("*.py")):
        for m in DOCSTRING_PATH.finditer(py.read_text()):
            cited = m.group(1).rstrip("/.")
            if not ((ROOT / cited).exists() or (ROOT / "src" / cited).exists()):
                missing.append(f"{py.relative_to(ROOT)}: ``{cited}``")
    assert not missing, "docstrings cite paths that do not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------ drift
def test_the_demo_time_is_one_figure() -> None:
    """The README's demo time (seconds, as measured) is the one every other page and the demo's help give."""
    m = re.search(r"`ncgrpo demo` runs .*?\((\d+(?:\.\d+)?) s, about", (ROOT / "README.md").read_text(), re.S)
    assert m, "README.md's demo paragraph gives no measured time in seconds"
    figure = f"{m.group(1)} s"
    pages = ["docs/embedded-base.md", "docs/quickstart.md", "docs/benchmarks.md"]
    pages += ["src/ncgrpo/toy/demo_config.py", "src/ncgrpo/commands/demo.py"]
    missing = [p for p in pages if figure not in (ROOT / p).read_text()]
    assert not missing, f"these do not give the README's demo time ({figure}): {missing}"


# ----------------------------------------------------------------------------------- the checker
def test_the_checker_catches_a_broken_block(tmp_path) -> None:
    """The parsing and the flag check fail on a wrong command and pass a right one."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not-run: needs a GPU and vLLM -->\n```python\nimport vllm\n```\n\n"
        "```bash\nncgrpo train --config recipes/tiny_cpu_latent.yaml --sigmaa0 0.3   # typo\n"
        "ncgrpo probe --sigma0 0 0.2 [--target_marginal_tv 0.02]\nncgrpo evaluate --x 1\n```\n"
    )
    py, sh = blocks(page)
    assert (py.directive, py.argument, py.line) == ("not-run", "needs a GPU and vLLM", 2)
    problems = [
        p for line in _logical_lines(sh.code) for c in _commands(line) for p in _check_command(c, "x")
    ]
    assert len(problems) == 2 and "sigmaa0" in problems[0] and "evaluate" in problems[1], problems
    assert _unknown_flags(["eval", "--engine", "vllm"]) == ""  # `...` lines: required flags may be elided
    assert "--sigmaa0" in _unknown_flags(["train", "--sigmaa0", "1"])
    assert "--x" in _unknown_flags(["plot", "dynamics", "--x"]) and "no command" in _unknown_flags(["nope"])
