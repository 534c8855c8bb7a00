"""Every error is one line of bounded length (issue 41, item 8): a message quoting a huge value (an
--out template that fills to 100,000 characters, a path of thousands) is cut, and says how much was."""

from __future__ import annotations

import yaml

from mima.commands.common import MAX_ERROR_CHARS, capped
from tests.helpers import TWO, assert_one_line, cli, fit_config


def test_an_out_template_that_fills_to_a_huge_name_is_refused_naming_the_template(tmp_path, small_clip, capfd):
    config = fit_config(tmp_path / "unused", small_clip, TWO, steps=4, iterations=1)
    del config["out"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = cli(["fit", "--config", tmp_path / "c.yaml", "--out", tmp_path / "{iterations:>100000}"], capfd)
    line = assert_one_line(result.code, result.err, "{iterations:>100000}: filled in, one folder name is 100000 bytes long")
    assert len(line) < 400
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]


def test_a_huge_path_in_a_message_is_cut_to_a_bounded_line(tmp_path, capfd):
    missing = tmp_path / ("x" * 200) / ("y" * 200) / ("z" * 200) / ("w" * 200) / "m.safetensors"
    result = cli(["merge", "--method", "uniform", "--models", missing, missing.with_name("n.safetensors"),
                  "--output", tmp_path / "out.safetensors"], capfd)
    line = assert_one_line(result.code, result.err)
    assert len(line) <= len("mima merge: error: ") + MAX_ERROR_CHARS


def test_capped_keeps_short_lines_and_cuts_long_ones_saying_how_much():
    assert capped("short") == "short"
    assert capped("two\nlines") == "two lines"
    long = "a" * 5000
    cut = capped(long)
    assert len(cut) <= MAX_ERROR_CHARS
    kept = cut.index(" ... (")
    assert cut.endswith(f"({5000 - kept} more characters left out)") and cut[:kept] == "a" * kept
