"""Writing a data file replaces it whole or not at all: a write that fails partway (a full disk, here a file-size
limit) leaves the file as it was, so a run's config.yaml or a plan is never left truncated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from foundation.files import write_file

WRITE_PAST_A_LIMIT = """
import resource, signal, sys
from foundation.files import write_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    write_file({{"rows": ["y" * 50] * 100}}, sys.argv[1])
except OSError as e:
    print(type(e).__name__, e.errno)
"""


@pytest.mark.parametrize("name", ["config.yaml", "plan.json"])
def test_a_write_that_fails_partway_leaves_the_file_as_it_was(tmp_path, name):
    path = tmp_path / name
    write_file({"rows": ["x"] * 10}, path)
    before = path.read_bytes()
    child = WRITE_PAST_A_LIMIT.format(limit=1000)  # the new text is about 5,000 bytes
    done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("OSError 27"), done.stdout + done.stderr  # EFBIG
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no partial file left beside it


def test_a_write_replaces_the_file_and_reads_back(tmp_path):
    from foundation.files import read_file

    path = tmp_path / "a.yaml"
    write_file({"a": 1}, path)
    write_file({"a": 2, "b": "x"}, path)
    assert read_file(path, where="a", error=ValueError, fix="-") == {"a": 2, "b": "x"}
    assert [p.name for p in tmp_path.iterdir()] == ["a.yaml"]


def test_a_write_over_a_symlink_writes_its_target_and_keeps_the_files_permissions(tmp_path):
    """A plan or layout kept elsewhere and linked into a run folder stays linked; a file made private stays so."""
    target = tmp_path / "shared" / "plan.yaml"
    target.parent.mkdir()
    write_file({"a": 1}, target)
    target.chmod(0o600)
    link = tmp_path / "plan.yaml"
    link.symlink_to(target)
    write_file({"a": 2}, link)
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text() == "a: 2\n" and target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["plan.yaml"]
