"""``gradscope query``: the index's examples scored against references and written to Parquet.

Without ``--per-ref``, ``--top-k`` or ``--exact``: one row per indexed example in index order
(example_id, id, score). Otherwise each reference's top-k: ref_id, rank, example_id, id, score,
and with ``--exact`` the exact score and the example's rank in the projected ranking
(``projected_rank``), the rows ranked by the exact score.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .. import __version__, distributed
from ..config import Config, check_counts, load_config, output_path, with_overrides
from ..errors import ConfigError, DataError
from ..inputs import check_output, data_inputs, minimal, run_inputs
from ..io.atomic import replace_atomically
from ..io.data import data_identity
from ..io.lock import OutputLock
from ..io.parquet import METADATA_KEY
from ..job import Job
from ..rules.base import accumulation_dtype
from .exact import check_rows, exact_scores, rerank
from .projection import Projector
from .reader import Shards
from .references import References
from .scorer import gradient_keys, model_files, one_checkpoint
from .stream import Scores

CANDIDATES = 30  # --exact re-scores the top k * CANDIDATES of the projected ranking
MADE = ("checkpoint_sha256", "adapter_sha256")  # the model a factors file must be made at


@dataclass(frozen=True)
class Query:
    """What ``gradscope query`` asks of an index."""

    ref: str
    per_ref: bool = False
    top_k: int | None = None  # None: every example (one reference), else summary.top_k
    exact: bool = False
    candidates: int | None = None  # of --exact: None, CANDIDATES
    normalize: bool = False
    precondition: str | None = None

    @property
    def ranked(self) -> bool:
        return self.per_ref or self.exact or self.top_k is not None


def index_config(config: Path | Config | None, **overrides) -> Config:
    """The indexed model's config: ``config``, given on the command line (or by the API's
    caller), never the manifest's (an index is data; its config names code), command-line
    ``overrides`` on top."""
    if isinstance(config, Config):
        return with_overrides(config, **overrides)
    if config is None:
        raise ConfigError(
            "a query builds the model from --config only: an index is a data folder, and a "
            "query runs no code it names (its manifest's model.factory is not imported); pass "
            "--config with the config the index was built from",
            "--config",
        )
    return with_overrides(load_config(config), **overrides)


def check_model(shards: Shards, cfg: Config, exact: bool) -> None:
    """The model files, every other key that changes the gradients and, for ``exact``, the data
    must be the ones the index was built with."""
    one_checkpoint(cfg)
    indexed = shards.manifest["gradscope"]
    now = model_files(cfg)
    for key in sorted(set(indexed.get("model_files", {})) | set(now)):
        if indexed.get("model_files", {}).get(key) != now.get(key):
            raise DataError(
                f"{key} is not what the index was built from (its sha256 differs); rebuild the "
                "index or query it with the model it was built from",
                str(shards.path),
            )
    for key, value in gradient_keys(cfg).items():
        if indexed.get("gradients", {}).get(key) != value:
            raise ConfigError(
                f"{key} is not what the index was built with, so the gradients would differ; "
                "query with the config the index was built from, or build the index again",
                cfg.source or "--config",
            )
    built = indexed.get("data_sha256")  # None: data made by code, indexed before its rows had
    if exact and built is not None and built != _indexed_rows(cfg, shards):  # one: the losses
        raise DataError(
            "--exact reads the indexed examples again, but data.path has changed since the index "
            "was built (its sha256 differs)",
            str(shards.path),
        )


def _indexed_rows(cfg: Config, shards: Shards) -> str | None:
    """``data_identity`` of the rows the index holds: where code makes them, the first
    ``shards.rows`` (an index built with --limit), not the query's data.limit."""
    return data_identity(dataclasses.replace(cfg.data, limit=shards.rows))


def default_out(index: Path) -> str:
    return str(index.with_name(f"{index.name}.query.parquet"))


def run_query(
    index: str | Path,
    query: Query,
    out: str | None = None,
    *,
    config: Path | Config | None = None,
    device: str | None = None,
    batch_size: int | None = None,
    trust_checkpoint: bool = False,
) -> Path:
    """Score the index at ``index`` against ``query.ref`` and write the Parquet file ``out``."""
    distributed.one_process("gradscope query", "query")
    index = Path(index).resolve()  # (``.``: the index folder one is in)
    with Shards(index) as shards:
        return _query(shards, query, out, config, device, batch_size, trust_checkpoint)


def _query(
    shards: Shards, query: Query, out: str | None, config: Path | Config | None,
    device: str | None, batch_size: int | None, trust_checkpoint: bool,
) -> Path:  # fmt: skip
    cfg = index_config(config, device=device, batch_size=batch_size)
    out = Path(output_path(out, Path.cwd(), "--out") if out else default_out(shards.path))
    reads = [("INDEX", str(shards.path)), *data_inputs("--ref", query.ref)]
    if query.precondition:
        reads.append(("--precondition", query.precondition))
    check_output(out, run_inputs(cfg, reads), "query")
    check_counts(top_k=query.top_k)
    if query.candidates is not None and not query.exact:  # it ran as without it
        raise ConfigError(
            "--candidates sets how many --exact re-scores; pass --exact", "--candidates"
        )
    depth = CANDIDATES if query.candidates is None else query.candidates
    query = dataclasses.replace(query, candidates=depth)
    if query.candidates < 1:
        raise ConfigError(
            f"--candidates must be at least 1, got {query.candidates}", "--candidates"
        )
    check_model(shards, cfg, query.exact)
    with OutputLock(out):
        job = Job.from_config(cfg, trust_checkpoint)
        projector = Projector.of(
            shards.manifest["projection"], job.plan, job.device, accumulation_dtype(job.dtype)
        )
        made = {k: shards.manifest["gradscope"].get(k) for k in MADE}
        with job.engine:
            refs = References(job, query.ref, projector, query.per_ref, query.precondition, made)
            scores = Scores(shards, refs.projected(), query.normalize)
            table, found = _ranked(job, shards, scores, refs, query) if query.ranked else (
                _every(shards, scores), {}
            )  # fmt: skip
        metadata = _metadata(job, shards, query, refs.count, found)
        if cfg.output.metadata == "minimal":
            metadata = minimal(metadata)
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata, default=str)})
        replace_atomically(out, lambda f: pq.write_table(table, f))
    return out


def _leading(shards: Shards, rows: np.ndarray) -> dict[str, np.ndarray]:
    """example_id (and id, with data.ids) of the index rows ``rows``."""
    names = [n for n in ("example_id", "id") if n in shards.columns]
    ids = shards.ids(names)
    return {n: ids[n].take(pa.array(rows)).to_numpy(zero_copy_only=False) for n in names}


def _every(shards: Shards, scores: Scores) -> pa.Table:
    columns = _leading(shards, np.arange(shards.rows))
    columns["score"] = scores.every()
    return pa.table(columns)


def _ranked(
    job: Job, shards: Shards, scores: Scores, refs: References, query: Query
) -> tuple[pa.Table, dict]:
    """Each reference's top-k rows, ranked by the projected score or, with ``exact``, by the
    exact score of the top k * candidates; and what the re-ranking found."""
    k = query.top_k or job.cfg.summary.top_k
    values, rows = scores.top(k * query.candidates if query.exact else k)  # (M, R)
    values = torch.where(torch.isinf(values), torch.nan, values).double().cpu()
    rows = rows.cpu()
    example_ids = torch.tensor(_leading(shards, rows.flatten().numpy())["example_id"])
    found, exact = {}, None
    if query.exact:
        exact, loss = exact_scores(job, refs, example_ids.view(rows.shape), query.normalize)
        indexed = torch.from_numpy(shards.ids(["loss"])["loss"].to_numpy()).double()
        check_rows(indexed[rows], loss, job.dtype, "data.path")
        order, deepest = rerank(exact, k)  # (k, R) positions among the candidates
        found = {
            "candidates": rows.shape[0],
            "deepest_median": float(np.median(deepest)) + 1,
            "deepest_max": int(deepest.max()) + 1,
            "within_half": float(np.mean(deepest < rows.shape[0] / 2)),
        }
        values, rows, exact = (t.gather(0, order) for t in (values, rows, exact))
        projected_rank = order + 1
    m, r = rows.shape
    columns = {
        "ref_id": np.repeat(np.arange(r), m),
        "rank": np.tile(np.arange(1, m + 1), r),
        **_leading(shards, rows.T.flatten().numpy()),
        "score": values.T.flatten().numpy(),
    }
    if exact is not None:
        columns["exact"] = exact.T.flatten().numpy()
        columns["projected_rank"] = projected_rank.T.flatten().numpy()
    return pa.table(columns), found


def _metadata(job: Job, shards: Shards, query: Query, count: int, found: dict) -> dict:
    manifest = shards.manifest
    return {
        "version": __version__,
        "command": "query",
        "index": str(shards.path),
        "index_rows": shards.rows,
        "projection": {k: manifest["projection"][k] for k in ("dim", "seed", "width")},
        "config": job.cfg.to_dict(),
        "checkpoint_sha256": manifest["gradscope"].get("checkpoint_sha256"),
        "data_sha256": manifest["gradscope"].get("data_sha256"),  # the rows: a report's check
        "dtype": str(job.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "device": str(job.device),
        "query": dataclasses.asdict(query) | {"references": count},
        "ref_sha256": data_identity(job.cfg.data, query.ref),
        "exact": found,
    }


def shown(path: Path, references: int = 3) -> object:
    """What the terminal shows of a query's file: the outlier tables of its one score per
    example (its config's ``summary.top_k`` rows, else 20), or the rows of its first
    ``references`` references (each one's top k)."""
    from rich.console import Group
    from rich.table import Table

    from ..config import SummaryConfig
    from ..io.parquet import nested
    from ..summary import summarize
    from ..tables import fmt

    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    if "ref_id" not in table.schema.names:
        k = nested(meta, "config", "summary", "top_k")  # none where the metadata is minimal
        return summarize(path, "score", k if isinstance(k, int) else SummaryConfig.top_k)
    parts, refs = [], table.column("ref_id").to_numpy()
    names = [n for n in table.schema.names if n != "ref_id"]
    for r in np.unique(refs)[:references]:
        rows = table.filter(pa.compute.equal(table["ref_id"], r)).to_pydict()
        view = Table(title=f"reference {r}: top {len(rows['rank'])}")
        for name in names:
            view.add_column(name, justify="right")
        for i in range(len(rows["rank"])):
            view.add_row(*(fmt(rows[n][i]) for n in names))
        parts.append(view)
    found, count = meta["exact"], meta["query"]["references"]
    each = table.num_rows // max(count, 1)  # top k, or every example where there are fewer
    line = f"{count} reference{'s' if count != 1 else ''}, top {each} each"
    if found:
        line += (
            f"; exact top-{each} drawn from projected ranks up to {found['deepest_max']} of "
            f"{found['candidates']} candidates (median deepest {found['deepest_median']:g}); "
            f"within the first half for {found['within_half']:.0%} of references"
        )
    return Group(*parts, line)
