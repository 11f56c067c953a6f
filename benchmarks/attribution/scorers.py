"""The scorers of the attribution benchmark: gradscope's commands and the peers, each run as one
command whose wall-clock seconds are what it costs, each writing a score file that ``gradscope
validate`` reads.

A score is a ``Run``: the command line, what to record of it (tool, scorer, options, whether
the options are the tool's defaults) and the score file it leaves. The peers run in their own
environment (``peers.py``); their (R, N) matrices are written here as per-ref influence files
with the metadata ``validate`` checks (the data's and the references' sha256).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from gradscope import __version__
from gradscope.config import Config
from gradscope.io.data import data_sha256
from gradscope.io.parquet import METADATA_KEY

HERE = Path(__file__).resolve().parent
GRADSCOPE = [sys.executable, "-m", "gradscope"]


@dataclass
class Run:
    """One scorer's run and, once measured, its outcome."""

    tool: str
    scorer: str
    options: dict
    default: bool  # the tool's own defaults (or gradscope's command with no flags)
    file: str = ""
    column: str = "influence"
    status: str = "ok"  # ok | fails
    note: str = ""
    seconds: float | None = None  # the command's wall clock, process start included
    cpu_s: float | None = None  # the command's CPU seconds (user + system): load aside
    run_s: float | None = None  # the scoring's own, as its file's metadata records it
    lds: dict = field(default_factory=dict)
    commit: str = ""  # the gradscope commit it was measured at

    def record(self) -> dict:
        return asdict(self)


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(command: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Wall-clock and CPU seconds the command took, and its last error line ('' when it
    succeeded). CPU seconds stand where other work shares the cores: wall-clock there waits."""
    start, cpu = time.perf_counter(), _children_cpu()
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if run.returncode == 0:
        return seconds, cpu, ""
    lines = [line for line in (run.stderr or run.stdout).splitlines() if line.strip()]
    return seconds, cpu, (lines[-1] if lines else f"exit {run.returncode}")[:300]


def write_config(cfg: Config, path: Path, **model: object) -> Path:
    """``cfg`` with ``model`` keys replaced, as a config file (its paths are absolute)."""
    raw = cfg.to_dict()
    del raw["source"]  # where it was read from; not a key of the file
    raw["model"] |= model
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def influence(config: Path, ref: str, out: Path, flags: list[str], run: Run) -> Run:
    """``gradscope influence CONFIG --ref REF --per-ref FLAGS``."""
    command = [*GRADSCOPE, "influence", str(config), "--ref", ref, "--per-ref", "--out", str(out)]
    run.seconds, run.cpu_s, run.note = timed([*command, *flags])
    run.file, run.status = str(out), "fails" if run.note else "ok"
    if not run.note:
        run.note = solved(out)
    return run


def solved(path: Path) -> str:
    """What conjugate gradients took, as the score file's metadata records it ('' where no
    curvature was solved by them): iterations and the worst relative residual reached."""
    meta = json.loads(pq.read_schema(path).metadata[METADATA_KEY])
    fitted = meta.get("influence", {}).get("curvatures", [])  # none in a replay's file
    fits = [c for c in fitted if c.get("solver") == "cg"]
    return "; ".join(f"conjugate gradients: {c['iterations']} iterations, relative residual "
                     f"{c['residual']:.1e} (tolerance {c['tolerance']:g})" for c in fits)  # fmt: skip


def peer(python: str, job: dict, cfg: Config, ref: str, run: Run) -> Run:
    """A peer's matrix through ``peers.py`` in its environment, written as a score file."""
    out = Path(job["out"])
    job_file = out.with_suffix(".job.json")
    job_file.write_text(json.dumps(job))
    run.seconds, run.cpu_s, run.note = timed([python, str(HERE / "peers.py"), str(job_file)])
    if run.note:
        run.status = "fails"
        return run
    scores = np.load(out)  # (R, N)
    if not np.isfinite(scores).all():
        run.status, run.note = "fails", f"{int((~np.isfinite(scores)).sum())} scores not finite"
        return run
    inner = json.loads(out.with_suffix(".time.json").read_text())["seconds"]
    run.file = str(out.with_suffix(".parquet"))
    write_scores(scores, cfg, ref, Path(run.file), {"tool": run.tool, **run.options}, inner)
    return run


def write_scores(
    scores: np.ndarray, cfg: Config, ref: str, path: Path, what: dict, seconds: float
) -> None:
    """(R, N) scores as a per-ref influence file: example_id, ref_id, influence, and the
    ``gradscope`` metadata of one (the data's and the references' sha256, the config)."""
    refs, rows = scores.shape
    table = pa.table(
        {
            "example_id": np.repeat(np.arange(rows, dtype=np.int64), refs),
            "ref_id": np.tile(np.arange(refs, dtype=np.int64), rows),
            "influence": scores.T.reshape(-1).astype(np.float64),  # example-major, as gradscope
        }
    )
    meta = {
        "version": __version__,
        "command": "influence",
        "config": cfg.to_dict(),
        "data_sha256": data_sha256(cfg.data.path),
        "seconds": seconds,
        "influence": {
            "ref": ref,
            "ref_sha256": data_sha256(ref),
            "ref_examples": refs,
            "per_ref": True,
            "peer": what,
        },
    }
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta, default=str)})
    pq.write_table(table, path)
