"""Defaults that measurement chooses (the LDS benchmarks, docs/benchmarks/attribution.md),
torch-free: ``--help`` shows them.

``CURVATURE`` is what ``influence`` scores against with no ``--curvature``: ``auto``, the exact
damped Gauss-Newton inverse fitted in the same run where its dense matrix fits, else EK-FAC
(``curvature/fitted.py``'s ``chosen``). On the three small benchmark settings it reaches the LDS of the
exact influence function at its best damping or within 0.04 of it (logistic regression on the
digits 0.908, their MLP 0.419 of 0.438, a regression 0.765), and on a tiny GPT-2 EK-FAC's 0.746
(whole blocks for its biases and norm scales; 0.702 before) is 0.95 of the exact one's 0.783
(conjugate gradients, damping 100), where the plain inner product (``none``) reaches 0.53,
0.18, 0.62 and 0.38. ``per_example_influence`` keeps the plain inner product unless told.

``DAMPING`` is lambda, per curvature, as a multiple of the curvature's mean eigenvalue (K-FAC:
of each factor's). For the exact curvatures the mean eigenvalue is their trace over P, which a
few large eigenvalues dominate (the digits MLP's GGN: max 6, mean 0.005, median 1e-6), so they
want more than kronfluence's 0.1: the best ``gn`` damping on the benchmarks is 1 (logistic
regression, regression) or 10 (the MLP, 0.96 of it at 1), but near 100 on the tiny GPT-2 (of
30, 100, 300 on 8 references; 10 well below); 30 for the Hessian, indefinite below it on the
digits MLP. 0.1 for the factored ones: the best on the MLP and the tiny GPT-2, where ``auto``
falls to EK-FAC; where every parameter is a whole block (the logistic regression) or most are
(the regression), the factors are the exact curvature and want its damping, 1 (EK-FAC 0.85 and
0.75 there against 0.71 and 0.65 at 0.1), but ``auto`` fits the dense inverse on those.

``CG_TOLERANCE`` is the relative residual at which conjugate gradients stop (``--cg-tolerance``):
close to the dense solve's round-off, so ``--solver cg`` gives the dense path's scores.
"""

CURVATURE = "auto"
CG_TOLERANCE = 1e-6
KRONFLUENCE = 0.1
DAMPING = {"gn": 1.0, "hessian": 30.0, "kfac": KRONFLUENCE, "ekfac": KRONFLUENCE}
