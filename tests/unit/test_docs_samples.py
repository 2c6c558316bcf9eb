"""Every ```python block of README.md and docs/*.md runs, and passes its own asserts.

A block runs on one process unless its first line says how many ranks it needs:
`# mpiexec -n 2`, optionally with environment settings first (`# CUPYTP_DEBUG=1 mpiexec -n 2`).
Blocks with the same launch run one after the other in one job (tests/scripts/run_doc_samples.py),
each in a namespace and working directory of its own. Blocks not meant to run are ```bash or
```text.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from launch import REPO, mpiexec, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own jobs")

PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
LAUNCH = re.compile(r"#\s*((?:[A-Z_][A-Z0-9_]*=\S+\s+)*)mpiexec -n (\d+)\s*$")


def launch_of(code):
    """(ranks, {env}) from a block's first line; (1, {}) when it names no launch."""
    first = code.split("\n", 1)[0]
    if "mpiexec" not in first:
        return 1, {}
    match = LAUNCH.fullmatch(first.strip())
    if match is None:
        raise ValueError(f"launch line {first!r} is not of the form '# [VAR=value ...] "
                         "mpiexec -n N'")
    env = dict(item.split("=", 1) for item in match.group(1).split())
    return int(match.group(2)), env


def blocks():
    """[(id, code, ranks, env)] of every python block, id = page:line."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            code = match.group(1)
            ranks, env = launch_of(code)
            found.append((f"{page.relative_to(REPO)}:{line}", code, ranks, env))
    return found


BLOCKS = blocks()
_results = {}


def job_results(launch, tmp_path_factory):
    """{id: result} for every block with `launch` (ranks, env), run once per session."""
    if launch in _results:
        return _results[launch]
    ranks, env = launch[0], dict(launch[1])
    samples = [{"id": id_, "code": code} for id_, code, r, e in BLOCKS
               if (r, tuple(sorted(e.items()))) == launch]
    out = tmp_path_factory.mktemp(f"samples-{ranks}")
    (out / "samples.json").write_text(json.dumps(samples))
    args = ["tests/scripts/run_doc_samples.py", str(out / "samples.json"), str(out)]
    env = {"CUPYTP_TIMEOUT": "60", **env}
    if ranks == 1:
        result = subprocess.run([sys.executable] + args, cwd=REPO, capture_output=True,
                                text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO), **env))
    else:
        result = mpiexec(ranks, args, timeout=600, env=env)
    outcome = {sample["id"]: "" for sample in samples}
    for rank in range(ranks):
        path = out / f"results-{rank}.json"
        if not path.exists():
            raise AssertionError(f"the {ranks}-rank job of doc samples wrote no results for "
                                 f"rank {rank}:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}")
        for row in json.loads(path.read_text()):
            if not row["passed"]:
                outcome[row["id"]] += f"rank {rank}: {row['report']}\n"
    _results[launch] = outcome
    return outcome


def test_pages_have_samples():
    assert any(id_.startswith("README.md") for id_, *_ in BLOCKS)
    assert {id_.split(":")[0] for id_, *_ in BLOCKS} >= {"README.md", "docs/concepts.md"}


@pytest.mark.parametrize("id_, code, ranks, env", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_sample_runs(id_, code, ranks, env, tmp_path_factory):
    failure = job_results((ranks, tuple(sorted(env.items()))), tmp_path_factory)[id_]
    assert not failure, f"{id_} ({ranks} rank(s)) failed:\n{failure}"


def test_launch_lines():
    assert launch_of("import cupytp\n") == (1, {})
    assert launch_of("# mpiexec -n 4\nimport cupytp\n") == (4, {})
    assert launch_of("# CUPYTP_DEBUG=1 mpiexec -n 2\n") == (2, {"CUPYTP_DEBUG": "1"})
    with pytest.raises(ValueError, match="not of the form"):
        launch_of("# mpiexec -np 2\n")
