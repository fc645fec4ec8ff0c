"""GPU check: the CUDA-marked tests, then the copy engine on this GPU.

Usage: `python benchmarks/gpu_check.py [--quick] [--json OUT]` from the repository root.

It prints the machine (GPU name, driver and CUDA versions), runs the CUDA-marked tests
(`pytest -m gpu` over `tests/gpu`, the cache with GPU tensors and an HBM tier, the vLLM
worker's pipelined loads and vLLM's CUDA KV layouts), then
`benchmarks.bench_gpu_copy`: store (D2H gather) and load (H2D scatter) bandwidth for a
Llama-3-8B layout, 4 GiB moved, against one plain pinned `copy_` of the same bytes (target
>= 0.85), and how much a store slows a matmul on another stream (target < 10%); then
`benchmarks.bench_hbm`: an HBM tier's promotions from DRAM, loads into host memory and
stores with a demotion, 48 MiB each, against plain `copy_`s (target >= 0.8). It takes
about two minutes. Exit status: 0 when the tests pass and every target is met, 1 when a test
fails, 2 when a target is missed. Without a CUDA device it prints 'no CUDA device: skipped'
and exits 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

#: Where the CUDA-marked tests are.
GPU_TESTS = (
    "tests/gpu",
    "tests/test_cache.py",
    "tests/test_cache_hbm.py",
    "tests/integrations/test_vllm_worker.py",
    "tests/integrations/test_vllm_kv.py",
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import machine_info, print_machine, print_report, write_json  # noqa: E402


def _gpu_info() -> dict[str, str]:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {
        "gpu": f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
        f"compute capability {props.major}.{props.minor}",
        "cuda (torch build)": str(torch.version.cuda),
        "gpus": str(torch.cuda.device_count()),
    }
    query = "driver_version,pcie.link.gen.current,pcie.link.width.current"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        driver, gen, width = (x.strip() for x in out.split(","))
        info["driver"] = driver
        info["pcie link"] = f"gen {gen} x{width}"
    except (OSError, subprocess.SubprocessError, ValueError):
        info["driver"] = "unknown (nvidia-smi unavailable)"
    return info


def main(argv: list[str] | None = None) -> int:
    """Run the check; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="move 1 GiB instead of 4 GiB")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    info = {**machine_info(), **_gpu_info()}
    print("# kvtiers GPU check")
    print()
    print_machine(info)
    print()
    print(f"## pytest -m gpu {' '.join(GPU_TESTS)}", flush=True)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", *GPU_TESTS, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        check=False,
    )
    print()
    print("## copy engine vs plain pinned copy", flush=True)
    from benchmarks.bench_gpu_copy import run

    results = run(args.quick)
    print_report(results)
    print()
    print("## HBM tier: promotions, loads and stores vs plain copies", flush=True)
    from benchmarks.bench_hbm import run as run_hbm

    moves = run_hbm(args.quick)
    print_report(moves)
    results += moves
    missed = [r.name for r in results if r.passed is False]
    met = sum(r.passed is True for r in results)
    print()
    print(
        f"tests: {'passed' if tests.returncode == 0 else 'FAILED'}; "
        f"targets: {met} of {met + len(missed)} met"
        + (f" (missed: {', '.join(missed)})" if missed else "")
    )
    if args.json:
        write_json(args.json, info, results, quick=args.quick, tests_rc=tests.returncode)
    if tests.returncode:
        return 1
    return 2 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
