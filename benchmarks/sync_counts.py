"""Host-device synchronisations of a replayed `norms` pass against a plain training step, on the
benchmark's workloads at their own sizes (``tests/engine/replay/test_syncs.py`` checks every
workload at test sizes, where a routed read's Gram is cheap; at W9's size its experts take each
(example, expert) key's rows apart, which reads the keys' counts on the host).

    PYTHONPATH=$PWD:$PWD/tests:$PWD/benchmarks OMP_NUM_THREADS=1 \\
        python benchmarks/sync_counts.py [--workloads default]

Prints, for each workload, the calls that wait for the device (``tests/syncs.py``: a model's
grouped products given offsets among them, whose kernel reads those on the host) in the plain
step and in the third replayed pass of one Engine, those the pass makes beyond the step, and
how many each makes in all.
"""

from __future__ import annotations

import argparse

import torch
import workloads
from syncs import step_and_pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="default", help="names or sets, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| workload | plain step | replayed pass | beyond the step | in all | replays |")
    print("|---|---|---|---|---|---|")
    for name in workloads.expand(args.workloads.split(",")):
        plain, ours, replays, _ = step_and_pass(workloads.WORKLOADS[name].build())
        more = dict(ours - plain) or "none"
        both = f"{plain.total()} / {ours.total()}"
        print(
            f"| {name} | {dict(plain)} | {dict(ours)} | {more} | {both} | {replays} |", flush=True
        )


if __name__ == "__main__":
    main()
