"""The soak: the whole stack under continuous load, version bumps, Pod kills and operator restarts, judged on
failed requests, wrong versions, convergence after each fault, a liveness canary and flat resource use
(README.md). The scale measurement (scale.py) uses the same stack."""
