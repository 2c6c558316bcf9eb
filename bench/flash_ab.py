"""The flash kernels and launcher of git revisions beside the working tree's, alternated in one
process: separate processes' attention timings move by more than the differences looked for
(docs/benchmarks.md). Runs bench/attention.py's twin checks for each, then times forward and
forward+backward of a few shapes, `--rounds` times, each round all of one variant then the next,
and last the best of the rounds for each.

    python3 bench/flash_ab.py --export REV DIR     # here: REV's kernels/ and launcher into DIR
    python3 bench/flash_ab.py --against DIR [DIR ...] [--rounds 2] [--reps 30]   # on the GPU

The GPU machine's copy of the tree has no git history, so each revision (a branch, a commit) is
exported first into a folder that travels with the tree (a git-ignored one named in the device
tool's carry). Several exports compare in one call, each named by its folder and revision.
"""
import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = "cupytp/launchers/flash_attention.py"
SHAPES = [  # b, h, t, d, causal, dropout p
    (8, 12, 1024, 64, True, 0.1), (8, 12, 1024, 64, True, 0.0), (8, 20, 1024, 64, True, 0.1),
    (4, 16, 2048, 128, True, 0.0), (4, 16, 2048, 128, True, 0.1), (64, 6, 256, 64, True, 0.2),
    (8, 12, 1024, 64, False, 0.0),
]
NAMES = ("AttentionDropout", "attention_backward", "attention_backward_numpy",
         "attention_forward", "attention_forward_numpy")   # what bench/attention.py imports


def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def export(rev, folder):
    """The revision's kernels/ and flash launcher written into `folder` (made anew)."""
    kernels = folder / "kernels"
    kernels.mkdir(parents=True, exist_ok=False)
    for name in git("ls-tree", "--name-only", f"{rev}:kernels").decode().split():
        (kernels / name).write_bytes(git("show", f"{rev}:kernels/{name}"))
    (folder / "flash_attention.py").write_bytes(git("show", f"{rev}:{LAUNCHER}"))
    (folder / "REVISION").write_text(git("rev-parse", rev).decode())


def exported(folder):
    """(the exported kernels/ folder, its launcher module)."""
    spec = importlib.util.spec_from_file_location("flash_attention_exported",
                                                  folder / "flash_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return (folder / "kernels").resolve(), module


def rebuild(module):
    """The launcher's kernels and plans dropped, so that the next call builds them again."""
    for cached in ("_kernel", "_wgmma"):    # _wgmma: not in revisions before the Hopper path
        if hasattr(module, cached):
            getattr(module, cached).cache_clear()
    module._plans.clear()


def summary(results):
    """Lines of the best (fastest over the rounds) forward and forward+backward of each variant
    and shape, with fwd+bwd against the tree's: `results` maps (shape, variant) to its rounds'
    (fwd, fwd+bwd) ms."""
    lines = []
    for shape in dict.fromkeys(shape for shape, _ in results):
        base = min(both for _, both in results.get((shape, "tree"), [(0.0, 0.0)]))
        lines.append(f"{shape}")
        for (at, name), rounds in results.items():
            if at == shape:
                fwd, both = min(f for f, _ in rounds), min(b for _, b in rounds)
                ratio = f"  {base / both:.3f}x as fast as the tree" \
                    if base and name != "tree" else ""
                lines.append(f"  {name:32s} fwd {fwd:.3f}  fwd+bwd {both:.3f}{ratio}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--export", nargs=2, metavar=("REV", "DIR"))
    group.add_argument("--against", type=Path, nargs="+", metavar="DIR")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if args.export:
        rev, folder = args.export
        if Path(folder).exists():
            parser.error(f"{folder} exists: export into a new folder (nothing is overwritten)")
        export(rev, Path(folder))
        print(f"exported {rev} to {folder}")
        return
    for folder in args.against:
        if not (folder / "REVISION").is_file():
            parser.error(f"{folder} holds no export: make one with --export REV DIR first")
    import cupytp.launchers as launchers
    from cupytp.launchers import flash_attention
    sys.path.insert(0, str(ROOT / "bench"))
    import attention
    variants = {f"{folder.name}:{(folder / 'REVISION').read_text().strip()[:10]}":
                exported(folder) for folder in args.against}
    variants["tree"] = (launchers.sources(), flash_attention)

    def use(name):
        kernels, module = variants[name]
        launchers.sources = lambda: kernels
        launchers._module.cache_clear()
        launchers._function.cache_clear()
        for _, other in variants.values():
            rebuild(other)
        attention.flash_attention = module
        for attribute in NAMES:
            setattr(attention, attribute, getattr(module, attribute))

    for name in variants:
        use(name)
        print(f"{name}: twin checks {'pass' if attention.check() else 'FAIL'}", flush=True)
    results = {}
    for round_ in range(args.rounds):
        for name in variants:
            use(name)
            for shape in SHAPES:
                forward, both = attention.time_ours(*shape, args.reps, "flash")
                results.setdefault((shape, name), []).append((forward, both))
                print(f"RESULT {name} round={round_} {shape} fwd {forward:.3f} "
                      f"fwd+bwd {both:.3f} bwd {both - forward:.3f}", flush=True)
    print("\nbest of the rounds (ms):")
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
