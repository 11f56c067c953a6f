"""The results file's bookkeeping: the environment a run measured in (commit, versions, the
peers' versions), and the runs of a rerun merged into an older file, each row keeping the
commit it was measured at."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def merged(old: dict, new: dict, commit: str) -> dict:
    """A setting's new runs over its old measurement: each new run replaces the old run of the
    same tool, scorer and options (or joins them); an old run keeps the commit it was measured
    at (``commit``, its report's, where it names none). The setting's own numbers (training,
    truths, replay, the model's quality) stay the old report's: a merge measures runs."""
    runs = {(r["tool"], r["scorer"], json.dumps(r["options"])): r | {"commit": r.get("commit") or commit}
            for r in old["scorers"]}  # fmt: skip
    for r in new["scorers"]:
        runs[(r["tool"], r["scorer"], json.dumps(r["options"]))] = r
    return old | {"scorers": list(runs.values())}


def shown(path: Path) -> str:
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
