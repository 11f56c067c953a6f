"""LDS and cost of every gradscope scorer and of the peers, on settings anyone reruns on a CPU.

    python benchmarks/attribution/run.py [--settings digits_linear digits_mlp diabetes lm]
        [--subsets 60] [--seeds 2] [--peers /work/peers-venv/bin/python]
        [--json benchmarks/results/lds-DATE.json] [--markdown benchmarks/results/lds-DATE.md]
    python benchmarks/attribution/run.py --render lds-DATE.json --markdown lds-DATE.md

Per setting (configs/, data from make_data.py): ``gradscope train`` by the config's recipe (the
final checkpoint and the epoch ones), the trained model's loss and accuracy on the references,
then every scorer as one command, its wall-clock seconds its cost: ``influence --per-ref`` with
no flags (what a user gets), ``--curvature none`` (the inner product, and its ``cosine``
column), TracIn over the epoch checkpoints, each ``--curvature`` at each ``--damping``, the
ensemble over the epoch checkpoints (``influence`` of the TracIn config: each checkpoint's own
curvature, the scores summed; with no flags and under each curvature but the Hessian at each
damping), the
replay of the recorded run (``--through-training``; its cost for the mean over REF too, one
adjoint against the per-ref run's R); and each peer (peers.py, in its own environment) at its
defaults and over a grid of its knob. Every file is measured on two ground truths, each built
once by ``gradscope validate``: ``--subsets`` random halves x ``--seeds`` seeds, each trained
alone (the field's LDS), and ``--same-subsets`` removals of 1% of the rows trained in the full
run's batches and order under its seed (``--same-order``, the setting MAGIC reports), the
references' loss the target of both.
Every run is one thread (OMP_NUM_THREADS=1). "Tuned" in the tables is the best of a tool's
grid on this truth, for gradscope's dampings as for the peers' knobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from render import markdown  # noqa: E402
from scorers import GRADSCOPE, Run, influence, peer, timed, write_config  # noqa: E402

DAMPINGS = (0.001, 0.01, 0.1, 1.0, 10.0)
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


@dataclass(frozen=True)
class Bench:
    """A setting: its config (with a ``train:`` recipe), its references, the curvatures
    gradscope fits on it and each peer's option sets (the first: the peer's defaults)."""

    config: Path
    ref: Path
    curvatures: tuple[str, ...] = ("gn", "hessian", "kfac", "ekfac")
    dampings: tuple[float, ...] = DAMPINGS
    peers: dict[str, list[dict]] = field(default_factory=dict)


def _grid(key: str, values, **fixed) -> list[dict]:
    return [{**fixed, key: v} for v in values]


CLASSIFIER_PEERS = {
    "trak": [
        {},
        *_grid("lambda_reg", (1e-3, 1e-2, 1e-1, 1.0, 10.0), proj_dim=512),
        *_grid("lambda_reg", (1.0, 10.0), proj_dim=512, over="epochs"),
    ],  # fmt: skip
    "kronfluence": [{}, {"damping": None}, *_grid("damping", (1e-3, 1e-2, 1e-1))],
    "dattri": [{}, *_grid("regularization", (1e-3, 1e-2, 1e-1, 1.0))],
}
# dattri's explicit IF on the MLP's 9,034 parameters ran over 8 CPU minutes for one
# regularisation, unfinished (the Hessian alone takes about a minute): the MLP runs TRAK and
# kronfluence only.
MLP_PEERS = {k: CLASSIFIER_PEERS[k] for k in ("trak", "kronfluence")}
SETTINGS = {
    "digits_linear": Bench(
        HERE / "configs/digits_linear.yaml", HERE / "data/digits_ref.pt", peers=CLASSIFIER_PEERS
    ),  # fmt: skip
    "digits_mlp": Bench(
        HERE / "configs/digits_mlp.yaml", HERE / "data/digits_ref.pt", peers=MLP_PEERS
    ),  # fmt: skip
    "diabetes": Bench(
        HERE / "configs/diabetes.yaml",
        HERE / "data/diabetes_ref.pt",
        peers={k: CLASSIFIER_PEERS[k] for k in ("kronfluence", "dattri")},
    ),  # fmt: skip
    "lm": Bench(
        HERE / "configs/lm.yaml",
        HERE / "data/lm_ref.parquet",
        curvatures=("kfac", "ekfac"),
        peers={
            "kronfluence": CLASSIFIER_PEERS["kronfluence"][:2],
            "bergson": [
                {},
                *_grid("projection_dim", (64, 256)),
                {"projection_dim": 256, "cosine": True},
            ],
        },
    ),  # fmt: skip
}


def quality(cfg, ref: Path) -> dict:
    """The trained model's mean loss on the references, and its accuracy where it classifies."""
    import dataclasses
    import tempfile

    import pandas as pd

    from gradscope.run import score_dataset
    from gradscope.scorers import NormsScorer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ref.parquet"
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(ref), ids=None),
                                  output=dataclasses.replace(cfg.output, path=str(out)))  # fmt: skip
        score_dataset(cfg, NormsScorer())
        frame = pd.read_parquet(out)
    made = {"ref_loss": float(frame["loss"].mean())}
    if "pred" in frame and "target" in frame:
        made["ref_accuracy"] = float((frame["pred"] == frame["target"]).mean())
    return made


def gradscope_runs(bench: Bench, config: Path, tracin: Path, record: Path, work: Path) -> list[Run]:
    ref, runs = str(bench.ref), []
    replayed = ["--through-training", str(record)]
    runs.append(influence(config, ref, work / "through-training.parquet", replayed,
                          Run("gradscope", "through-training", {}, False)))  # fmt: skip
    runs.append(influence(config, ref, work / "default.parquet", [],
                          Run("gradscope", "influence", {}, default=True)))  # fmt: skip
    plain = influence(config, ref, work / "plain.parquet", ["--curvature", "none"],
                      Run("gradscope", "influence", {"curvature": "none"}, default=False))  # fmt: skip
    cosine = Run("gradscope", "cosine", {"curvature": "none"}, False, plain.file, "cosine",
                 plain.status, plain.note, plain.seconds)  # fmt: skip
    runs += [plain, cosine]
    runs.append(influence(tracin, ref, work / "tracin.parquet", ["--curvature", "none"],
                          Run("gradscope", "tracin", {"checkpoints": "epochs"}, False)))  # fmt: skip
    runs += _dampings(bench, bench.curvatures, config, work, "influence", {})
    epochs = {"checkpoints": "epochs"}
    runs.append(influence(tracin, ref, work / "ensemble.parquet", [],
                          Run("gradscope", "ensemble", epochs, False)))  # fmt: skip
    ensembled = [c for c in bench.curvatures if c != "hessian"]  # gn's is never below it
    return runs + _dampings(bench, ensembled, tracin, work, "ensemble", epochs)


def _dampings(bench: Bench, curvatures, config: Path, work: Path, scorer: str, options: dict):
    """``influence`` of ``config`` under each curvature at each damping."""
    runs = []
    for curvature in curvatures:
        for damping in bench.dampings:
            flags = ["--curvature", curvature, "--damping", str(damping)]
            chosen = {**options, "curvature": curvature, "damping": damping}
            out = work / f"{scorer}-{curvature}-{damping}.parquet"
            runs.append(influence(config, str(bench.ref), out, flags, Run("gradscope", scorer, chosen, False)))  # fmt: skip
    return runs


def peer_runs(bench: Bench, cfg, python: str, checkpoints: list[str], work: Path) -> list[Run]:
    runs = []
    for name, option_sets in bench.peers.items():
        for n, options in enumerate(option_sets):
            passed = {k: v for k, v in options.items() if k != "over"}
            over = checkpoints if options.get("over") == "epochs" else checkpoints[-1:]
            job = {"peer": name, "options": passed, "config": str(bench.config),
                   "ref": str(bench.ref), "checkpoints": over, "out": str(work / f"{name}-{n}.npy")}  # fmt: skip
            runs.append(peer(python, job, cfg, str(bench.ref), Run(name, name, options, n == 0)))
    return runs


def validate(config: Path, bench: Bench, files: list[str], column: str, work: Path, design: dict):
    """``gradscope validate`` of column ``column`` of ``files`` on the design's truth (built by
    the first call): its seconds and its results, one per file."""
    name = design["name"]
    out = work / f"validation-{name}.parquet"
    command = [*GRADSCOPE, "validate", str(config), "--ref", str(bench.ref), "--scores", *files,
               "--truth", str(work / f"truth-{name}.parquet"), "--subsets", str(design["subsets"]),
               "--seeds", str(design["seeds"]), "--fraction", str(design["fraction"]),
               "--column", column, "--out", str(out)]  # fmt: skip
    command += ["--same-order"] if design["same_order"] else []
    out.with_suffix(".json").unlink(missing_ok=True)
    out.unlink(missing_ok=True)
    seconds, error = timed(command)
    if error:
        raise SystemExit(f"gradscope validate failed: {error}")
    return seconds, json.loads(out.with_suffix(".json").read_text())["results"]


def _validate_all(config: Path, bench: Bench, runs: list[Run], work: Path, design: dict) -> float:
    """Every run that scored, validated on the design's truth (its results in each run's
    ``lds[design name]``): the seconds the truth took to build."""
    scored = [r for r in runs if r.status == "ok"]
    if not scored:
        raise SystemExit("no scorer ran: " + "; ".join(dict.fromkeys(r.note for r in runs)))
    truth_s, _ = validate(config, bench, [scored[0].file], scored[0].column, work, design)
    for column in dict.fromkeys(r.column for r in scored):
        mine = [r for r in scored if r.column == column]
        _, results = validate(config, bench, list(dict.fromkeys(r.file for r in mine)), column, work, design)  # fmt: skip
        by = {Path(r["file"]).resolve(): r for r in results if r["column"] == column}
        for r in mine:
            found = by.get(Path(r.file).resolve(), {})
            kept = {k: v for k, v in found.items() if k not in ("file", "column", "target", "seconds")}  # fmt: skip
            r.lds[design["name"]] = kept
            r.run_s = found.get("seconds")
    return truth_s


def _trained(cfg, work: Path):
    """The recipe's run twice, as the user's ``gradscope train`` (its seconds the training's
    cost) and with ``--record`` (the record the replay reads, and its seconds)."""
    from gradscope.training.run import train_model

    start = time.perf_counter()
    train_model(cfg, None, overwrite=True)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    trained = train_model(cfg, None, overwrite=True, record=True)
    return trained, train_s, time.perf_counter() - start


def replay_cost(config: Path, ref: str, record: Path, work: Path) -> float:
    """Seconds of ``influence --through-training`` against the mean over REF: one adjoint."""
    out = work / "through-training-mean.parquet"
    command = [*GRADSCOPE, "influence", str(config), "--ref", ref, "--out", str(out),
               "--through-training", str(record)]  # fmt: skip
    seconds, error = timed(command)
    if error:
        raise SystemExit(f"the mean replay failed: {error}")
    return seconds


def measure(bench: Bench, designs: list[dict], peers_python: str | None) -> dict:
    """One setting: train, score with everything, validate everything on each design's truth."""
    from gradscope.config import load_config

    cfg = load_config(bench.config)
    work = Path(cfg.model.checkpoint).parent
    work.mkdir(parents=True, exist_ok=True)
    for design in designs:  # built afresh: their seconds are measured
        (work / f"truth-{design['name']}.parquet").unlink(missing_ok=True)
    trained, train_s, record_s = _trained(cfg, work)
    config = write_config(cfg, work / "config.yaml")
    listed = [{"path": str(p), "weight": float(w)} for p, w in trained.epochs]
    tracin = write_config(cfg, work / "tracin.yaml", checkpoint=None, checkpoints=listed)
    runs = gradscope_runs(bench, config, tracin, trained.record, work)
    replay_s = replay_cost(config, str(bench.ref), trained.record, work)
    if peers_python:
        runs += peer_runs(bench, cfg, peers_python, [str(p) for p, _ in trained.epochs], work)
    truth_s = {d["name"]: _validate_all(config, bench, runs, work, d) for d in designs}
    return {
        "config": _shown(bench.config),
        "ref": _shown(bench.ref),
        "model": {"factory": cfg.model.factory, "kwargs": cfg.model.kwargs},
        "loss": cfg.loss.name,
        "rows": trained.rows,
        "recipe": cfg.to_dict()["train"],
        "train_s": train_s,
        "record_s": record_s,
        "replay_mean_s": replay_s,
        "truth_s": truth_s,
        **quality(cfg, bench.ref),
        "scorers": [r.record() for r in runs],
    }


def _shown(path: Path) -> str:
    """A path inside the repository relative to its root; others as they are."""
    root = HERE.parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def environment(peers_python: str | None) -> dict:
    import torch

    env = {
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip(),  # fmt: skip
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": 1,
    }
    if peers_python:
        code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
                "('traker', 'kronfluence', 'dattri', 'bergson', 'torch')}))")  # fmt: skip
        out = subprocess.run([peers_python, "-c", code], capture_output=True, text=True).stdout
        env["peers"] = json.loads(out)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--subsets", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--same-subsets",
        type=int,
        default=100,
        help="removals of 1%% of the rows in the run's own order (0: none)",
    )
    parser.add_argument("--peers", help="the python of the peers' environment (none: no peers)")
    parser.add_argument("--note", default="", help="a line the report shows with the commit")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--render", type=Path, help="render this JSON to --markdown, no run")
    args = parser.parse_args()
    if args.render:
        args.markdown.write_text(markdown(json.loads(args.render.read_text())))
        return
    designs = [{"name": "halves", "subsets": args.subsets, "seeds": args.seeds, "fraction": 0.5,
                "same_order": False, "target": "loss"}]  # fmt: skip
    if args.same_subsets:
        designs.append({"name": "same-order", "subsets": args.same_subsets, "seeds": 1,
                        "fraction": 0.99, "same_order": True, "target": "loss"})  # fmt: skip
    report = {
        "environment": environment(args.peers) | {"note": args.note},
        "designs": designs,
        "settings": {},
    }
    for name in args.settings:
        print(f"{name} ...", flush=True)
        report["settings"][name] = measure(SETTINGS[name], designs, args.peers)
        if args.json:  # after each setting: a crash keeps the ones measured
            args.json.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
