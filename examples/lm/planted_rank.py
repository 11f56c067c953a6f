"""Where the planted rows land in a scores file: counts among the top rows and the AUC, per kind.

    python examples/lm/planted_rank.py SCORES.parquet [COLUMN:low|high ...]

``high`` ranks the largest values first, ``low`` the smallest. Kinds are the ``kind`` column of
``data/``: duplicate (10 lines, 8 copies each) and corrupted (20 token-shuffled lines, 20 of
random characters).
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "digits"))
from flipped_rank import auc  # noqa: E402  (the same Mann-Whitney AUC as the digits example)


def kinds() -> np.ndarray:
    """The ``kind`` column of the save_to_disk folder, read as gradscope reads it: pyarrow."""
    with pa.memory_map(str(HERE / "data" / "data-00000-of-00001.arrow")) as source:
        return pa.ipc.open_stream(source).read_all().column("kind").to_numpy(zero_copy_only=False)


def main() -> None:
    frame = pd.read_parquet(sys.argv[1])
    specs = sys.argv[2:] or ["grad_norm:high", "loss:high", "loss:low"]
    kind = kinds()[frame["example_id"].to_numpy()]
    counts = {k: int((kind == k).sum()) for k in ("duplicate", "corrupted")}
    print(
        f"{len(frame)} rows; planted: {counts['duplicate']} duplicate, {counts['corrupted']} corrupted"
    )
    for spec in specs:
        column, _, direction = spec.partition(":")
        score = frame[column].to_numpy() * (-1 if direction == "low" else 1)
        order = np.argsort(-score, kind="stable")
        for name, n in counts.items():
            planted = kind == name
            top = ", ".join(f"top {k}: {planted[order[:k]].sum()}/{k}" for k in (n // 2, n, 2 * n))
            print(f"{column} ({direction} first), {name}: {top}; AUC {auc(score, planted):.4f}")


if __name__ == "__main__":
    main()
