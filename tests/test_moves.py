"""The walk of a config from ``score_dataset`` to the part file it writes takes no more moves
than before the index came (commit a3089ab): five gradscope frames between them
(``benchmarks/moves.py`` counts them on the bundled example, today and at any commit)."""

from __future__ import annotations

from moves import Walk
from project import make_project

import gradscope

DEPTH = 5  # _score, Parts.write, PartialRun.write, replace_atomically, its lambda


def test_score_dataset_reaches_its_part_files_in_no_more_moves(tmp_path):
    config = make_project(tmp_path, n=6)
    out = tmp_path.resolve() / "scores.parquet"
    with Walk(str(out)) as walk:
        gradscope.norms(config, out=out)
    assert walk.depths, "no part file was written under score_dataset"
    assert max(walk.depths) <= DEPTH, (
        f"{max(walk.depths)} gradscope frames between score_dataset and a part file's write, "
        f"{DEPTH} before the index: a layer that only forwards its arguments?"
    )
