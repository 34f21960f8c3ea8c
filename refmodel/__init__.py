"""k3-numerics float64 reference model (the oracle) of three Kimi K3 paths.

Pure functions only: every tensor input must be float64 (checked), nothing is
modified in place, and state production mutates comes back as new tensors.
Nothing here imports `oracles` or `engines`.
"""
