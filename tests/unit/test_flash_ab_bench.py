"""bench/flash_ab.py exports a revision's kernels and flash launcher into a new folder (never
over an existing one), its comparison refuses, with one error before any work, a folder that
holds no export, and its summary takes each variant's best round. The timings themselves need a
GPU (docs/benchmarks.md)."""
import subprocess
import sys

import pytest

from launch import REPO, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own processes")
SCRIPT = str(REPO / "bench" / "flash_ab.py")
sys.path.insert(0, str(REPO / "bench"))
from flash_ab import summary  # noqa: E402


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                          text=True, cwd=REPO)


def git(*args):
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


@pytest.mark.skipif(git("rev-parse", "HEAD").returncode != 0, reason="needs the git history")
def test_export_writes_the_revision_and_never_overwrites(tmp_path):
    folder = tmp_path / "export"
    done = run("--export", "HEAD", folder)
    assert done.returncode == 0, done.stderr
    head = git("rev-parse", "HEAD").stdout.strip()
    assert (folder / "REVISION").read_text() == head + "\n"
    shown = git("show", "HEAD:kernels/flash_attention.cu").stdout
    assert (folder / "kernels" / "flash_attention.cu").read_text() == shown
    assert (folder / "flash_attention.py").read_text() == \
        git("show", "HEAD:cupytp/launchers/flash_attention.py").stdout
    again = run("--export", "HEAD", folder)
    assert again.returncode == 2 and "exists" in again.stderr
    assert (folder / "REVISION").read_text() == head + "\n"


def test_comparison_refuses_a_folder_without_an_export(tmp_path):
    (tmp_path / "one").mkdir()
    done = run("--against", tmp_path / "one")
    assert done.returncode == 2
    assert f"{tmp_path / 'one'} holds no export" in done.stderr


def test_summary_takes_each_variant_best_round_against_the_tree():
    shape, other = (8, 12, 1024, 64, True, 0.1), (64, 6, 256, 64, True, 0.2)
    results = {(shape, "tree"): [(0.15, 0.45), (0.13, 0.40)],
               (shape, "f:abc"): [(0.12, 0.50), (0.10, 0.32)],
               (other, "tree"): [(0.07, 0.22)]}
    lines = summary(results)
    assert lines[0] == str(shape) and lines[3] == str(other)
    assert lines[1].split() == ["tree", "fwd", "0.130", "fwd+bwd", "0.400"]
    assert lines[2].split() == ["f:abc", "fwd", "0.100", "fwd+bwd", "0.320", "1.250x", "as",
                                "fast", "as", "the", "tree"]
