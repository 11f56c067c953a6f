"""EK-FAC self-influence and influence on the LM example: gradscope beside kronfluence.

    python benchmarks/peers_curvature.py gradscope OUT_DIR       # gradscope's environment
    python benchmarks/peers_curvature.py kronfluence OUT_DIR     # a venv with kronfluence 1.0.1
    python benchmarks/peers_curvature.py compare OUT_DIR         # Spearman rho, planted rows, AUC

Same model (examples/lm, GPT-2's Conv1D turned into Linear for kronfluence), same parameters
(the transformer blocks' projection weights and biases: what kronfluence tracks), the same loss
(next-token cross entropy, mean over each row's tokens), the true Fisher (targets drawn from the
model), EK-FAC with damping 0.1 x the mean eigenvalue, influence against the mean gradient of
examples/lm/clean_ref.parquet (64 clean rows). Each tool in-process on one thread; times are
factors, then scores. Definitions still differ in two places: kronfluence folds each bias into
its weight's block (an input of ones), gradscope gives biases the Fisher's diagonal; and each
tool draws its own sampled targets.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
LM = ROOT / "examples" / "lm"
TRACKED = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    cols = ["input_ids", "attention_mask", "labels"]
    return [dict(zip(cols, r, strict=True)) for r in zip(*(table.column(c).to_pylist() for c in cols), strict=True)]  # fmt: skip


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(r["input_ids"]) for r in rows)
    pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {
        k: torch.tensor([r[k] + [v] * (longest - len(r[k])) for r in rows]) for k, v in pad.items()
    }


def run_gradscope(out: Path) -> None:
    import dataclasses

    from gradscope.config import load_config, with_overrides
    from gradscope.curvature import fit_factors
    from gradscope.run import score_dataset
    from gradscope.scorers import InfluenceScorer, NormsScorer

    cfg = with_overrides(load_config(ROOT / "configs" / "lm.yaml"))
    include = [f"transformer.h.*.{m}.{p}" for m in TRACKED for p in ("weight", "bias")]
    cfg = dataclasses.replace(cfg, params=dataclasses.replace(cfg.params, include=include))
    times = {}
    start = time.perf_counter()
    fit_factors(cfg, out / "gradscope.safetensors", ekfac=True)
    times["factors"] = time.perf_counter() - start
    norms_cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, path=str(out / "gs_norms.parquet")))  # fmt: skip
    start = time.perf_counter()
    score_dataset(norms_cfg, NormsScorer(precondition=out / "gradscope.safetensors"))
    times["self"] = time.perf_counter() - start
    infl_cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, path=str(out / "gs_infl.parquet")))  # fmt: skip
    start = time.perf_counter()
    scorer = InfluenceScorer(LM / "clean_ref.parquet", precondition=out / "gradscope.safetensors")
    score_dataset(infl_cfg, scorer)
    times["influence"] = time.perf_counter() - start
    (out / "gradscope_times.json").write_text(json.dumps(times))
    print(times)


def run_kronfluence(out: Path) -> None:
    import torch.nn.functional as F
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    model = GPT2LMHeadModel.from_pretrained(LM / "model").eval()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):  # y = x W + b with W (in, out): a Linear with W^T
                linear = torch.nn.Linear(*child.weight.shape)
                linear.weight.data, linear.bias.data = child.weight.data.T.clone(), child.bias.data
                setattr(module, child_name, linear)

    def per_example(batch, sample: bool) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits, labels = logits[:, :-1], batch["labels"][:, 1:]
        if sample:
            with torch.no_grad():
                drawn = torch.multinomial(logits.reshape(-1, logits.shape[-1]).softmax(-1), 1)
            labels = torch.where(labels == -100, labels, drawn.view(labels.shape))
        flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        counted = (labels != -100).sum(1).clamp_min(1)
        return flat.view(labels.shape).sum(1) / counted

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return per_example(batch, sample).sum()

        def compute_measurement(self, batch, model):
            return per_example(batch, False).sum()

        def get_influence_tracked_modules(self):
            return [f"transformer.h.{i}.{m}" for i in range(len(model.transformer.h)) for m in TRACKED]  # fmt: skip

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    task = LMTask()
    model = prepare_model(model, task)
    train, ref = _rows(LM / "data" / "data-00000-of-00001.arrow"), _rows(LM / "clean_ref.parquet")
    analyzer = Analyzer("lm", model, task, cpu=True, output_dir=str(out / "kronfluence"))
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=_collate))
    times = {}
    start = time.perf_counter()
    analyzer.fit_all_factors(
        "ekfac", train, per_device_batch_size=64, factor_args=FactorArguments(strategy="ekfac"),
        overwrite_output_dir=True,
    )  # fmt: skip
    times["factors"] = time.perf_counter() - start
    args = ScoreArguments(damping_factor=None)  # 0.1 x the mean eigenvalue
    start = time.perf_counter()
    analyzer.compute_self_scores("self", "ekfac", train, per_device_train_batch_size=64,
                                 score_args=args, overwrite_output_dir=True)  # fmt: skip
    times["self"] = time.perf_counter() - start
    start = time.perf_counter()
    analyzer.compute_pairwise_scores("pair", "ekfac", ref, train, per_device_query_batch_size=64,
                                     per_device_train_batch_size=64, score_args=args,
                                     overwrite_output_dir=True)  # fmt: skip
    times["influence"] = time.perf_counter() - start
    self_scores = analyzer.load_self_scores("self")["all_modules"].numpy()
    pair = analyzer.load_pairwise_scores("pair")["all_modules"].numpy()  # (queries, train)
    pd.DataFrame({"self": self_scores, "influence": pair.mean(0)}).to_parquet(out / "kf.parquet")
    (out / "kronfluence_times.json").write_text(json.dumps(times))
    print(times)


def compare(out: Path) -> None:
    sys.path.insert(0, str(LM))
    from planted_rank import auc, kinds

    kind = kinds()
    gs_norms = pd.read_parquet(out / "gs_norms.parquet")
    gs_infl = pd.read_parquet(out / "gs_infl.parquet")
    kf = pd.read_parquet(out / "kf.parquet")
    corrupted = kind == "corrupted"
    n = int(corrupted.sum())
    times = {t: json.loads((out / f"{t}_times.json").read_text()) for t in ("gradscope", "kronfluence")}  # fmt: skip
    print("| score | tool | corrupted in top 40 | AUC | Spearman rho (gradscope, kronfluence) | factors + scores |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for label, gs, kfs, sign, key in (
        ("self-influence (high first)", gs_norms["self_influence"], kf["self"], 1, "self"),
        ("influence (low first)", gs_infl["influence"], kf["influence"], -1, "influence"),
    ):
        rho = pd.Series(gs.to_numpy()).rank().corr(pd.Series(kfs.to_numpy()).rank())
        for tool, score in (("gradscope", gs.to_numpy()), ("kronfluence", kfs.to_numpy())):
            s = sign * score
            top = corrupted[np.argsort(-s, kind="stable")[:n]].sum()
            t = times[tool]
            print(f"| {label} | {tool} | {top}/{n} | {auc(s, corrupted):.3f} | {rho:.3f} "
                  f"| {t['factors']:.0f} s + {t[key]:.0f} s |")  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    what, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"gradscope": run_gradscope, "kronfluence": run_kronfluence, "compare": compare}[what](out)
