"""bench/compare.py pairs cupytp's RESULT lines with PyTorch's ANCHOR lines, and takes the median
round of a side given as several logs."""
import importlib.util

from launch import REPO

spec = importlib.util.spec_from_file_location("compare", REPO / "bench" / "compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def _ours(path, tokens):
    path.write_text(f"warming up\nRESULT cupytp tiny tok/s={tokens} step_ms={256000 / tokens:.2f} "
                    "device_ms=1.00 host_ms=2.00 peak_alloc_GiB=1.50 peak_reserved_GiB=2.00\n")
    return str(path)


def _torch(path, tokens):
    path.write_text(f"ANCHOR torch-eager tok/s={tokens:,} step_ms=10.00 peak_mem_GiB=3.00\n")
    return str(path)


def test_a_side_of_several_rounds_counts_its_median_round(tmp_path, capsys):
    ours = "+".join(_ours(tmp_path / f"o{i}.log", t) for i, t in enumerate((9000, 3000, 6000)))
    theirs = "+".join(_torch(tmp_path / f"t{i}.log", t) for i, t in enumerate((4000, 2000)))
    compare.main([f"tiny={ours},{theirs}"])
    table = capsys.readouterr().out.splitlines()
    row = table[1].split()
    assert row[:2] == ["tiny", "6,000"] and row[7] == "2,000"      # medians: 6000 and 2000
    assert float(row[-2]) == 3.0 and float(row[-1]) == 0.5
    assert "cupytp 3,000 6,000 9,000; torch 2,000 4,000" in table[2]


def test_a_missing_result_names_the_log(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("crashed\n")
    compare.main([f"run={empty},{_torch(tmp_path / 't.log', 1000)}"])
    assert f"no result in {empty}" in capsys.readouterr().out
