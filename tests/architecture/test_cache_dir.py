"""The cache folder's fallback is stated once (mima.core.cache_dir); the documentation that repeats it
in words (option docstrings, `mima data cache --help`) says the same."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from mima.cli import main
from mima.config.model import ModelSettings
from mima.core.cache_dir import (CACHE_DIR_FALLBACK, CACHE_DIR_VARIABLE, DATA_CACHE_FOLDER, cache_dir_or_default, default_cache_dir,
                                 default_data_cache_dir)
from mima.data.settings import DataSettings


def test_the_cache_folder_is_the_variable_or_the_home_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MIMA_CACHE_DIR", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "mima"
    assert default_data_cache_dir() == tmp_path / "home" / ".cache" / "mima" / "data"
    monkeypatch.setenv("MIMA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    assert default_data_cache_dir() == tmp_path / "elsewhere" / "data"


def test_a_configured_cache_dir_wins_and_none_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "elsewhere"))
    assert cache_dir_or_default(str(tmp_path / "given")) == tmp_path / "given"
    assert cache_dir_or_default(None) == cache_dir_or_default("") == tmp_path / "elsewhere"


def test_the_documentation_states_the_same_fallback(monkeypatch):
    variable, data = f"${CACHE_DIR_VARIABLE}", f"{CACHE_DIR_FALLBACK}/{DATA_CACHE_FOLDER}"
    assert f"(default {variable}\n            or {CACHE_DIR_FALLBACK})" in ModelSettings.__doc__
    assert f"(default {variable}/{DATA_CACHE_FOLDER} or {data})" in DataSettings.__doc__
    monkeypatch.setenv("COLUMNS", "1000")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["data", "cache", "--help"])
    assert f"(default {variable}/{DATA_CACHE_FOLDER})" in out.getvalue()
    assert Path(CACHE_DIR_FALLBACK).parts == ("~", ".cache", "mima")
