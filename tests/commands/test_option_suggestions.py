"""A mistyped option is refused first, in one line naming it and the nearest known option (issue 40):
every argparse command (mima.commands.common.OneLineParser), before its required options are checked
and before anything is written; argparse's abbreviations stay accepted."""

from __future__ import annotations

import pytest

from mima.analysis import ANALYSES
from mima.cli import parse
from mima.core.spelling import suggest_option
from mima.core.errors import MimaError
from tests.helpers import assert_one_line, cli

# (command line with the typo, the typo, the option it should suggest); most lack a required option, which
# argparse would otherwise name first
TYPOS = [
    ("merge --methd ties --models RUN", "--methd", "--method"),
    ("merge --method ties --models a b --output OUT --lamb 1", "--lamb", "--lam"),  # an option of the hyperparameter group
    ("merge --methd=ties --models a b --output OUT", "--methd", "--method"),  # --option=value
    ("evaluate RUN --outt OUT", "--outt", "--out"),
    ("evaluate RUN --out OUT --mergse ties", "--mergse", "--merges"),
    ("plan --config CONFIG --trainer.num_ndoes 2", "--trainer.num_ndoes", "--trainer.num_nodes"),
    ("plan --confg CONFIG", "--confg", "--config"),
    ("data check --rot DATA", "--rot", "--root"),
    ("data check --root DATA --benchmarks 8", "--benchmarks", "--benchmark"),  # a mutually exclusive group's option
    ("data cache --config CONFIG --wokers 2", "--wokers", "--workers"),
    ("data splits --config CONFIG --out OUT --data.roots DATA", "--data.roots", "--data.root"),
    ("data prepare --root DATA --archvies ARCHIVES", "--archvies", "--archives"),
    ("report RUN --outt OUT", "--outt", "--out"),
    ("convert --form hf-clip HF --output OUT", "--form", "--from"),
    ("demo --steps 4 --iteratons 1", "--iteratons", "--iterations"),
    ("prefetch --config CONFIG --data.roto DATA", "--data.roto", "--data.root"),
    *[(f"analyze {name} --outt OUT", "--outt", "--out") for name in ANALYSES],
]


@pytest.mark.parametrize("command, typo, suggestion", TYPOS, ids=[command for command, _, _ in TYPOS])
def test_a_typo_is_one_line_naming_the_nearest_option_and_nothing_is_written(command, typo, suggestion, tmp_path,
                                                                               monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # the command's relative paths (and demo's default --out) land here
    words = command.split()
    outcome = cli(words, capfd)
    prog = " ".join(words[:2]) if words[0] in ("data", "analyze") else words[0]
    line = assert_one_line(outcome.code, outcome.err, f"unrecognized option {typo}; did you mean {suggestion}?")
    assert line == f"mima {prog}: error: unrecognized option {typo}; did you mean {suggestion}? (see mima {prog} --help)"
    assert outcome.out == ""
    assert list(tmp_path.iterdir()) == []


def test_an_option_near_none_is_named_without_a_suggestion(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    outcome = cli(["merge", "--method", "ties", "--zzzz", "--models", "a"], capfd)
    line = assert_one_line(outcome.code, outcome.err)
    assert line == "mima merge: error: unrecognized option --zzzz (see mima merge --help)"
    assert list(tmp_path.iterdir()) == []


def test_the_first_unknown_option_is_named():
    with pytest.raises(MimaError, match="unrecognized option --lamb; did you mean --lam"):
        parse("merge", ["--method", "ties", "--models", "a", "b", "--output", "m", "--lamb", "1", "--outptu", "x"])


def test_abbreviations_argparse_accepts_still_parse():
    options = parse("merge", ["--meth", "ties", "--model", "a", "b", "--outp", "m", "--la", "0.5"])
    assert (options.method, tuple(map(str, options.models)), str(options.output), options.hyperparameters["lam"]) == \
        ("ties", ("a", "b"), "m", 0.5)
    evaluate = parse("evaluate", ["RUN", "--ou", "OUT", "--merges=ties", "--no-s"])
    assert (str(evaluate.out), evaluate.merges, evaluate.no_select) == ("OUT", ("ties",), True)
    check = parse("data", ["check", "--ro", "DATA", "--bench", "8"])
    assert (str(check.root), check.benchmark) == ("DATA", "8")


def test_an_ambiguous_abbreviation_keeps_argparses_error():
    with pytest.raises(MimaError, match="ambiguous option: --o could match --out, --overwrite"):
        parse("evaluate", ["RUN", "--o", "OUT"])


def test_values_negative_numbers_and_words_after_a_bare_double_dash_are_not_options():
    options = parse("merge", ["--method", "ties", "--models", "a", "b", "--output", "m", "--lam", "-1.5"])
    assert options.hyperparameters["lam"] == -1.5
    report = parse("report", ["--out", "OUT", "--", "--not-an-option"])
    assert str(report.folder) == "--not-an-option"


def test_help_is_printed_even_beside_a_typo(capsys):
    with pytest.raises(SystemExit) as stop:
        parse("merge", ["--methd", "ties", "--help"])
    assert stop.value.code == 0 and "--method METHOD" in capsys.readouterr().out


def test_suggest_option_names_the_nearest_known_option_or_none():
    known = ["--method", "--models", "--output", "--out", "--overwrite", "--data.root"]
    assert suggest_option("--methd", known) == "--method"
    assert suggest_option("--modles", known) == "--models"
    assert suggest_option("--outptu=x", known) == "--output"  # the part before "="
    assert suggest_option("--data.roto", known) == "--data.root"
    assert suggest_option("--model.iters", ["--model.steps", "--model.iterations"]) == "--model.iterations"
    assert suggest_option("--outptu", ["--out", "--output"]) == "--output"  # both close: the longer shared start
    assert suggest_option("--zzzz", known) is None
    assert suggest_option("--foo", known) is None  # shares only the dashes and an "o" with --out
    assert suggest_option("--method", []) is None


def test_a_subcommands_parser_checks_its_own_options():
    from mima.commands.common import OneLineParser

    parser = OneLineParser(prog="tool")
    parser.add_argument("--verbose", action="store_true")
    sub = parser.add_subparsers(dest="name").add_parser("run")
    sub.add_argument("--steps", type=int)
    parsed = parser.parse_args(["--verbose", "run", "--steps", "3"])  # --steps is the subcommand's, not the tool's
    assert (parsed.verbose, parsed.name, parsed.steps) == (True, "run", 3)
    with pytest.raises(MimaError, match=r"^unrecognized option --stesp; did you mean --steps\? \(see tool run --help\)$"):
        parser.parse_args(["run", "--stesp", "3"])
