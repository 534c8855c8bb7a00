"""Every `mima ...` command line of the documentation parses with today's command line (nothing runs):
a renamed or removed option in an example fails here.

The lines come from README.md and docs/**/*.md, from fenced code blocks and from inline code spans.
How the documentation writes commands, and so how this test reads them:
- A command starts at the word `mima` (or `.venv/bin/mima`, `python -m mima`, after `srun ...`,
  `VAR=value`) and ends at the end of the line, at a `#` comment, or at a shell `&&`, `||`, `;`, `|`,
  `>`; a line ending in `\\` goes on on the next one.
- Placeholders stay words: RUN_DIR, FILE, $task, fb/$task.safetensors are paths to a parser (which
  opens no file); `<your config>` is one word; `[--merges ...]` is optional: the brackets are dropped
  and its words kept; `...` is words left out: after an option it is that option's value (a
  placeholder word), elsewhere it is dropped; `a|b` (a bar between words, no spaces) is
  alternation, and each alternative is checked.
- `mima fit` reads its --config files while it parses: a --config that is not a file of the repository
  (my.yaml, runs/x/config.yaml) stands for the reader's own config, and configs/demo.yaml stands in.
- A line of a fenced block is a complete command: it must parse. An inline span may be a reference
  (`mima merge --config`, `mima evaluate --skip-unfinished`): what it writes must parse, but it may
  leave out required arguments and the value of its last option. A span that names only a command
  (`mima fit`, `mima data check`) must name one that exists.
- Each option must be written as the command spells it (argparse would also take an abbreviation
  such as --bench for --benchmark; the documentation does not).
- Not commands: program output quoted in the text (`mima merge: ties (...) -> m.safetensors`, the
  command word ending in ':'), and the lines in SKIPPED, each with its reason.
All non-fit lines parse in this process (the parsers import nothing heavy); the fit lines in one
subprocess (LightningCLI's parser imports Lightning and seeds the random generators).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from mima.analysis import ANALYSES
from mima.cli import COMMANDS, DATA_COMMANDS, parse
from mima.commands import names
from mima.core.errors import MimaError

REPO = Path(__file__).resolve().parents[2]
FIT_STAND_IN_CONFIG = "configs/demo.yaml"
# text of a line or span -> why it is not checked (each must still be found, so that none goes stale)
SKIPPED: dict[str, str] = {}
# the commands whose first argument names a subcommand (`mima data check`, `mima analyze cosine`)
WITH_SUBCOMMANDS = frozenset(command.name for command in COMMANDS if command.subcommands)

# commands that run the command after them (with options of their own)
_LAUNCHERS = {"srun", "python", "python3", "time", "nice", "exec", "do", "then", "env"}
_SHELL_BREAKS = {"&&", "||", ";", "|", ">", ">>", ">&", "&>", "<", "&", ";;"}
_OPTION = r"--?[A-Za-z][\w.-]*"
_ALTERNATIVE = "\x00"  # stands for a bar between two words while the shell syntax is split


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    text: str  # the command as written, from `mima` on
    words: tuple[str, ...]  # the words after `mima`, conventions applied
    complete: bool  # a line of a fenced block (an inline span may be a fragment)


def documentation_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _code_pieces(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, fenced) for every logical line of a fenced block and every inline code span
    (which may run over a line break)."""
    pieces: list[tuple[int, str, bool]] = []
    prose: list[tuple[int, str]] = []  # the lines outside fenced blocks
    fence: str | None = None
    pending, pending_line = "", 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        marker = re.match(r"\s*(```|~~~)", line)
        if marker and (fence is None or marker.group(1) == fence):
            fence = marker.group(1) if fence is None else None
            if pending:  # a block's last line ended in a backslash
                pieces.append((pending_line, pending, True))
                pending = ""
            prose.append((number, ""))
            continue
        if fence is None:
            prose.append((number, line))
            continue
        if not pending:
            pending_line = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pieces.append((pending_line, pending + line, True))
        pending = ""
    # a code span may run over a line break, not over a blank line (the end of a paragraph)
    for _, paragraph in itertools.groupby(prose, key=lambda numbered: bool(numbered[1].strip())):
        lines = list(paragraph)
        text = "\n".join(line for _, line in lines)
        for span in re.finditer(r"`([^`]+)`", text):
            line = lines[text.count("\n", 0, span.start())][0]
            pieces.append((line, " ".join(span.group(1).split()), False))
    return sorted(pieces)


def _words(text: str, fenced: bool) -> list[list[str]]:
    """The shell words of `text`, split at the shell's command separators (comments dropped)."""
    text = re.sub(r"<([^<>]+)>", lambda m: m.group(1).replace(" ", "_"), text)  # <your config> -> your_config
    text = re.sub(r"(?<=[^\s|])\|(?=[^\s|])", _ALTERNATIVE, text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#" if fenced else ""
    segments: list[list[str]] = [[]]
    for word in lexer:
        if word in _SHELL_BREAKS:
            segments.append([])
        else:
            segments[-1].append(word)
    return segments


def _mima_words(segment: list[str]) -> list[str] | None:
    """The words after `mima` when the segment runs mima (possibly through a launcher), else None."""
    for index, word in enumerate(segment):
        if word == "mima" or word.endswith("/mima"):
            before = [w for w in segment[:index] if not re.fullmatch(r"\w+=\S*", w)]  # VAR=value words
            launched = not before or before[0] in _LAUNCHERS or before[0].endswith(("/python", "/python3"))
            return segment[index + 1:] if launched else None
    return None


def _applied_conventions(words: list[str]) -> list[list[str]]:
    """The words with brackets dropped, and `...` unless it stands for an option's value; one list per
    choice of the alternations."""
    unbracketed = [w.replace("[", "").replace("]", "") for w in words]
    kept = [w for i, w in enumerate(unbracketed) if w and (w != "..." or (i and unbracketed[i - 1].startswith("-")))]
    choices = [w.split(_ALTERNATIVE) for w in kept]
    return [list(choice) for choice in itertools.product(*choices)]


def examples_in(path: Path, name: str) -> list[Example]:
    found: list[Example] = []
    for line, text, fenced in _code_pieces(path):
        if text.strip() in SKIPPED or not re.search(r"(^|[\s/])mima(\s|$)", text):
            continue
        for segment in _words(text, fenced):
            words = _mima_words(segment)
            if words is None or (words and words[0].endswith(":")):  # not mima, or its output
                continue
            written = "mima " + " ".join(words).replace(_ALTERNATIVE, "|")
            found += [Example(f"{name}:{line}", written, tuple(choice), fenced) for choice in _applied_conventions(words)]
    return found


def examples() -> list[Example]:
    return [example for path in documentation_files() for example in examples_in(path, str(path.relative_to(REPO)))]


# ------------------------------------------------------------------------------- checks
def _command_of(words: tuple[str, ...]) -> tuple[str, list[str], str | None]:
    """(command, its arguments, a problem with the names of command and subcommand or None)."""
    if not words:
        return "", [], None
    command, rest = words[0], list(words[1:])
    if command not in names(COMMANDS):
        return command, rest, f"unknown command '{command}'"
    if command in WITH_SUBCOMMANDS and rest and not rest[0].startswith("-"):
        known = names(DATA_COMMANDS) if command == "data" else ANALYSES
        if rest[0] not in known:
            return command, rest, f"unknown {command} subcommand '{rest[0]}'"
    return command, rest, None


def _is_reference(command: str, rest: list[str]) -> bool:
    """Only a command's (and subcommand's) name: nothing to parse."""
    return not rest or (command in WITH_SUBCOMMANDS and len(rest) == 1 and not rest[0].startswith("-"))


def _options_written(rest: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in rest if re.fullmatch(rf"{_OPTION}(=.*)?", word)]


def listed_options(help_text: str) -> frozenset[str]:
    """The options a --help lists: the option strings that start its lines (`  -o, --output OUTPUT  ...`)."""
    options: set[str] = set()
    for line in help_text.splitlines():
        if re.match(r" {1,4}-", line):  # not a wrapped description line (indented far)
            head = re.split(r"\s{2,}", line.strip())[0]  # the option strings, before the description
            options.update(re.findall(rf"(?<![\w.-]){_OPTION}", head))
    return frozenset(options)


@cache
def _help_options(command: str, subcommand: str | None) -> frozenset[str]:
    """The options the (sub)command's --help lists."""
    argv = [subcommand, "--help"] if subcommand else ["--help"]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        parse(command, argv)
    return listed_options(shown.getvalue())


def _fragment_error(message: str, rest: list[str]) -> bool:
    """A parse error that only says an inline span left out what a full command needs."""
    if "the following arguments are required" in message:
        return True
    return bool(re.search(r"expected (one|at least one|\d+) arguments?", message)) and rest[-1].startswith("-")


def _spelling_problem(options: list[str], known: frozenset[str]) -> str | None:
    unknown = [option for option in options if option not in known]
    return f"{unknown[0]}: not an option as spelled (abbreviated or renamed?)" if unknown else None


def problem_of(example: Example) -> str | None:
    """One line saying what is wrong with a non-fit example, or None."""
    command, rest, problem = _command_of(example.words)
    if problem is not None or _is_reference(command, rest):
        return problem
    subcommand = rest[0] if command in WITH_SUBCOMMANDS and not rest[0].startswith("-") else None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            parse(command, rest)
    except MimaError as error:
        if example.complete or not _fragment_error(str(error), rest):
            return str(error)
    except SystemExit as stop:  # --help in an example
        if stop.code not in (0, None):
            return f"exit status {stop.code}"
    return _spelling_problem(_options_written(rest[1:] if subcommand else rest), _help_options(command, subcommand))


def _report(checked: list[tuple[Example, str]]) -> list[str]:
    return [f"{example.where}: `{example.text}`: {problem}" for example, problem in checked]


def test_the_documentation_shows_every_command():
    found = examples()
    fenced = {ex.words[0] for ex in found if ex.complete and ex.words}
    assert {"fit", "prefetch", "merge", "convert", "data", "analyze", "report"} <= fenced
    assert {"demo", "evaluate"} <= {ex.words[0] for ex in found if ex.words}
    assert len([ex for ex in found if ex.complete]) >= 25
    texts = {text.strip() for path in documentation_files() for _, text, _ in _code_pieces(path)}
    assert set(SKIPPED) <= texts, "a skipped line is no longer in the documentation: remove it from SKIPPED"


def test_the_conventions_read_commands_as_the_docstring_says(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `mima analyze cosine|ctl RUN_DIR` or `mima evaluate RUN_DIR [RUN_DIR ...] --out DIR\n"
        "[--merges ...]`, and `mima prefetch --config <your config>`; `mima merge: ties -> m.safetensors` is output.\n"
        "\n"
        "```bash\n"
        "cd x && srun --ntasks 2 .venv/bin/mima merge --method ties \\\n"
        "    --models a b --output m.safetensors   # a comment, --not-an-option\n"
        "pip install mima\n"
        "```\n"
    )
    read = [(ex.where, ex.words, ex.complete) for ex in examples_in(page, "page.md")]
    assert read == [
        ("page.md:1", ("analyze", "cosine", "RUN_DIR"), False),
        ("page.md:1", ("analyze", "ctl", "RUN_DIR"), False),
        ("page.md:1", ("evaluate", "RUN_DIR", "RUN_DIR", "--out", "DIR", "--merges", "..."), False),
        ("page.md:2", ("prefetch", "--config", "your_config"), False),
        ("page.md:5", ("merge", "--method", "ties", "--models", "a", "b", "--output", "m.safetensors"), True),
    ]


def test_every_documented_command_parses():
    checked = [(ex, problem_of(ex)) for ex in examples() if not ex.words or ex.words[0] != "fit"]
    assert len(checked) > 50
    assert _report([(ex, problem) for ex, problem in checked if problem]) == []


def test_a_renamed_or_abbreviated_option_in_an_example_fails():
    example = next(ex for ex in examples() if ex.text == "mima data check --root /data/clip --benchmark 8 --download")
    assert example.where.startswith("docs/data.md:") and problem_of(example) is None

    renamed = Example(example.where, "", tuple(w.replace("--benchmark", "--benchmarks") for w in example.words), True)
    problem = problem_of(renamed)
    assert problem == "unrecognized option --benchmarks; did you mean --benchmark? (see mima data check --help)"
    abbreviated = Example(example.where, "", tuple(w.replace("--benchmark", "--bench") for w in example.words), True)
    assert problem_of(abbreviated) == "--bench: not an option as spelled (abbreviated or renamed?)"
    removed = Example(example.where, "", (*example.words, "--tasks", "Cars"), True)  # --tasks excludes --benchmark
    assert problem_of(removed) == ("argument --tasks: not allowed with argument --benchmark (see mima data check --help)")


# ------------------------------------------------------------------------------------ fit
_FIT_PARSER = """
import contextlib, io, json, sys
from mima.cli import parse
from mima.core.errors import MimaError

results = []
for argv in json.loads(sys.stdin.read()):
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            parse("fit", argv)
        results.append(None)
    except MimaError as error:
        results.append(str(error))
    except SystemExit as stop:  # --help, --print_config
        results.append(None if stop.code in (0, None) else f"exit status {stop.code}")
shown = io.StringIO()
with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
    parse("fit", ["--help"])
print(json.dumps({"results": results, "help": shown.getvalue()}))
"""


def _with_stand_in_config(rest: list[str]) -> list[str]:
    """fit's arguments with each --config that is not a file of the repository replaced by the stand-in."""
    words = list(rest)
    for index, word in enumerate(words):
        if word == "--config" and index + 1 < len(words) and not (REPO / words[index + 1]).is_file():
            words[index + 1] = FIT_STAND_IN_CONFIG
        elif word.startswith("--config=") and not (REPO / word.split("=", 1)[1]).is_file():
            words[index] = f"--config={FIT_STAND_IN_CONFIG}"
    return words


def test_every_documented_fit_command_parses():
    fits = [ex for ex in examples() if ex.words and ex.words[0] == "fit" and len(ex.words) > 1]
    assert len(fits) >= 6
    # the proof that a renamed option fails: a real example with one of its options renamed, and abbreviated
    # (jsonargparse, as argparse, takes --model.iteration for --model.iterations)
    real = next(ex for ex in fits if ex.text == "mima fit --config configs/demo.yaml --model.iterations 8 --out runs/n8")
    renamed, abbreviated = (Example(real.where, "", tuple(w.replace("--model.iterations", other) for w in real.words), True)
                            for other in ("--model.iters", "--model.iteration"))
    tried = (*fits, real, renamed, abbreviated)
    arguments = [_with_stand_in_config(list(ex.words[1:])) for ex in tried]
    result = subprocess.run([sys.executable, "-c", _FIT_PARSER], input=json.dumps(arguments), capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.splitlines()[-1])
    known = listed_options(answer["help"])
    assert "--model.iterations" in known and "--trainer.devices" in known

    def problem(example: Example, words: list[str], error: str | None) -> str | None:
        if error is not None and (example.complete or not _fragment_error(error, words)):
            return error
        return _spelling_problem(_options_written(words), known)

    checked = [problem(ex, words, error) for ex, words, error in zip(tried, arguments, answer["results"])]
    *documented, real_problem, renamed_problem, abbreviated_problem = checked
    assert _report([(ex, found) for ex, found in zip(fits, documented) if found]) == []
    assert real_problem is None
    assert renamed_problem == "config: unrecognized arguments: --model.iters 8; did you mean --model.iterations?"
    assert abbreviated_problem == "--model.iteration: not an option as spelled (abbreviated or renamed?)"
