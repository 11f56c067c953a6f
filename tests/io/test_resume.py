"""Interrupted runs: Ctrl-C and kill -9 leave whole parts behind, and --resume completes the file."""

from __future__ import annotations

import dataclasses
import os
import signal

import pandas as pd
import pytest
import torch
from project import (
    ROWS_PY,
    CountingNorms,
    edit_config,
    edit_data,
    launch,
    made_by_code,
    make_project,
    slow_project,
    wait_for_parts,
)

from gradscope.config import load_config
from gradscope.errors import ConfigError, Interrupted
from gradscope.io.parquet import partial_path, read_metadata
from gradscope.run import score_dataset
from gradscope.scorers import InfluenceScorer


def finished(config, out):
    cfg = load_config(config)
    return score_dataset(
        dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, path=str(out)))
    )


def test_resume_after_interrupt_equals_uninterrupted(tmp_path):
    config = make_project(tmp_path, n=23, data__ids="name")
    cfg = load_config(config)
    with pytest.raises(Interrupted, match="3 examples saved|12 examples saved"):
        score_dataset(cfg, CountingNorms(stop=3))
    out = tmp_path / "scores.parquet"
    assert not out.exists() and len(list(partial_path(out).glob("part-*.parquet"))) == 3
    (partial_path(out) / "part-000000004.parquet.tmp").write_bytes(b"torn")  # killed mid-write
    rescoring = CountingNorms()
    score_dataset(cfg, rescoring, resume=True)
    assert rescoring.scored == [12, 16, 20]  # batches 3, 4, 5 of 6
    assert not partial_path(out).exists()
    expected = finished(config, tmp_path / "whole.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(expected), check_exact=True)
    same = {k: read_metadata(out)[k] for k in ("config", "seconds")}  # seconds: wall time
    assert read_metadata(out) == read_metadata(expected) | same


@pytest.mark.parametrize("change", ["batch_size", "checkpoint"])
def test_resume_with_another_config_or_checkpoint_is_refused(tmp_path, change):
    config = make_project(tmp_path, n=23)
    cfg = load_config(config)
    with pytest.raises(Interrupted):
        score_dataset(cfg, CountingNorms(stop=2))
    if change == "batch_size":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=5))
        message = r"had a different config\.data\.batch_size"
    else:
        state = torch.load(tmp_path / "net.pt")
        state["fc1.bias"] += 1
        torch.save(state, tmp_path / "net.pt")
        message = "had a different file .*net.pt"
    with pytest.raises(ConfigError, match=message):
        score_dataset(cfg, resume=True)
    score_dataset(cfg)  # without --resume: starts over
    assert len(pd.read_parquet(tmp_path / "scores.parquet")) == 23


def test_a_file_restored_to_the_same_bytes_resumes(tmp_path):
    """A checkpoint copied back (another mtime, the same bytes) is the same file."""
    config = make_project(tmp_path, n=23)
    cfg = load_config(config)
    with pytest.raises(Interrupted):
        score_dataset(cfg, CountingNorms(stop=2))
    kept = (tmp_path / "net.pt").read_bytes()
    (tmp_path / "net.pt").write_bytes(kept)
    os.utime(tmp_path / "net.pt", ns=(1, 1))
    rescoring = CountingNorms()
    score_dataset(cfg, rescoring, resume=True)
    assert len(rescoring.scored) == 4  # batches 2 to 5 of 6


def test_ctrl_c_then_kill_9_then_resume(tmp_path):
    config = slow_project(tmp_path)
    out = tmp_path / "scores.parquet"
    proc = launch(config)
    wait_for_parts(out, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: interrupted with") and "--resume" in line, stderr
    proc = launch(config, "--resume")
    wait_for_parts(out, 8, proc)
    proc.kill()  # SIGKILL: no clean-up at all
    proc.wait(timeout=30)
    assert not out.exists()
    cfg = load_config(config)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=2))
    score_dataset(cfg, resume=True)
    whole = score_dataset(
        dataclasses.replace(
            cfg, output=dataclasses.replace(cfg.output, path=str(tmp_path / "whole.parquet"))
        )
    )
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(whole))


def stop_after(batches: int):
    """An on_batch callback interrupted (as by Ctrl-C) once ``batches`` batches are saved."""
    seen = []

    def on_batch(n: int) -> None:
        seen.append(n)
        if len(seen) == batches:
            raise KeyboardInterrupt

    return on_batch


def test_influence_resume_equals_uninterrupted_and_needs_the_same_ref(tmp_path):
    config = make_project(tmp_path, n=23)
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    cfg = load_config(config)
    ref = tmp_path / "ref.pt"
    with pytest.raises(Interrupted):
        score_dataset(cfg, InfluenceScorer(ref, curvature="none"), on_batch=stop_after(2))
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref2.pt")
    with pytest.raises(ConfigError, match="had a different ref, file .*ref.pt, file .*ref2.pt"):
        score_dataset(cfg, InfluenceScorer(tmp_path / "ref2.pt", curvature="none"), resume=True)
    out = score_dataset(cfg, InfluenceScorer(ref, curvature="none"), resume=True)
    whole = score_dataset(
        dataclasses.replace(
            cfg, output=dataclasses.replace(cfg.output, path=str(tmp_path / "w.parquet"))
        ),
        InfluenceScorer(ref, curvature="none"),
    )
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(whole), check_exact=True)
    assert read_metadata(out)["influence"] == read_metadata(whole)["influence"]


def test_resume_over_data_made_by_code_checks_the_rows_it_kept(tmp_path):
    """``file.py:fn`` data: no file's hash holds the rows the code makes (here from a file it
    reads), so each part holds its batch's sha256, and a resume over other rows is refused."""
    config = make_project(tmp_path, n=23, data__ids="name")
    edit_config(tmp_path, lambda c: c["data"].update(path=made_by_code(tmp_path)))
    cfg = load_config(config)
    with pytest.raises(Interrupted):
        score_dataset(cfg, CountingNorms(stop=3))
    rows = torch.load(tmp_path / "data.pt")
    edit_data(tmp_path, lambda d: d["x"][5].add_(1))  # a row of batch 1, which a part holds
    with pytest.raises(ConfigError, match="batch 1's rows differ from those the interrupted run"):
        score_dataset(cfg, resume=True)
    torch.save(rows, tmp_path / "data.pt")
    out = score_dataset(cfg, resume=True)
    whole = finished(config, tmp_path / "w.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(whole), check_exact=True)


def test_influence_resume_needs_the_rows_a_reference_made_by_code_makes(tmp_path):
    """``--ref ref.py:make`` reading a file no config names: the rows it makes are part of the
    fingerprint, or a resume would score the rest against other references."""
    config = make_project(tmp_path, n=23)
    (tmp_path / "ref.py").write_text(ROWS_PY.replace("data.pt", "refrows.pt"))
    g = torch.Generator().manual_seed(3)
    torch.save({"x": torch.randn(3, 5, generator=g), "y": torch.arange(3)}, tmp_path / "refrows.pt")
    cfg = load_config(config)
    ref = f"{tmp_path}/ref.py:make"
    with pytest.raises(Interrupted):
        score_dataset(cfg, InfluenceScorer(ref, curvature="none"), on_batch=stop_after(2))
    torch.save({"x": torch.randn(3, 5, generator=g), "y": torch.arange(3)}, tmp_path / "refrows.pt")
    with pytest.raises(ConfigError, match="had a different ref made by code"):
        score_dataset(cfg, InfluenceScorer(ref, curvature="none"), resume=True)
