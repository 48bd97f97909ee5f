"""How the bitwise tests pick their reference (tests/pinned_reference.py), without running one."""

import subprocess

import pinned_reference
import pytest
from pinned_reference import Unavailable, reference_for

FILE, PINNED_BITS, OTHER = ["0x1p+0", "0x1p-1"], ["0x1p+0", "0x1p-1"], ["0x1p+0", "0x1.8p-1"]


def _never():
    raise AssertionError("the pinned commit was run where the file decides")


def test_the_file_decides_when_the_run_equals_it():
    assert reference_for(FILE, FILE, _never, "f.json") == (FILE, "f.json")


def test_no_file_means_the_pinned_commit_run_here():
    want, source = reference_for(OTHER, None, lambda: PINNED_BITS, "f.json")
    assert want == PINNED_BITS and "pinned commit" in source and "no entry" in source


def test_a_changed_bit_is_judged_by_the_file_when_the_pinned_commit_agrees_with_it():
    want, source = reference_for(OTHER, FILE, lambda: list(FILE), "f.json")
    assert want == FILE and want != OTHER and source.startswith("f.json")


def test_a_file_of_another_machine_under_the_same_key_gives_way_to_the_pinned_commit_with_a_warning():
    with pytest.warns(UserWarning, match="does not separate"):
        want, source = reference_for(PINNED_BITS, OTHER, lambda: PINNED_BITS, "f.json")
    assert want == PINNED_BITS and "another machine" in source


def test_no_history_holding_the_pinned_commit_is_unavailable_with_the_reason(tmp_path, monkeypatch):
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    monkeypatch.setattr(pinned_reference, "ROOT", tmp_path / "repo")
    with pytest.raises(Unavailable, match="no history holding the pinned commit"):
        pinned_reference.build(tmp_path / "cache")
