"""The oracle's own precision: refmodel against mpmath at 50 significant digits.

Inputs are float64; mpmath evaluates the same real-arithmetic definition
(projection, grouped RMSNorm, YaRN/plain RoPE in both pairings, the AttnRes
mixture with its output norm, the projected-context norm) with 50-digit
precision, so its result is the exact value to far below float64's unit
roundoff. The oracle must agree to a relative 1e-12 (entrywise where the
reference is not tiny, and normwise): that is ~4500 u64, room for the
reduction lengths used here (<= 64) under gamma_n.
"""

from __future__ import annotations

import mpmath
import pytest
import torch

from k3num.fixtures.tensors import Draw
from k3num.oracles.metrics import assert_normwise_close
from k3num.refmodel import attn_res, mla, partial_projection, rmsnorm, rope
from k3num.refmodel.geometry import RopeSpec, YarnScaling

mp = mpmath.mp
REL = 1e-12  # the target; see the module docstring for why it is generous
SPECS = [
    RopeSpec(8, 50000.0, "gptj", YarnScaling(4.0, 64)),
    RopeSpec(8, 10000.0, "neox", YarnScaling(40.0, 4096, 16.0, 2.0, 0.707, 1.0)),
    RopeSpec(6, 50000.0, "gptj", None),
]


def _mpf(t: torch.Tensor) -> list:
    return [mpmath.mpf(v) for v in t.flatten().tolist()]


def _assert_close(got: torch.Tensor, want: list, what: str) -> None:
    ref = torch.tensor([float(v) for v in want], dtype=torch.float64).view(got.shape)
    assert_normwise_close(got, ref, REL, what)
    big = ref.abs() > 1e-3 * ref.abs().max()
    rel = ((got - ref).abs() / ref.abs())[big]
    assert float(rel.max()) <= REL, f"{what}: entrywise relative error {float(rel.max()):.3e}"


def _mp_rms(row: list, w: list, eps: float) -> list:
    ms = mpmath.fsum(v * v for v in row) / len(row)
    r = 1 / mpmath.sqrt(ms + mpmath.mpf(eps))
    return [v * r * wi for v, wi in zip(row, w)]


def _mp_inv_freq(spec: RopeSpec) -> list:
    d, base = spec.rotary_dim, mpmath.mpf(spec.theta)
    ext = [1 / base ** (mpmath.mpf(2 * i) / d) for i in range(d // 2)]
    if spec.yarn is None:
        return ext
    y = spec.yarn
    low, high = rope.correction_range(spec)  # integers by construction (truncated)
    hi = high + mpmath.mpf("0.001") if low == high else mpmath.mpf(high)
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / (hi - low), 0), 1)
        keep = 1 - ramp
        out.append(ext[i] / mpmath.mpf(y.factor) * (1 - keep) + ext[i] * keep)
    return out


def _mp_scale(spec: RopeSpec) -> mpmath.mpf:
    y = spec.yarn
    if y is None:
        return mpmath.mpf(1)

    def m(scale: float, ms: float) -> mpmath.mpf:
        return mpmath.mpf(1) if scale <= 1 else mpmath.mpf("0.1") * ms * mpmath.log(scale) + 1

    return m(y.factor, y.mscale) / m(y.factor, y.mscale_all_dim)


def _mp_rope(vec: list, pos: int, spec: RopeSpec) -> list:
    d, f, m = spec.rotary_dim, _mp_inv_freq(spec), _mp_scale(spec)
    out = list(vec)
    for i in range(d // 2):
        a_i, b_i = (2 * i, 2 * i + 1) if spec.style == "gptj" else (i, i + d // 2)
        c, s = mpmath.cos(pos * f[i]) * m, mpmath.sin(pos * f[i]) * m
        out[a_i], out[b_i] = vec[a_i] * c - vec[b_i] * s, vec[b_i] * c + vec[a_i] * s
    return out


@pytest.fixture(autouse=True)
def _fifty_digits():
    with mpmath.workdps(50):
        yield


@pytest.mark.parametrize("spec", SPECS, ids=["gptj-yarn", "neox-yarn-mscale", "gptj-plain-partial"])
def test_apply_rope_agrees_with_mpmath(spec: RopeSpec) -> None:
    d = Draw(1)
    x = d.normal((5, spec.rotary_dim + 2))
    pos = d.integers(0, 5000, (5,))
    got = rope.apply_rope(x, pos, spec)
    want = []
    for n in range(5):
        want += _mp_rope(_mpf(x[n]), int(pos[n]), spec)
    _assert_close(got, want, "apply_rope")


def test_grouped_rms_norm_agrees_with_mpmath() -> None:
    d = Draw(2)
    x, w = d.normal((3, 4, 24), outliers=50.0), d.positive((3, 24))
    got = rmsnorm.rms_norm(x, w, 1e-5)
    want = []
    for g in range(3):
        for n in range(4):
            want += _mp_rms(_mpf(x[g, n]), _mpf(w[g]), 1e-5)
    _assert_close(got, want, "grouped rms_norm")


@pytest.mark.parametrize("spec", SPECS[:2], ids=["gptj-yarn", "neox-yarn-mscale"])
def test_context_kv_agrees_with_mpmath(spec: RopeSpec) -> None:
    d = Draw(3)
    n, h, kv_lora, L = 3, 32, 8, 2
    x = d.normal((n, h))
    w = d.normal((L, kv_lora + spec.rotary_dim, h), h**-0.5)
    nw = d.positive((L, kv_lora))
    pos = d.integers(0, 200, (n,))
    kv_c, k_pe = mla.context_kv(x, w, nw, pos, spec, 1e-5)
    want_c, want_pe = [], []
    for layer in range(L):
        for t in range(n):
            xs = _mpf(x[t])
            row = [mpmath.fsum(a * b for a, b in zip(xs, _mpf(w[layer, j]))) for j in range(w.shape[1])]
            want_c += _mp_rms(row[:kv_lora], _mpf(nw[layer]), 1e-5)
            want_pe += _mp_rope(row[kv_lora:], int(pos[t]), spec)
    _assert_close(kv_c, want_c, "kv_c")
    _assert_close(k_pe, want_pe, "k_pe")


def test_attn_res_with_output_norm_agrees_with_mpmath() -> None:
    d = Draw(4)
    t, nb, h = 3, 4, 16
    prefix, delta, blocks = d.normal((t, h)), d.normal((t, h)), d.normal((t, nb, h), outliers=20.0)
    nw, qk, ow = d.positive((h,)), d.normal((h,)), d.positive((h,))
    out, _, _ = attn_res.attn_res(prefix, delta, blocks, nw, qk, ow, 3, 3, 1e-5, 1e-6)
    q = [a * b for a, b in zip(_mpf(nw), _mpf(qk))]
    want = []
    for row in range(t):
        p = [a + b for a, b in zip(_mpf(prefix[row]), _mpf(delta[row]))]
        sources = [_mpf(blocks[row, j]) for j in range(3)] + [p]
        logits = [
            mpmath.fsum(a * b for a, b in zip(v, q)) / mpmath.sqrt(mpmath.fsum(a * a for a in v) / h + mpmath.mpf(1e-5))
            for v in sources
        ]
        mx = max(logits)
        e = [mpmath.exp(lg - mx) for lg in logits]
        z = mpmath.fsum(e)
        mixed = [mpmath.fsum(e[j] / z * sources[j][k] for j in range(len(sources))) for k in range(h)]
        want += _mp_rms(mixed, _mpf(ow), 1e-6)
    _assert_close(out, want, "attn_res")


def test_project_context_agrees_with_mpmath() -> None:
    d = Draw(5)
    k, n, h, h_out = 3, 2, 8, 10
    taps, fc, nw = d.normal((k, n, h)), d.normal((h_out, k * h)), d.positive((h_out,))
    got = partial_projection.project_context(taps, fc, nw, 1e-5, [[2], [], [0, 1]])
    want = []
    for t in range(n):
        cat = sum((_mpf(taps[i, t]) for i in range(k)), [])
        row = [mpmath.fsum(a * b for a, b in zip(cat, _mpf(fc[j]))) for j in range(h_out)]
        want += _mp_rms(row, _mpf(nw), 1e-5)
    _assert_close(got, want, "project_context")
