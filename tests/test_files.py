"""saturate.files: the one rule for writing a file (never through a link) and for reading a
user's file (never waiting on a FIFO)."""

from __future__ import annotations

import os

import pytest

from saturate import files


def test_a_whole_file_replaces_a_link_in_its_place_and_leaves_its_target_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.md").symlink_to(victim)
    files.write_text(tmp_path / "run" / "report.md", "the report")
    assert victim.read_text() == "precious" and not (tmp_path / "run" / "report.md").is_symlink()
    assert (tmp_path / "run" / "report.md").read_text() == "the report"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["report.md"]  # no temporary file left


def test_files_are_made_with_the_users_umask(tmp_path):
    previous = os.umask(0o002)
    try:
        files.write_text(tmp_path / "shared.json", "{}")
        with files.open_growing(tmp_path / "metrics.csv") as f:
            f.write("step\n")
        made = files.fresh(tmp_path / "model.safetensors")  # a library's writer fills it, then it is renamed
        again = files.fresh(tmp_path / "val.npz", suffix=".npz")
    finally:
        os.umask(previous)
    assert (tmp_path / "shared.json").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "metrics.csv").stat().st_mode & 0o777 == 0o664
    assert made.stat().st_mode & 0o777 == 0o664 and made.parent == tmp_path and made.name.startswith(".")
    assert again.name.endswith(".npz") and again != made


def test_a_growing_file_refuses_a_link_in_its_place(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "metrics.csv").symlink_to(victim)
    with pytest.raises(OSError):
        files.open_growing(tmp_path / "metrics.csv", "a")
    assert victim.read_text() == "precious"


def test_a_fifo_or_a_folder_is_refused_at_once_naming_the_key(tmp_path):
    os.mkfifo(tmp_path / "weights.pt")
    with pytest.raises(files.NotAFile, match=r"pretrained.path=.*weights.pt: expected a regular file; this is a FIFO"):
        files.open_regular(tmp_path / "weights.pt", "pretrained.path")  # no writer: a blocking open would wait forever
    with pytest.raises(files.NotAFile, match="this is a folder"):
        files.open_regular(tmp_path, "trainer.resume")
    (tmp_path / "w.pt").write_bytes(b"data")
    with files.open_regular(tmp_path / "w.pt", "pretrained.path") as f:
        assert f.read() == b"data"
