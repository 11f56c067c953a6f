"""The cost of attribution through training against the training run it replays: wall time and
peak memory of the training loop alone (``fit``), of ``gradscope train`` (the loop and the
state it saves after each pass) without and with ``--record``, and of the reverse replay for
one reference (the mean over REF) and for R references batched, each in a process of its own.

    python benchmarks/through_training.py configs/digits.yaml examples/digits/digits_ref.pt

One thread (the numbers compare one loop with another, not machines)."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def child(config: str, what: str, folder: Path, ref: str, refs: int) -> dict:
    """One measurement, in this process: its seconds and the process's peak RSS in MiB."""
    from gradscope.config import load_config
    from gradscope.training import fit
    from gradscope.training.replay import through_training
    from gradscope.training.run import train_model

    torch.set_num_threads(1)
    cfg = load_config(config)
    started = time.perf_counter()
    if what == "fit":
        fit(cfg)
    elif what == "train":
        train_model(cfg, folder / "plain.pt", overwrite=True)
    elif what == "record":
        train_model(cfg, folder / "model.pt", record=True, overwrite=True)
    else:
        first = _first_rows(ref, refs, folder)
        started = time.perf_counter()
        through_training(cfg, folder / "model.run", first, per_ref=refs > 1)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _first_rows(ref: str, refs: int, folder: Path) -> Path:
    """REF's first ``refs`` rows (all of them for 0) as a file of REF's kind: .pt or Parquet."""
    if not refs:
        return Path(ref)
    if ref.endswith(".parquet"):
        import pyarrow.parquet as pq

        out = folder / f"ref{refs}.parquet"
        pq.write_table(pq.read_table(ref).slice(0, refs), out)
        return out
    out = folder / f"ref{refs}.pt"
    torch.save({k: v[:refs] for k, v in torch.load(ref).items()}, out)
    return out


def measure(config: str, ref: str, folder: Path, what: str, refs: int = 0) -> dict:
    args = [sys.executable, __file__, config, ref, "--child", what, "--folder", str(folder)]
    out = subprocess.run([*args, "--refs", str(refs)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("ref")
    parser.add_argument("--refs", type=int, nargs="*", default=[10, 100])
    parser.add_argument("--child")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.config, args.child, Path(args.folder), args.ref, args.refs[0])))
        return
    with tempfile.TemporaryDirectory() as folder:
        rows = {
            "fit (the loop alone)": measure(args.config, args.ref, Path(folder), "fit"),
            "train": measure(args.config, args.ref, Path(folder), "train"),
            "train --record": measure(args.config, args.ref, Path(folder), "record"),
            "replay, mean over REF": measure(args.config, args.ref, Path(folder), "replay"),
            "replay, 1 reference": measure(args.config, args.ref, Path(folder), "replay", 1),
        }
        for r in args.refs:
            rows[f"replay, {r} references batched"] = measure(
                args.config, args.ref, Path(folder), "replay", r
            )
    base, loop = rows["train"]["seconds"], rows["fit (the loop alone)"]["seconds"]
    one = rows["replay, 1 reference"]["seconds"]
    print(f"{'':34} {'seconds':>8} {'x train':>8} {'x fit':>8} {'peak MiB':>9}")
    for name, row in rows.items():
        t = row["seconds"]
        print(f"{name:34} {t:8.2f} {t / base:8.2f} {t / loop:8.2f} {row['peak_mib']:9.0f}")
    for r in args.refs:
        t = r * one
        print(f"{f'{r} replays of 1 reference (r x)':34} {t:8.2f} {t / base:8.2f} {t / loop:8.2f}")


if __name__ == "__main__":
    main()
