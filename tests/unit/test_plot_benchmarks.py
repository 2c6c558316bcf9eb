"""bench/plot_benchmarks.py reads the numbers of docs/benchmarks.md's tables as written, and draws
one picture per kind of ratio table."""
import importlib.util

import pytest

from launch import REPO

spec = importlib.util.spec_from_file_location("plot_benchmarks",
                                              REPO / "bench" / "plot_benchmarks.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)

PAGE = """# Title

## Collectives (2 ranks)

| op | size | latency × | bandwidth % |
|---|---|---|---|
| all_reduce | 1 MiB | 1.26 | 79.1 |
| all_gather | 2 MiB (1 MiB per rank) | 1.00 | 100.4 |

text between

| B,H,T,D | mask | dropout | flash vs torch flash |
|---|---|---|---|
| 8,12,1024,64 | causal | 0.1 | 0.41×, 0.57× |
"""


def test_tables_are_parsed_as_written():
    found = plot.tables(PAGE)
    assert [(heading, header) for heading, header, _ in found] == [
        ("Collectives (2 ranks)", ["op", "size", "latency ×", "bandwidth %"]),
        ("Collectives (2 ranks)", ["B,H,T,D", "mask", "dropout", "flash vs torch flash"])]
    _, header, rows = found[0]
    assert plot.column(header, rows, "latency ×") == ["1.26", "1.00"]
    assert [plot.mebibytes(s) for s in plot.column(header, rows, "size")] == [1.0, 2.0]
    assert plot.numbers(found[1][2][0][3]) == [0.41, 0.57]
    assert plot.numbers("—") == [] and plot.mebibytes("4 GiB") == 4096.0


def test_the_benchmarks_page_has_every_kind_of_ratio_table():
    found = plot.tables((REPO / "docs" / "benchmarks.md").read_text())
    assert len(plot.with_columns(found, "latency ×", "bandwidth %")) >= 2
    assert plot.with_columns(found, "speed ×", "memory ×")
    assert plot.with_columns(found, "flash vs torch flash")


def test_draws_the_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    drawn = plot.main(REPO / "docs" / "benchmarks.md", tmp_path)
    assert sorted(p.name for p in drawn) == ["attention.png", "collectives.png",
                                             "training_vs_pytorch.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in drawn)
