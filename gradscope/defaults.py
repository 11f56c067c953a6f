"""Defaults that measurement chooses (the LDS benchmarks), torch-free: ``--help`` shows them.

``CURVATURE`` is what ``influence`` (CLI and ``per_example_influence``) scores against with no
``--curvature``: ``none`` is the plain inner product ``<g_i, g_ref>``; ``gn`` the exact damped
Gauss-Newton inverse fitted in the same run. ``DAMPING`` is lambda, per curvature, as a multiple
of the curvature's mean eigenvalue (K-FAC: of each factor's): kronfluence's heuristic, 0.1, for
the factored ones; 10 for the Gauss-Newton matrix, where the digits MLP's LDS (40 random
halves) peaks: 0.36 at 0.1, 0.54 at 1, 0.64 at 10, 0.62 at 30, 0.54 at 100 (EK-FAC: 0.55-0.57
from 0.001 to 10; the plain inner product 0.35); 30 for the Hessian, indefinite there below it
(LDS 0.62 at 30, 0.54 at 100). The mean eigenvalue of an exact curvature is its trace over P,
dominated by a few large eigenvalues (the digits: max 6, mean 0.005, median 1e-6).
"""

CURVATURE = "none"
KRONFLUENCE = 0.1
DAMPING = {"gn": 10.0, "hessian": 30.0, "kfac": KRONFLUENCE, "ekfac": KRONFLUENCE}
