"""Export scikit-learn's diabetes table (442 rows x 10 features) to data/diabetes.npz, once.

The only file here that needs scikit-learn (its package data; no download): run it with a venv
that has it, e.g. ``/work/peers-venv/bin/python benchmarks/attribution/export_diabetes.py``.
make_data.py reads the .npz.
"""

from pathlib import Path

import numpy as np
from sklearn.datasets import load_diabetes

HERE = Path(__file__).resolve().parent


def main() -> None:
    table = load_diabetes()
    x, y = table.data.astype(np.float64), table.target.astype(np.float64)  # (442, 10), (442,)
    np.savez_compressed(HERE / "data" / "diabetes.npz", x=x, y=y)
    print(f"diabetes {x.shape}")


if __name__ == "__main__":
    main()
