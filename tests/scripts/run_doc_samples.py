"""Run documentation samples in one job: `python run_doc_samples.py SAMPLES.json OUT_DIR`
(under mpiexec for samples that need ranks).

SAMPLES.json is a list of {"id": "docs/page.md:12", "code": "..."}, the id naming the page and
the line of the block's opening fence (tracebacks give the page's own line numbers). Each sample
runs in a namespace of its own, as `__main__`, with OUT_DIR/<index> as the working directory
(the same directory on every rank). Each rank writes OUT_DIR/results-<rank>.json: per sample its id,
whether it passed, and its traceback and printed output otherwise. After each sample the ranks
compare their outcomes; once a sample fails on any rank, the later ones are not run (the ranks
would no longer agree on which collectives come next).
"""
import contextlib
import io
import json
import os
import sys
import traceback

import cupytp
from cupytp.distributed import all_gather_object


def run(sample, workdir):
    """(passed, report) of one sample run in `workdir`."""
    os.makedirs(workdir, exist_ok=True)
    printed = io.StringIO()
    home = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(printed):
            page, line = sample["id"].rsplit(":", 1)
            code = "\n" * int(line) + sample["code"]
            exec(compile(code, page, "exec"), {"__name__": "__main__"})
        return True, ""
    except BaseException:          # noqa: BLE001 - a sample's SystemExit is a failure too
        return False, f"{traceback.format_exc()}\nprinted:\n{printed.getvalue()}"
    finally:
        os.chdir(home)


def main(samples_path, out):
    with open(samples_path) as f:
        samples = json.load(f)
    info = cupytp.init()
    results = []
    for index, sample in enumerate(samples):
        passed, report = run(sample, os.path.join(out, str(index)))
        results.append({"id": sample["id"], "passed": passed, "report": report})
        if not all(all_gather_object(passed)):
            break
    for sample in samples[len(results):]:
        results.append({"id": sample["id"], "passed": False,
                        "report": "not run: an earlier sample failed in the same job"})
    with open(os.path.join(out, f"results-{info.rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
