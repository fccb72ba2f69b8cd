"""Wall time and peak memory of ``verl-partial demo`` (the README's main job), for the docs.

Memory is the peak of the summed resident set of the demo process and all its descendants (the Ray
cluster, TaskRunner, FSDP workers, CPU servers, agent-loop and reward workers), sampled every 0.25 s.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("demo_args", nargs="*", help="arguments passed to `verl-partial demo`")
    args = parser.parse_args()
    command = [sys.executable, "-m", "verl_partial.cli", "demo", *args.demo_args]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    root = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, tree_rss(root))
        except psutil.Error:
            pass
        time.sleep(0.25)
    wall = time.perf_counter() - start
    print(f"exit code {child.returncode}; wall time {wall:.1f} s; peak RSS of the process tree {peak / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
