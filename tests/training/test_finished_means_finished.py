"""Finished means finished (issue 41, item 1): `mima fit` exits 0 only when every process took its
planned steps. Trainer options that cut the run short are refused up front (tests/config/test_config_validation.py,
the cut_short_* cases); anything else that ends training early without a stop request (here a user's
early-stopping callback) ends the command non-zero, naming the step, and the run resumes to its end."""

from __future__ import annotations

from tests.helpers import STEPS, TWO, assert_one_line, cli, write_config


def test_training_ended_early_without_a_stop_request_is_not_reported_as_finished(tmp_path, small_clip, capfd):
    early = write_config(tmp_path / "early.yaml", small_clip, TWO, 1, [("ShouldStopAtStep", {"step": 3})])
    out = tmp_path / "run"
    result = cli(["fit", "--config", early, "--out", out], capfd)
    planned = STEPS * len(TWO)  # one process trains both tasks
    assert_one_line(result.code, result.err, f"{out}: training ended at process step 3 of {planned} on process 0",
                    "the run is unfinished", "final/ lacks rot90, mirror", "--ckpt_path last")
    assert "finished in" not in result.out
    assert not list((out / "final").glob("*.safetensors"))
    # the same run without the early stop resumes and finishes: then, and only then, exit 0 and final/ whole
    plain = write_config(tmp_path / "plain.yaml", small_clip, TWO, 1)
    resumed = cli(["fit", "--config", plain, "--out", out, "--ckpt_path", "last"], capfd)
    assert resumed.code == 0, resumed.err
    assert "finished in" in resumed.out
    assert sorted(p.stem for p in (out / "final").glob("*.safetensors")) == sorted(TWO)
