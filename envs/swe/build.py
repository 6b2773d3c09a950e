"""Command line: build offline SWE tasks.

    python -m envs.swe.build --libs toolz,cachetools --per-lib 20 --out data/swe

writes ``<out>/instances.jsonl`` (atomically, when the build is done) and the task repositories
under ``<out>/repos``; sdists are cached in ``$KVSTREAMS_SWE_CACHE`` (default
``~/.cache/kvstreams/swe``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from .builder import BuildConfig, build
from .instance import write_instances
from .libraries import DEFAULT_LIBRARIES, LIBRARIES


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.swe.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=",".join(DEFAULT_LIBRARIES), help=f"comma-separated, from {sorted(LIBRARIES)}")
    p.add_argument("--per-lib", type=int, default=20, help="instances per library")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=BuildConfig().workers)
    p.add_argument("--max-per-function", type=int, default=1)
    p.add_argument("--max-candidates", type=int, default=None, help="mutants tried per library")
    p.add_argument("--show-tests", action="store_true", help="keep FAIL_TO_PASS tests in base_commit")
    p.add_argument("--no-validate", action="store_true", help="skip grading the gold and empty patches")
    p.add_argument("--cache", type=Path, default=None, help="sdist cache (default $KVSTREAMS_SWE_CACHE)")
    args = p.parse_args(argv)
    config = BuildConfig(libraries=tuple(s.strip() for s in args.libs.split(",") if s.strip()),
                         per_library=args.per_lib, seed=args.seed, workers=args.workers,
                         max_per_function=args.max_per_function, max_candidates=args.max_candidates,
                         hide_tests=not args.show_tests, validate_grading=not args.no_validate)
    start = time.monotonic()
    bar = tqdm(total=config.per_library * len(config.libraries), unit="task", desc="building")
    tried = 0

    def on_tried():
        nonlocal tried
        tried += 1
        bar.set_postfix(tried=tried)

    instances, reports = build(config, args.out, cache_dir=args.cache, on_kept=lambda _: bar.update(1),
                               on_tried=on_tried)
    bar.close()
    write_instances(args.out / "instances.jsonl", instances)
    seconds = time.monotonic() - start
    summary = {"instances": len(instances), "seconds": round(seconds, 1), "config": config.model_dump(),
               "libraries": [{"library": r.library, "kept": r.kept, "tried": r.tried, "seconds": round(r.seconds, 1),
                              "baseline_tests": r.baseline_tests, "rejected": dict(r.rejected)} for r in reports]}
    (args.out / "build_report.json").write_text(json.dumps(summary, indent=2) + "\n")
    for r in reports:
        print(f"{r.library}: kept {r.kept} of {r.tried} tried in {r.seconds:.0f}s "
              f"(baseline {r.baseline_tests} tests; rejected: {dict(r.rejected)})")
    print(f"{len(instances)} instances in {seconds:.0f}s -> {args.out / 'instances.jsonl'}")


if __name__ == "__main__":
    main()
