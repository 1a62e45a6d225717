"""Docs as written must work: every ``moebit ...`` command in README.md and docs/*.md
(shell code blocks, and inline code spans that start with ``moebit ``) names a real
subcommand and only flags its parser defines.

Each command is handed to the real ``moebit`` entry point with argparse's parsing
intercepted: the command module builds its own parser exactly as it would, the parser is
captured at its first ``parse_args`` and nothing runs. Flags are then matched against
that parser's option strings (exactly: an abbreviation argparse happens to accept is
still a doc bug). Flags after a ``--`` (``moebit bench train ... -- --n-layer 2``,
``moebit plan bench ... -- ...``) are ``moebit train`` flags and are checked against its
parser.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

import moebit.cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_SHELL = ("python", "py", "toml", "json", "jsonl", "yaml", "yml", "jinja", "text", "diff")
SEPARATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
FENCE = re.compile(r"^\s*```+\s*([\w+-]*)")
INLINE = re.compile(r"`(moebit [^`]+)`")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]  # after "moebit"


class Captured(BaseException):  # not an Exception: no command's error handling catches it
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every shell code block, continuations joined."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    pending, start = "", 0
    for i, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if m:
            fence = None if fence is not None else m.group(1).lower()
            pending = ""
            continue
        if fence is None or fence in NOT_SHELL:
            continue
        if not pending:
            start = i
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line.replace("$ ", "", 1) if line.lstrip().startswith("$ ") else line,
                      posix=True, punctuation_chars=";&|<>()")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: prose in a block, not a command
        return []


def _commands(tokens: list[str]) -> list[list[str]]:
    """The ``moebit`` invocations of one shell line (after env settings and wrappers)."""
    out, cur = [], []
    for t in [*tokens, ";"]:
        if t in SEPARATORS:
            while cur and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", cur[0])
                           or cur[0] in ("time", "nohup", "exec", "sudo", "env")):
                cur = cur[1:]
            if cur[:1] in (["python"], ["python3"]) and cur[1:2] == ["-m"] and len(cur) > 2:
                mod = cur[2]
                if mod in ("moebit", "moebit.cli"):
                    cur = ["moebit", *cur[3:]]
                elif mod.startswith("moebit.cli.") and mod.count(".") == 2:
                    cur = ["moebit", mod.rsplit(".", 1)[1], *cur[3:]]
                elif mod.startswith("moebit.bench.") and mod.count(".") == 2:  # = moebit bench X
                    cur = ["moebit", "bench", mod.rsplit(".", 1)[1], *cur[3:]]
            if cur and cur[0] == "moebit":
                out.append(cur[1:])
            cur = []
        else:
            cur.append(t)
    return out


def doc_commands() -> list[Command]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        rel = doc.relative_to(ROOT)
        for n, line in _shell_lines(text):
            for argv in _commands(_tokens(line)):
                found.append(Command(f"{rel}:{n}", tuple(argv)))
        for n, line in enumerate(text.splitlines(), start=1):
            for m in INLINE.finditer(line):
                for argv in _commands(_tokens(m.group(1))):
                    found.append(Command(f"{rel}:{n}", tuple(argv)))
    return found


def capture_parser(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser the real ``moebit ARGV`` builds, caught before it parses anything."""

    def parse(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        raise Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", parse)
        m.setattr(argparse.ArgumentParser, "parse_args", parse)
        try:
            code = moebit.cli.main(list(argv))
        except Captured as c:
            return c.parser
    raise AssertionError(f"moebit {' '.join(argv)} exited {code} before parsing its flags "
                         "(an unknown subcommand?)")


def _flags(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        if a.startswith("-") and len(a) > 1 and not re.fullmatch(r"-[\d.e+-]+", a):
            out.append(a.split("=", 1)[0])
    return out


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


_PARSERS: dict[tuple[str, ...], set[str]] = {}


def options_for(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Option strings of the parser ``argv`` reaches (cached by its subcommand path)."""
    key = tuple(a for a in argv[:2] if not a.startswith("-"))
    if key not in _PARSERS:
        _PARSERS[key] = _options(capture_parser(list(argv), monkeypatch))
    return _PARSERS[key]


COMMANDS = doc_commands()


def test_the_docs_hold_commands():
    subcommands = {c.argv[0] for c in COMMANDS if c.argv}
    assert {"train", "generate", "serve", "export", "plan", "upcycle", "distill"} <= subcommands


def test_every_doc_command_uses_a_real_subcommand_and_real_flags(monkeypatch):
    problems = []
    for c in COMMANDS:
        argv = list(c.argv)
        if not argv or argv[0] in ("-h", "--help") or not re.fullmatch(r"[a-z][a-z0-9-]*", argv[0]):
            continue  # "moebit CLI (cli/)" in a diagram is not an invocation
        if argv[0] not in moebit.cli.COMMANDS:
            problems.append(f"{c.where}: moebit {argv[0]}: no such subcommand")
            continue
        if len(argv) == 1:  # the command named in prose ("`moebit bench`"): nothing to parse
            continue
        head, tail = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
            else (argv, [])
        try:
            known = options_for(head, monkeypatch)
        except AssertionError as e:
            problems.append(f"{c.where}: {e}")
            continue
        bad = [f for f in _flags(head) if f not in known]
        if tail:
            train = options_for(["train"], monkeypatch)
            bad += [f for f in _flags(tail) if f not in train]
        if bad:
            problems.append(f"{c.where}: moebit {' '.join(argv)}: unknown flag(s) {bad}")
    assert not problems, "\n".join(problems)


def test_the_checker_catches_an_unknown_flag_and_subcommand(monkeypatch):
    cmds = _commands(_tokens("OMP_NUM_THREADS=1 moebit plan --model bert-large --errors x | head"))
    assert cmds == [["plan", "--model", "bert-large", "--errors", "x"]]
    assert _commands(_tokens("python -m moebit.cli.plan --papers && python -m moebit.bench.comm"
                             " --ranks 2; python -m moebit.training.loop")) \
        == [["plan", "--papers"], ["bench", "comm", "--ranks", "2"]]
    assert "--errors" not in options_for(cmds[0], monkeypatch)
    assert "--model" in options_for(cmds[0], monkeypatch)
    with pytest.raises(AssertionError, match="before parsing"):
        capture_parser(["nosuch", "--x"], monkeypatch)
    lines = _shell_lines("```bash\nmoebit train \\\n  --steps 3  # note\n```\n```python\nmoebit x\n```")
    assert lines == [(2, "moebit train    --steps 3  # note")]
    assert _commands(_tokens(lines[0][1])) == [["train", "--steps", "3"]]


# inline flags in prose that are not moebit's: a placeholder, and a helper script's own flag
FOREIGN_FLAGS = {"--key-name": "placeholder for any config key's flag",
                 "--bucket-cap-mb": "python -m moebit.bench.ddp_peer's flag (a DDP peer script)"}
INLINE_FLAG = re.compile(r"`(--[a-z][a-z0-9-]*)")


def test_every_flag_named_in_prose_exists(monkeypatch):
    """A flag quoted in prose (`--encoding-errors replace`) is one some moebit parser has."""
    known: set[str] = set()
    for sub in moebit.cli.COMMANDS:
        if sub != "bench":
            known |= options_for([sub, "x"], monkeypatch)
    known |= options_for(["plan", "bench"], monkeypatch)
    known |= options_for(["plan", "memory"], monkeypatch)
    from moebit.cli.bench import BENCHMARKS

    for name in BENCHMARKS:
        known |= options_for(["bench", name, "x"], monkeypatch)
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            bad += [f"{doc.relative_to(ROOT)}:{n}: {m.group(1)}" for m in INLINE_FLAG.finditer(line)
                    if m.group(1) not in known and m.group(1) not in FOREIGN_FLAGS]
    assert not bad, "flags no moebit command has:\n" + "\n".join(bad)


def test_distills_last_line_suggests_a_report_that_works(tmp_path, monkeypatch):
    """`moebit report` reads run folders: a Hugging Face teacher folder is left out."""
    from moebit.cli.distill import compare_command

    hf, run, student = tmp_path / "hf", tmp_path / "teacher", tmp_path / "mos"
    for d in (hf, run, student):
        d.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert compare_command(run, student) == f"moebit report {run} {student}"
    said = compare_command(hf, student)
    assert str(hf) not in said and said.startswith(f"moebit report {student}")
    for part in said.split(";"):
        argv = _commands(_tokens(part))[0]
        assert set(_flags(argv)) <= options_for(argv, monkeypatch)
