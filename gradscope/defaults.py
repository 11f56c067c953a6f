"""Defaults that measurement chooses (the LDS benchmarks), torch-free: ``--help`` shows them.

``CURVATURE`` is what ``influence`` (CLI and ``per_example_influence``) scores against with no
``--curvature``: ``none`` is the plain inner product ``<g_i, g_ref>``; ``gn`` the exact damped
Gauss-Newton inverse fitted in the same run. ``DAMPING`` is lambda as a multiple of the
curvature's mean eigenvalue (kronfluence's heuristic, 0.1), for every curvature.
"""

CURVATURE = "none"
DAMPING = 0.1
