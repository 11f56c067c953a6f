"""The attribution peers' (references x training rows) score matrices, in the peers' environment.

    /work/peers-venv/bin/python benchmarks/attribution/peers.py JOB.json

JOB: {"peer": trak | kronfluence | dattri | bergson, "options": {...}, "config": the setting's
gradscope config, "ref": the references' file, "checkpoints": [state dicts, the last the trained
model], "out": a .npy file}. Writes the (R, N) float64 matrix to ``out`` and, beside it as
``OUT.time.json``, the seconds the peer took from the loaded model and data to the matrix. Every
matrix is oriented as gradscope's ``influence``: positive where the training row lowers the
reference's loss (TRAK: raises its correct-class margin). One thread. Options per peer (the
defaults are each peer's own):

- trak: proj_dim (2048), lambda_reg (0.0); every checkpoint in ``checkpoints`` is one model of its
  ensemble; digits (classification) only: traker has no output function for regression or LMs.
- kronfluence: damping (1e-8; None: its 0.1 x mean eigenvalue heuristic), EK-FAC, the true Fisher,
  measurement = the reference's loss; the LM's Conv1D turned into Linear, its blocks tracked.
- dattri: regularization (0.0), its explicit inverse Hessian of the mean training loss.
- bergson: projection_dim (16), cosine (false): ``bergson build`` of both sets, inner products of
  the stored rows; Hugging Face causal LMs only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from setting import Setting  # noqa: E402


def trak(s: Setting, ref: list, ckpts: list, proj_dim: int = 2048, lambda_reg: float = 0.0):
    from trak import TRAKer

    train = s.rows()
    model = s.model(ckpts[-1])
    with tempfile.TemporaryDirectory() as tmp:
        traker = TRAKer(model=model, task="image_classification", train_set_size=len(train),
                        save_dir=tmp, device="cpu", proj_dim=proj_dim, lambda_reg=lambda_reg,
                        use_half_precision=False)  # fmt: skip
        states = [torch.load(c, weights_only=True) for c in ckpts]
        for n, state in enumerate(states):
            traker.load_checkpoint(state, model_id=n)
            for start in range(0, len(train), 100):
                traker.featurize(batch=s.collate(train[start : start + 100]), num_samples=min(100, len(train) - start))  # fmt: skip
        traker.finalize_features()
        for n, state in enumerate(states):
            traker.start_scoring_checkpoint("ref", state, model_id=n, num_targets=len(ref))
            traker.score(batch=s.collate(ref), num_samples=len(ref))
        scores = traker.finalize_scores("ref")  # (N, R), positive: raises the margin
    return np.asarray(scores, dtype=np.float64).T


def dattri(s: Setting, ref: list, ckpts: list, regularization: float = 0.0):
    from dattri.algorithm.influence_function import IFAttributorExplicit
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader

    train, model = s.rows(), s.model(ckpts[-1])

    def loss(params, data):  # the mean loss of a batch; dattri adds the batch dimension of one row
        x, y = data
        outputs = torch.func.functional_call(model, params, x)
        return s.per_example_loss(outputs, y).mean()

    task = AttributionTask(loss_func=loss, model=model, checkpoints=model.state_dict())
    attributor = IFAttributorExplicit(task=task, device="cpu", regularization=regularization)
    attributor.cache(DataLoader(train, batch_size=len(train), collate_fn=s.collate))
    with torch.no_grad():
        scores = attributor.attribute(
            DataLoader(train, batch_size=100, collate_fn=s.collate),
            DataLoader(ref, batch_size=len(ref), collate_fn=s.collate),
        )  # (N, R): g_train^T (H + reg I)^-1 g_ref, positive: lowers the reference's loss
    return scores.double().numpy().T


def bergson(s: Setting, ref: list, ckpts: list, projection_dim: int = 16, cosine: bool = False):
    from datasets import Dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        s.model(ckpts[-1]).save_pretrained(tmp / "model")
        Dataset.from_list(s.rows()).save_to_disk(tmp / "train")
        Dataset.from_list(ref).save_to_disk(tmp / "ref")
        rows = {}
        for part in ("train", "ref"):
            command = [sys.executable, "-m", "bergson", "build", str(tmp / f"b-{part}"),
                       "--model", str(tmp / "model"), "--dataset", str(tmp / part),
                       "--tokenizer", str(s.pretrained.parents[0] / "tokenizer"),
                       "--projection_dim", str(projection_dim), "--token_batch_size", "64",
                       "--loss_reduction", "mean"]  # fmt: skip
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"bergson build failed:\n{run.stderr[-3000:]}")
            info = json.loads((tmp / f"b-{part}" / "info.json").read_text())
            flat = np.fromfile(tmp / f"b-{part}" / "gradients.bin", dtype=np.dtype(info["base_dtype"]))  # fmt: skip
            rows[part] = flat.reshape(info["num_grads"], -1).astype(np.float64)
    train, refs = rows["train"], rows["ref"]
    if cosine:
        train = train / np.linalg.norm(train, axis=1, keepdims=True)
        refs = refs / np.linalg.norm(refs, axis=1, keepdims=True)
    return refs @ train.T  # (R, N): aligned gradients, positive: lowers the reference's loss


def kronfluence(s: Setting, ref: list, ckpts: list, damping: float | None = 1e-8):
    from peers_kronfluence import pairwise

    return pairwise(s, ref, s.model(ckpts[-1]), damping)


PEERS = {"trak": trak, "kronfluence": kronfluence, "dattri": dattri, "bergson": bergson}


def main(job_path: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # kronfluence's sampled targets: a rerun draws the same ones
    job = json.loads(Path(job_path).read_text())
    setting = Setting.read(job["config"])
    ref = setting.rows(job["ref"])
    start = time.perf_counter()
    scores = PEERS[job["peer"]](setting, ref, job["checkpoints"], **job.get("options", {}))
    seconds = time.perf_counter() - start
    out = Path(job["out"])
    np.save(out, scores)
    out.with_suffix(".time.json").write_text(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1])
