"""k3-numerics float64 reference model (the oracle) of three Kimi K3 paths.

Pure functions only: every tensor input must be float64 (checked), nothing is
modified in place, and state production mutates comes back as new tensors.
Nothing here imports `oracles` or `engines`.
"""


def drop_cached_constants() -> None:
    """Forget the constants the oracle caches per device (RoPE's inverse frequencies, the cache-write row
    bases): the next call computes them again from their CPU source. A kernel under test that wrote
    outside its buffers may have overwritten them in device memory (GPU run 53: a planted SGLang kernel's
    out-of-bounds stores reached the cached inverse frequencies, and a later, unrelated test's oracle read
    NaN); the harness calls this after every failed test (harness/isolation.py)."""
    from k3num.refmodel import mla, rope

    for cached in (rope._inv_freq_on, mla._layer_base, mla._ones_int32):
        cached.cache_clear()
