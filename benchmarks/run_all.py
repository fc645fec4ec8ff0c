"""Run every kvtiers benchmark and print one table, with the machine described on top.

Usage: `python -m benchmarks.run_all [--quick] [--json OUT] [--only NAME ...]`.

`--quick` shrinks the sizes so the whole suite takes well under a minute; the full suite
takes a few minutes on two cores, plus about 4 for `bench_lmcache` (30 s with `--quick`)
where LMCache's virtualenv exists (it is skipped, saying why, where not). A benchmark that
fails is reported and the others still run; the exit status is 1 if any failed. Missing a
target does not fail the run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
import traceback

from benchmarks._common import Result, machine_info, print_machine, print_report, write_json

BENCHMARKS = (
    "bench_keys",
    "bench_lookup",
    "bench_shared_lookup",
    "bench_dram",
    "bench_hbm",  # on the HBM tier's CPU seam without CUDA
    "bench_lmdb",
    "bench_lmdb_small",
    "bench_remote",
    "bench_split_load",
    "bench_layerwise",
    "bench_cold",
    "bench_pool_stores",
    "bench_overhead",
    "bench_idle",
    "bench_policies",
    "bench_lmcache",  # skipped, with the reason, without .venv-lmcache
)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in `argv` (all by default); return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    args = parser.parse_args(argv)

    info = machine_info()
    print(f"# kvtiers benchmarks ({'quick' if args.quick else 'full'})")
    print()
    print_machine(info)
    print()
    results: list[Result] = []
    failed: list[str] = []
    seconds: dict[str, float] = {}
    for name in args.only or BENCHMARKS:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            results.extend(module.run(args.quick))
        except Exception:
            failed.append(name)
            traceback.print_exc()
        finally:
            seconds[name] = time.perf_counter() - start
            gc.collect()
        print(f"  {name}: {seconds[name]:.1f} s", file=sys.stderr, flush=True)

    print_report(results)
    passed = sum(r.passed is True for r in results)
    missed = [r.name for r in results if r.passed is False]
    print()
    print(
        f"{passed} of {passed + len(missed)} targets met; "
        f"{sum(seconds.values()):.0f} s in all ("
        + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items())
        + ")"
    )
    for name in failed:
        print(f"FAILED: {name} (traceback above, on stderr)")
    if args.json:
        write_json(args.json, info, results, quick=args.quick, seconds=seconds, failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
