"""bench/plot_benchmarks.py reads the numbers of docs/benchmarks.md's tables as written, and draws
one picture per kind of ratio table; it reads bench/long_context.py's logs per model and series
(tests/unit/test_long_context_bench.py feeds it a real run's), and draws their peaks."""
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


LONG_LOGS = """attention: flash RawKernel
RESULT cupytp long-context 124M dtype=bf16 dp=1 cp=1 tp=1 sp=0 recompute=1 B=1 T=16384 \
tok/s=90000 step_ms=182.0 peak_alloc_GiB=6.50 state_GiB=1.90 act_KiB_per_token=294.4
RESULT cupytp long-context 124M dtype=bf16 dp=1 cp=1 tp=1 sp=0 recompute=1 B=1 T=32768 \
tok/s=60000 step_ms=546.1 peak_alloc_GiB=11.25 state_GiB=1.90 act_KiB_per_token=299.2
SLOPE cupytp T=16384..32768 act_KiB_per_token=304.0 (peak growth per token)
ANCHOR torch-eager world=1 dtype=bf16 L=12 C=768 B=1 T=16384 dropout=0.0 bias=1 params=124.4M \
step_ms=150.0 tok/s=109,226 TFLOP/s/gpu=50.0 peak_mem_GiB=14.10 loss=11.000
PEAK 124M T=16384 cupytp_GiB=6.50 torch_GiB=14.10 ratio=0.46 (cupytp / torch)
ANCHOR torch T=32768: none (torch.OutOfMemoryError: CUDA out of memory.)
RESULT cupytp long-context 124M dtype=bf16 dp=1 cp=1 tp=1 sp=0 recompute=0 B=1 T=16384 \
tok/s=120000 step_ms=136.5 peak_alloc_GiB=20.00 state_GiB=1.90 act_KiB_per_token=1186.0
RESULT cupytp long-context 124M dtype=bf16 dp=1 cp=1 tp=1 sp=0 recompute=0 B=1 T=32768 OOM (out \
of memory)
RESULT cupytp long-context llama-1B dtype=bf16 dp=1 cp=2 tp=1 sp=0 recompute=1 B=1 T=16384 \
tok/s=9000 step_ms=1820.4 peak_alloc_GiB=30.00 state_GiB=18.60 act_KiB_per_token=1459.2
ANCHOR torch-llama-eager L=16 D=2048 H=32 KV=8 F=8192 V=128256 B=1 T=16384 params=1235.8M \
step_ms=1000.0 tok/s=16,384 TFLOP/s=200.0 peak_mem_GiB=55.00 peak_reserved_GiB=60.00 loss=12.000
RESULT cupytp long-context gpt2-124M dtype=bf16 dp=1 cp=2 tp=1 sp=0 recompute=1 fsdp=1 B=1 \
T=65536 tok/s=110743 step_ms=591.8 peak_alloc_GiB=9.09 state_GiB=1.16 act_KiB_per_token=253.7
"""


def test_long_context_logs_are_parsed_per_model_and_series():
    runs = plot.long_context_runs(LONG_LOGS)
    assert runs == {
        "124M": {"cupytp, recompute": {16384: (6.5, 90000), 32768: (11.25, 60000)},
                 plot.PYTORCH: {16384: (14.1, 109226), 32768: None},
                 "cupytp": {16384: (20.0, 120000), 32768: None}},
        "llama-1B": {"cupytp, cp=2, recompute": {16384: (30.0, 9000)},
                     plot.PYTORCH: {16384: (55.0, 16384)}},
        "gpt2-124M": {"cupytp, cp=2, recompute, fsdp": {65536: (9.09, 110743)}}}


def test_draws_the_long_context_picture(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "long.log"
    log.write_text(LONG_LOGS)
    drawn = plot.main_long([str(log), "--out", str(tmp_path / "long.png")])
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.log"
    empty.write_text("crashed\n")
    with pytest.raises(SystemExit):
        plot.main_long([str(empty)])


def test_tick_labels_too_close_on_a_log_axis_are_dropped():
    assert plot.spaced([262144, 65536, 98304, 114688, 122880, 212992]) == \
        [65536, 98304, 122880, 212992]
    assert plot.spaced([4096, 8192, 16384]) == [4096, 8192, 16384]
