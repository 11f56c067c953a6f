"""The benchmark's settings: each config (with its ``train:`` recipe) and references, the
curvatures and dampings gradscope fits on it, and each peer's grid of its knob, the first
entry the peer's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DAMPINGS = (0.001, 0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class Bench:
    """A setting: its config (with a ``train:`` recipe), its references, the curvatures
    gradscope fits on it and each peer's option sets (the first: the peer's defaults)."""

    config: Path
    ref: Path
    curvatures: tuple[str, ...] = ("gn", "hessian", "kfac", "ekfac")
    dampings: tuple[float, ...] = DAMPINGS
    peers: dict[str, list[dict]] = field(default_factory=dict)
    cg_dampings: tuple[float, ...] = ()  # gn by conjugate gradients: where dense does not fit


def _grid(key: str, values, **fixed) -> list[dict]:
    return [{**fixed, key: v} for v in values]


CLASSIFIER_PEERS = {
    "trak": [
        {},
        *_grid("lambda_reg", (1e-3, 1e-2, 1e-1, 1.0, 10.0), proj_dim=512),
        *_grid("lambda_reg", (1.0, 10.0), proj_dim=512, over="epochs"),
    ],  # fmt: skip
    "kronfluence": [{}, {"damping": None}, *_grid("damping", (1e-3, 1e-2, 1e-1))],
    "dattri": [{}, *_grid("regularization", (1e-3, 1e-2, 1e-1, 1.0))],
}
# dattri's explicit IF on the MLP's 9,034 parameters ran over 8 CPU minutes for one
# regularisation, unfinished (the Hessian alone takes about a minute): the MLP runs TRAK and
# kronfluence only.
# TRAK's best on the MLP sat at the edge of that grid (lambda_reg 10 over epochs): the grid goes
# on past it, and to a projection of 2048 (its default; ridged, no longer singular).
MLP_PEERS = {
    "trak": [
        *CLASSIFIER_PEERS["trak"],
        *_grid("lambda_reg", (30.0, 100.0), proj_dim=512, over="epochs"),
        *_grid("lambda_reg", (30.0, 100.0, 300.0), proj_dim=2048, over="epochs"),
    ],
    "kronfluence": CLASSIFIER_PEERS["kronfluence"],
}
SETTINGS = {
    "digits_linear": Bench(
        HERE / "configs/digits_linear.yaml", HERE / "data/digits_ref.pt", peers=CLASSIFIER_PEERS
    ),  # fmt: skip
    "digits_mlp": Bench(
        HERE / "configs/digits_mlp.yaml", HERE / "data/digits_ref.pt", peers=MLP_PEERS
    ),  # fmt: skip
    "diabetes": Bench(
        HERE / "configs/diabetes.yaml",
        HERE / "data/diabetes_ref.pt",
        peers={k: CLASSIFIER_PEERS[k] for k in ("kronfluence", "dattri")},
    ),  # fmt: skip
    "lm": Bench(
        HERE / "configs/lm.yaml",
        HERE / "data/lm_ref.parquet",
        curvatures=("kfac", "ekfac"),
        # the exact influence function: CG over all 136,960 parameters, 64 references a pass
        # (~28 s of CPU); at 10 x the mean eigenvalue its residual fell 2.2 -> 0.3 in 18
        # iterations (2 references), so some 130 to 1e-6: about an hour of CPU. Smaller
        # dampings converge slower still (1: 2.2 -> 1.5 in 18).
        cg_dampings=(10.0,),
        peers={
            "kronfluence": CLASSIFIER_PEERS["kronfluence"][:2],
            "bergson": [
                {},
                *_grid("projection_dim", (64, 256)),
                {"projection_dim": 256, "cosine": True},
            ],
        },
    ),  # fmt: skip
}
