"""CLI errors: one line and exit 2, the traceback only with `--debug` or MHLA_DEBUG=1."""

from __future__ import annotations

import pytest

from mhla_diffusion.cli.main import main


def test_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "missing")
    assert main(["info", missing]) == 2
    assert capsys.readouterr().err == f"mhla-diffusion info: error: {missing} does not exist\n"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["--debug", "info", missing])
    monkeypatch.setenv("MHLA_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["info", missing])


def test_only_rank_0_prints_the_error(tmp_path, capsys, monkeypatch):
    """Under `accelerate launch` every process meets the same bad input; one line, not one per process."""
    monkeypatch.setenv("RANK", "1")
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == ""
