"""Write breast_cancer.npz from scikit-learn's copy of the Wisconsin breast cancer table
(569 rows, 30 features, 2 classes), which ships inside its package: no download.

    python benchmarks/data/make_cancer.py    # needs scikit-learn, e.g. a peers' environment
"""

from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer

x, y = load_breast_cancer(return_X_y=True)
np.savez_compressed(
    Path(__file__).with_name("breast_cancer.npz"), x=x.astype(np.float32), y=y.astype(np.int64)
)
