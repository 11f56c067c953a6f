"""`gradscope index` and `gradscope query` end to end: scores against the float64 loop (exact
where the index keeps every number, the projected definition where it compresses, --exact)."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import reference_influence
from project import load_net
from runs import N, close, index, loop, manifest, projected_loop, query, refused, run

from gradscope.io.parquet import read_metadata


def test_an_index_that_keeps_every_number_queries_to_the_exact_influence(project):
    """At the default dim this model's blocks keep every number: the index is exact."""
    ix = index(project, "--storage", "float32")
    blocks = manifest(ix)["projection"]["blocks"]
    assert all(b["k_out"] * b["k_in"] == math.prod(b["shape"]) for b in blocks)
    frame = query(project, ix)
    net, x, y = load_net(project)
    ref = torch.load(project / "ref.pt")
    expected, _, _ = reference_influence(net, (x,), y, ((ref["x"],), ref["y"]), "cross_entropy")
    assert list(frame.columns) == ["example_id", "score"]
    assert frame["example_id"].tolist() == list(range(N))
    close(frame["score"], expected[:, 0], 1e-6)
    one = {k: v[:1] for k, v in torch.load(project / "ref.pt").items()}
    torch.save(one, project / "one.pt")
    shown = run("query", ix, "--ref", project / "one.pt", "--config", project / "config.yaml",
                "--per-ref", "--out", project / "one.parquet")  # fmt: skip
    assert "1 reference, top 10 each" in shown  # of the 10 examples, not "top 20"


@pytest.mark.parametrize("normalize", [False, True])
def test_compressed_scores_are_the_projected_definition(project, normalize):
    ix = index(project, "--dim", 4, "--storage", "float32", "--seed", 7)
    phi, psi = projected_loop(project, ix)
    assert phi.shape[1] < sum(g[0].numel() for g in loop(project)[0].values())
    flag = ["--normalize"] if normalize else []
    frame = query(project, ix, "--per-ref", "--top-k", N, *flag)
    expected = phi @ psi.T  # (N, K)
    if normalize:
        expected = expected / (phi.norm(dim=1)[:, None] * psi.norm(dim=1)[None])
    for r, rows in frame.groupby("ref_id"):
        assert rows["rank"].tolist() == list(range(1, N + 1))
        close(rows["score"], expected[rows["example_id"].to_numpy(), r], 1e-6)
        assert rows["score"].is_monotonic_decreasing


def test_exact_rescores_candidates_with_the_loops_scores(project):
    """--exact: each candidate's exact score is the loop's, and with every example a candidate
    the top-k is the loop's top-k."""
    ix = index(project, "--dim", 4, "--storage", "float32")
    net, x, y = load_net(project)
    ref = torch.load(project / "ref.pt")
    truth, _, _ = reference_influence(
        net, (x,), y, ((ref["x"],), ref["y"]), "cross_entropy", per_ref=True
    )  # (N, K)
    few = query(project, ix, "--per-ref", "--exact", "--top-k", 2, "--candidates", 2)
    assert set(few.columns) >= {"ref_id", "rank", "example_id", "score", "exact", "projected_rank"}
    close(few["exact"], truth[few["example_id"], few["ref_id"]], 1e-9)
    every = query(project, ix, "--per-ref", "--exact", "--top-k", 3, "--candidates", 4)
    for r, rows in every.groupby("ref_id"):
        assert rows["example_id"].tolist() == truth[:, r].argsort(descending=True)[:3].tolist()
    assert read_metadata(project / "q.parquet")["exact"]["candidates"] == N


def test_an_exact_query_is_shown_and_summarised_by_its_exact_score(project):
    """The query's table took 20 rows where its config says summary.top_k, and said "exact
    top-20" of a file of three; `summary` and `report` of an --exact file ranked by the
    projected score and left the exact one out."""
    config = project / "config.yaml"
    config.write_text(config.read_text() + "summary:\n  top_k: 3\n")
    ix = index(project, "--dim", 2, "--storage", "float32")
    shown = run("query", ix, "--ref", project / "ref.pt", "--config", config, "--exact",
                "--candidates", 3, "--out", project / "q.parquet")  # fmt: skip
    assert "1 reference, top 3 each; exact top-3 drawn from" in " ".join(shown.split())
    summary = run("summary", project / "q.parquet")
    assert "outliers by exact" in summary and "outliers by score" not in summary
    mean = run("query", ix, "--ref", project / "ref.pt", "--config", config, "--out",
               project / "m.parquet")  # fmt: skip
    assert "top 3 outliers by score" in mean


def test_candidates_without_exact_is_refused(project, monkeypatch, capsys):
    """--candidates sets what --exact re-scores: without it the query ran as if not given."""
    ix = index(project, "--dim", 4)
    err = refused(monkeypatch, capsys, project, ix, "--candidates", 5)
    assert "--candidates sets how many --exact re-scores; pass --exact" in err


def test_exact_cosine_of_the_mean_reference(project):
    ix = index(project, "--dim", 4)
    net, x, y = load_net(project)
    ref = torch.load(project / "ref.pt")
    inner, g_norm, r_norm = reference_influence(net, (x,), y, ((ref["x"],), ref["y"]),
                                                "cross_entropy")  # fmt: skip
    cosine = inner[:, 0] / (g_norm * r_norm[0])
    frame = query(project, ix, "--exact", "--normalize", "--top-k", 4, "--candidates", 3)
    assert frame["ref_id"].unique().tolist() == [0]
    close(frame["exact"], cosine[frame["example_id"]], 1e-9)
    assert frame["exact"].is_monotonic_decreasing


def test_precondition_is_applied_to_the_references(project):
    net, _, _ = load_net(project)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(5, 5)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), project / "adam.pt")
    ix = index(project, "--storage", "float32")  # every number kept: the exact scores
    frame = query(project, ix, "--precondition", project / "adam.pt")
    denominators = {}
    for (name, _), state in zip(net.named_parameters(), opt.state.values(), strict=True):
        v_hat = state["exp_avg_sq"].double() / (1 - 0.999 ** float(state["step"]))
        denominators[name] = v_hat.sqrt() + 1e-8
    net, x, y = load_net(project)
    ref = torch.load(project / "ref.pt")
    expected, _, _ = reference_influence(net, (x,), y, ((ref["x"],), ref["y"]), "cross_entropy",
                                         denominators=denominators)  # fmt: skip
    close(frame["score"], expected[:, 0], 1e-6)
