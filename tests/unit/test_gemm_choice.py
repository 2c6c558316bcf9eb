"""The GEMM algorithm choices: the fastest candidate by its timings, the choices file that later
processes read (merged, rewritten whole, a bad file reported once), and on a GPU a product's
first run timing its candidates, keeping the choice and computing what the twin computes."""
import json
import os
import warnings

import numpy
import pytest

from cupytp import env
from cupytp.backend import asnumpy, bfloat16, on_gpu, xp
from cupytp.launchers import gemm_choice

requires_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU and CuPy")


def test_fastest_takes_the_least_time_and_skips_refused_candidates():
    seconds = {0: 3.0, 1: 1.0, 2: 0.5, 3: 2.0}
    ran = []

    def run(index):
        if index == 2:
            raise RuntimeError("cuBLAS call failed with status 15")
        ran.append(index)

    def timer(fn):
        before = len(ran)
        fn()
        return seconds[ran[-1]] * (len(ran) - before)

    assert gemm_choice.fastest(run, 4, timer) == 1
    # two untimed runs, then TIMED_RUNS timed ones, for every usable candidate
    assert ran.count(0) == ran.count(3) == 2 + gemm_choice.TIMED_RUNS
    assert 2 not in ran


def test_fastest_is_none_when_every_candidate_is_refused():
    def refuse(index):
        raise RuntimeError("no")
    assert gemm_choice.fastest(refuse, 3, lambda fn: 1.0) is None


def test_choices_are_written_whole_and_read_by_a_later_process(tmp_path):
    path = tmp_path / "deep" / "gemm.json"
    first = gemm_choice.Choices(str(path))
    assert first.get("a") is None and not path.exists()
    assert first.add("a", 3) == 3
    assert json.loads(path.read_text()) == {"a": 3}
    assert gemm_choice.Choices(str(path)).get("a") == 3
    assert not [name for name in os.listdir(path.parent) if name.endswith(".tmp")]


def test_a_choice_another_process_wrote_first_is_kept(tmp_path):
    path = str(tmp_path / "gemm.json")
    mine, theirs = gemm_choice.Choices(path), gemm_choice.Choices(path)
    theirs.add("shared", 5)
    theirs.add("theirs", 1)
    assert mine.add("shared", 2) == 5           # the file's choice wins: one choice per key
    mine.add("mine", 0)
    assert json.loads(open(path).read()) == {"shared": 5, "theirs": 1, "mine": 0}


def test_lookup_reads_what_another_process_added_since(tmp_path):
    path = str(tmp_path / "gemm.json")
    mine, theirs = gemm_choice.Choices(path), gemm_choice.Choices(path)
    theirs.add("k", 6)
    assert mine.get("k") is None and mine.lookup("k") == 6 and mine.get("k") == 6
    assert mine.lookup("other") is None


def _add_at_once(path, rank, barrier, results):
    """One of the processes of `test_processes_adding_at_once_keep_every_choice`."""
    choices = gemm_choice.Choices(path)
    barrier.wait()
    for i in range(20):
        choices.add(f"rank{rank}-{i}", i % gemm_choice.CANDIDATES)
        if i == 10:
            kept = choices.add("shared", rank % gemm_choice.CANDIDATES)
    results.put((rank, kept))


def test_processes_adding_at_once_keep_every_choice(tmp_path):
    """Processes adding to one file at once (the ranks of a job timing their products) lose
    none of each other's choices, and each runs the choice of a key that the file keeps: the
    first written."""
    import multiprocessing
    path, ranks = str(tmp_path / "gemm.json"), 6
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(ranks), context.Queue()
    workers = [context.Process(target=_add_at_once, args=(path, rank, barrier, results))
               for rank in range(ranks)]
    for worker in workers:
        worker.start()
    kept = dict(results.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    written = json.loads(open(path).read())
    assert {f"rank{r}-{i}" for r in range(ranks) for i in range(20)} <= set(written)
    assert set(kept.values()) == {written["shared"]}


def test_an_addition_waits_for_the_lock_a_while_then_writes_anyway(tmp_path, monkeypatch):
    import fcntl
    import time
    path = str(tmp_path / "gemm.json")
    monkeypatch.setattr(gemm_choice, "LOCK_WAIT", 0.2)
    holder = os.open(path + ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)              # another process in the middle of adding
    try:
        start = time.monotonic()
        assert gemm_choice.Choices(path).add("a", 2) == 2
        assert time.monotonic() - start >= 0.2
    finally:
        os.close(holder)
    assert json.loads(open(path).read()) == {"a": 2}
    start = time.monotonic()
    gemm_choice.Choices(path).add("b", 1)            # the lock free: no wait
    assert time.monotonic() - start < 0.2


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_bad_file_is_reported_once_and_then_ignored(tmp_path, text):
    path = tmp_path / "gemm.json"
    path.write_text(text)
    with pytest.warns(RuntimeWarning, match="gemm.json.*CUPYTP_GEMM_CACHE"):
        choices = gemm_choice.Choices(str(path))
    assert choices.get("a") is None


def test_entries_out_of_range_are_dropped(tmp_path):
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"ok": 1, "negative": -1, "far": gemm_choice.CANDIDATES,
                                "text": "2"}))
    assert gemm_choice.Choices(str(path)).known == {"ok": 1}


def test_an_unwritable_file_keeps_the_choices_in_the_process(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="cannot read it"):   # its folder is a file
        choices = gemm_choice.Choices(str(blocker / "gemm.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # reported once, not again
        assert choices.add("a", 4) == 4
    assert choices.get("a") == 4
    unwritable = tmp_path / "locked"
    unwritable.mkdir()
    unwritable.chmod(0o500)
    if os.access(unwritable, os.W_OK):                          # root writes anyway
        return
    with pytest.warns(RuntimeWarning, match="cannot write it"):
        gemm_choice.Choices(str(unwritable / "gemm.json")).add("a", 1)


def test_the_variables(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPYTP_GEMM_TUNE", raising=False)
    assert gemm_choice.tuning() is True
    monkeypatch.setenv("CUPYTP_GEMM_TUNE", "0")
    assert gemm_choice.tuning() is False
    monkeypatch.setenv("CUPYTP_GEMM_TUNE", "fast")
    with pytest.raises(env.EnvError, match="CUPYTP_GEMM_TUNE='fast' is not understood: use 1"):
        env.check()
    monkeypatch.delenv("CUPYTP_GEMM_TUNE")
    monkeypatch.setenv("CUPYTP_GEMM_CACHE", str(tmp_path / "x.json"))
    assert gemm_choice.cache_path() == str(tmp_path / "x.json")
    monkeypatch.delenv("CUPYTP_GEMM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gemm_choice.cache_path() == str(tmp_path / "cupytp" / "gemm_algorithms.json")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("tune", ["1", "0"])
def test_a_product_times_its_candidates_once_and_keeps_the_choice(monkeypatch, tmp_path, tune):
    from cupytp.launchers import gemm, gemm_epilogue
    path = tmp_path / "gemm.json"
    monkeypatch.setenv("CUPYTP_GEMM_CACHE", str(path))
    monkeypatch.setenv("CUPYTP_GEMM_TUNE", tune)
    gemm._matmuls.clear()
    gemm_epilogue._plans.clear()
    rng = numpy.random.default_rng(0)
    a, b = (rng.standard_normal(shape).astype(bfloat16) for shape in ((1024, 1024), (1024, 1024)))
    residual = rng.standard_normal((1024, 1024)).astype(numpy.float32)
    first = asnumpy(gemm.matmul(xp.asarray(a), xp.asarray(b)))
    again = asnumpy(gemm.matmul(xp.asarray(a), xp.asarray(b)))
    numpy.testing.assert_array_equal(again, first)          # one algorithm from the first run on
    want = gemm.matmul_numpy(a, b, numpy.float32).astype(numpy.float64)   # values about 32
    numpy.testing.assert_allclose(first.astype(numpy.float64), want, rtol=2 ** -7, atol=0.1)
    # a product adding C (the residual): timing its candidates leaves C as it was
    da = xp.asarray(a)
    x32 = xp.asarray(residual)
    out = gemm_epilogue.matmul_bias(da, xp.asarray(b), None, x32)
    numpy.testing.assert_array_equal(asnumpy(x32), residual)
    numpy.testing.assert_allclose(asnumpy(out).astype(numpy.float64), want + residual,
                                  rtol=1e-5, atol=1e-3)
    if tune == "0":
        assert not path.exists()
        return
    assert not gemm.product(da[:512], xp.asarray(b)).lt.pending    # under TUNED_FROM: untimed
    kept = json.loads(path.read_text())
    assert len(kept) == 2 and all(0 <= i < gemm_choice.CANDIDATES for i in kept.values())
    gemm._matmuls.clear()                                   # a later process: reads, times nothing
    gemm_choice._choices.clear()
    plan = gemm.product(da, xp.asarray(b)).lt
    key = next(key for key in kept if "(1024, 1024, 1024" in key and key.endswith(" None)"))
    assert plan.pending is None and plan.args[8] == plan.candidates[kept[key]]
    # another rank writes its choice after this process read the file: the first run takes it,
    # timing nothing
    gemm._matmuls.clear()
    gemm_choice._choices.clear()
    path.write_text("{}")
    gemm_choice.choices()
    theirs = len(plan.candidates) - 1
    path.write_text(json.dumps({key: theirs}))
    monkeypatch.setattr(gemm_choice, "timed_from_memory", None)     # timing would fail
    db = xp.asarray(b)
    made = gemm.product(da, db)
    plan = made.lt
    assert plan.pending == key
    numpy.testing.assert_allclose(asnumpy(made.run(da.data.ptr, db.data.ptr)).astype(
        numpy.float64), want, rtol=2 ** -7, atol=0.1)
    assert plan.pending is None and plan.args[8] == plan.candidates[theirs]


def test_the_bench_times_a_whole_steps_products():
    """bench/gemm_algorithms.py's products of a GPT-2 step: forward, input and weight gradients
    of every linear map, 6 x tokens x (the blocks' 12 C^2 a layer + the head's C V) flops."""
    import sys
    from launch import REPO
    sys.path.insert(0, str(REPO / "bench"))
    import gemm_algorithms
    tokens, width, _, vocab, layers, _, _ = gemm_algorithms.MODELS["124M"]
    flops = sum(2 * m * k * n * count
                for _, m, k, n, _, _, _, count in gemm_algorithms.products(
                    *gemm_algorithms.MODELS["124M"]))
    assert flops == 6 * tokens * (layers * 12 * width ** 2 + width * vocab)
