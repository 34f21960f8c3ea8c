"""The tolerance doctrine (BRIEF §5): every budget of the project, derived here.

Two rules:
1. Baseline-relative (FlashAttention's): err(subject) <= c * err(baseline) +
   one rounding at the output's magnitude, both errors measured against the
   float64 oracle on identical (already quantised) inputs.
2. Theory caps for a reduction of length n in unit roundoff u:
   deterministic gamma_n = n u / (1 - n u) (Higham, "Accuracy and Stability of
   Numerical Algorithms", Lemma 3.1), and the probabilistic lambda sqrt(n) u
   (Higham & Mary 2019, "A New Approach to Probabilistic Rounding Error
   Analysis", Thm 2.4: it holds with probability >= 1 - 2n exp(-lambda^2/2)).
No test carries a bare tolerance: it asks this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Unit roundoff u = 2^-p for a p-bit significand (implicit bit included), round to nearest.
UNIT_ROUNDOFF: dict[torch.dtype | str, float] = {
    torch.bfloat16: 2.0**-8,  # 8-bit significand
    torch.float16: 2.0**-11,  # 11-bit significand
    "tf32": 2.0**-11,  # 10 stored + 1 implicit bits
    torch.float32: 2.0**-24,  # 24-bit significand
    torch.float64: 2.0**-53,  # 53-bit significand
    torch.float8_e4m3fn: 2.0**-4,  # 3 stored + 1 implicit
    torch.float8_e5m2: 2.0**-3,  # 2 stored + 1 implicit
    "e2m1": 2.0**-2,  # 1 stored + 1 implicit
}
U64 = UNIT_ROUNDOFF[torch.float64]
U32 = UNIT_ROUNDOFF[torch.float32]

# lambda of the probabilistic bound: with lambda = 8 a length-n dot fails it with
# probability <= 2 n exp(-lambda^2 / 2) = 2.5e-14 n, i.e. 1.8e-10 at n = 7168, so a
# nightly run of ~10^6 such dots stays below 1e-3 in total.
LAMBDA = 8.0

# c of the baseline-relative rule: 2, FlashAttention's choice (BRIEF §5): a
# subject may be twice as far from float64 as the plain low-precision path.
BASELINE_FACTOR = 2.0


def unit_roundoff(dtype: torch.dtype | str, rounding: str = "nearest") -> float:
    """u of the dtype; rounding "toward_zero" (truncation, e.g. the Triton CPU interpreter's
    float -> bf16 conversion) has twice the error of round-to-nearest: a full ulp, 2u."""
    try:
        u = UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"dtype: no unit roundoff known for {dtype}") from None
    if rounding not in ("nearest", "toward_zero"):
        raise ValueError(f"rounding: expected 'nearest' or 'toward_zero', got {rounding!r}")
    return 2 * u if rounding == "toward_zero" else u


def gamma(n: int, u: float) -> float:
    """Deterministic bound gamma_n = n u / (1 - n u) on a length-n reduction's relative error."""
    if n * u >= 1.0:
        return math.inf
    return n * u / (1.0 - n * u)


def probabilistic(n: int, u: float, lam: float = LAMBDA) -> float:
    """Higham & Mary's lambda sqrt(n) u (to first order) for a length-n reduction."""
    return lam * math.sqrt(max(n, 1)) * u


def identity_rtol(n: int, u: float) -> float:
    """Normwise relative tolerance for two evaluations (unit roundoff u) of one identity
    whose longest reduction has length n: each side is within probabilistic(n, u),
    so the difference is within twice that, plus 8 u for the few scalar
    roundings of a norm and a rotation (rsqrt, mean, two products, a sum)."""
    return 2.0 * probabilistic(n, u) + 8.0 * u


def fp32_angle_rope_rtol(theta_max: float) -> float:
    """Normwise relative tolerance for a rotation whose angles were computed in fp32.

    An fp32 angle p * inv_freq carries <= 4 u32 |theta| absolute error (pow,
    reciprocal and ramp blend of inv_freq: 3 roundings; the product: 1), and
    fp32 cos/sin one more u32. A rotated pair (a, b) then errs by <= (|a| + |b|)
    (4 theta + 1) u32, and |a| + |b| <= 2 max|output| (a rotation preserves the
    pair norm), hence 2 (4 theta_max + 1) u32.
    """
    return 2.0 * (4.0 * theta_max + 1.0) * U32


def f64_identity_rtol(n: int) -> float:
    """identity_rtol in float64; for n = 7168 it is 1.5e-13 ("about 1e-13")."""
    return identity_rtol(n, U64)


def baseline_budget(err_baseline: float, out_magnitude: float, dtype: torch.dtype) -> float:
    """Rule 1: c * err(baseline) + one rounding (u of the output dtype) at the output's magnitude."""
    return BASELINE_FACTOR * err_baseline + unit_roundoff(dtype) * out_magnitude


@dataclass(frozen=True)
class Budget:
    """An error budget (absolute, in max-abs terms) and the rule that produced it."""

    value: float
    rule: str
    baseline_err: float = math.nan


def baseline_rule(
    err_baseline: float, ref_max: float, out_dtype: torch.dtype, *, extra: float = 0.0, extra_rule: str = ""
) -> Budget:
    """Rule 1 with c = BASELINE_FACTOR, plus an optional derived `extra` term (named in extra_rule)."""
    value = baseline_budget(err_baseline, ref_max, out_dtype) + extra
    rule = f"{BASELINE_FACTOR:g}*err(baseline)+u({_name(out_dtype)})*max|ref|"
    if extra_rule:
        rule += f"+{extra_rule}"
    return Budget(value, rule, err_baseline)


def theory_rule(ref_max: float, out_dtype: torch.dtype, roundings: int, *, acc_term: float = 0.0,
                acc_rule: str = "", rounding: str = "nearest") -> Budget:
    """Rule 2: `roundings` roundings to the output dtype at the output's magnitude, plus the
    accumulation term of the reductions (a probabilistic() bound, named in acc_rule). `rounding`
    is the subject platform's rounding mode (see unit_roundoff); GPU and torch round to nearest."""
    value = roundings * unit_roundoff(out_dtype, rounding) * ref_max + acc_term
    mode = "" if rounding == "nearest" else f",{rounding}"
    rule = f"{roundings}*u({_name(out_dtype)}{mode})*max|ref|" + (f"+{acc_rule}" if acc_rule else "")
    return Budget(value, rule)


def rounded_once_rtol(out_dtype: torch.dtype, eps32: float) -> float:
    """Elementwise relative bound for an fp32 computation rounded once to out_dtype.

    The fp32 result y is within eps32 |ref| of the float64 oracle (the caller derives eps32 from
    the op's fp32 steps), and one round-to-nearest adds u |y| <= u (1 + eps32) |ref|, so
    |out - ref| <= (u + (1 + u) eps32) |ref|. A second rounding to out_dtype can double the u term,
    which this bound does not admit."""
    u = unit_roundoff(out_dtype)
    return u + (1.0 + u) * eps32


def half_spacing(v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Half the distance between the out_dtype numbers around each |v| (float64, v's shape): the most a
    round-to-nearest of v into out_dtype can err, subnormals included (their spacing is the smallest normal
    times eps). Sharper than u |v| by up to 2x inside a binade, and it does not vanish at zero; a second
    rounding through a wider format on the way can exceed it by that format's half spacing (the double rounding
    an elementwise check of "rounded once, to nearest" must see). Half of metrics.ulp_of's spacing, but its binade
    taken exactly (frexp): ulp_of's floor(log2 |v|) can round a value just below a power of two up a binade,
    which would admit twice the error there."""
    fi = torch.finfo(out_dtype)
    mag = v.abs().double()
    _, exp = torch.frexp(mag)
    binade = torch.where(mag < fi.tiny, fi.tiny, torch.ldexp(torch.ones_like(mag), exp - 1))
    return binade * (fi.eps / 2)


def _name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def mixture(out_ref: torch.Tensor, sources: torch.Tensor, q: torch.Tensor, hidden: int, eps: float,
            out_dtype: torch.dtype, *, rounding: str = "nearest", logit_dtype: torch.dtype | None = None) -> Budget:
    """The AttnRes softmax mixture of S sources (float64 [T, S, H]) with the query q = norm * proj
    ([H]), against its float64 result `out_ref` [T, H]; one output rounding plus:

    - fp32 arithmetic: the logits (a length-H dot and a length-H mean), the softmax and the length-S
      weighted sum each add <= probabilistic(H, u32) relative error, amplified by the logit magnitude
      (d alpha / alpha = d logit): 4 * probabilistic * (1 + max|logit|) * max|ref|;
    - for a subject that rounds its normed rows and scores to `logit_dtype` (u_l): source j's logit
      error is within dl_j = u_l |l_j| + lambda u_l ||n_j * q||_2 (the dot of the normed row's
      rounding errors, H independent terms each <= u_l |n_ji q_i|, with high probability as in Higham
      & Mary); to first order the mixture moves by sum_j a_j e_j (v_j - m) with |e_j| <= dl_j (a_j the
      softmax weights, m the mixture), so by <= sum_j a_j dl_j |v_j - m| per element.
    """
    normed = sources * torch.rsqrt(sources.square().mean(-1, keepdim=True) + eps)
    logits = normed @ q
    ref_max, logit_max = torch.stack([out_ref.abs().max(), logits.abs().max()]).tolist()  # one sync
    acc = 4 * probabilistic(hidden, U32) * (1 + logit_max) * ref_max
    rule = "4*lambda*sqrt(H)*u32*(1+max|logit|)"
    if logit_dtype is not None:
        u_l = unit_roundoff(logit_dtype)
        dl = u_l * (logits.abs() + LAMBDA * (normed.square() @ q.square()).sqrt())  # [T, S]
        alpha = torch.softmax(logits, dim=-1)  # [T, S]
        spread = (sources - out_ref[:, None, :]).abs()  # |v_j - m|, [T, S, H]
        acc += ((alpha * dl)[..., None] * spread).sum(1).max().item() if sources.numel() else 0.0
        rule += f"+sum_j a_j*u({_name(logit_dtype)})*(|l_j|+lambda*||n_j*q||)*|v_j-m|"
    return theory_rule(ref_max, out_dtype, 1, acc_term=acc, acc_rule=rule, rounding=rounding)


def with_output_norm(budget: Budget, out_dtype: torch.dtype) -> Budget:
    """`budget` for a mixture followed by the kernel's output RMSNorm: the norm's own rms (1) of the fp32
    mixture adds one rounding-size relative term, u * budget."""
    return Budget(budget.value * (1 + unit_roundoff(out_dtype)), budget.rule + f"*(1+u({_name(out_dtype)}))",
                  budget.baseline_err)


def logit_budget(noise_floor_err: float, logit_max: float, dtype: torch.dtype = torch.bfloat16) -> Budget:
    """The logit budget `delta` of the token judge (oracles/tokens.py), by rule 1 on the block's logits:
    c * err(noise floor) + one rounding of the logits' storage dtype at their magnitude.

    The noise floor is the draft step with every K3 path through the bf16 mirror (the plain unfused,
    unsharded paths in the same precision) and the same bf16 remainder; its logit error against the
    float64 step (max over the block's positions and the vocabulary) is what the paths' own roundings
    do to the logits. A subject whose paths stay within c times their baseline's error moves the logits
    by about c times as much (the remainder is the same for both, and the logits are smooth in the
    paths' outputs at these magnitudes), so c = BASELINE_FACTOR as for the tensors, and the rounding term
    is one bf16 ulp-half at the largest logit (the RBLN-SW/vllm-rbln #741 near-tie width: a bf16 logit
    near 40 is only known to 0.125). A top-two gap below delta is a near-tie: any rounding may break it."""
    value = baseline_budget(noise_floor_err, logit_max, dtype)
    return Budget(value, f"{BASELINE_FACTOR:g}*err(noise floor logits)+u({_name(dtype)})*max|logit|", noise_floor_err)


def dot_rounded_interval(exact: torch.Tensor, magnitude: torch.Tensor, n: int,
                         out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) in out_dtype around a length-n float32 dot of exactly representable products (bf16 x bf16),
    summed in any order and rounded once to out_dtype: every such result lies in [lo, hi] elementwise.

    exact, magnitude [...] float64: the exact dot and the sum of its products' magnitudes. Any order of n - 1
    float32 adds, each rounded to nearest or toward zero (a tensor core's accumulator may truncate), errs by at
    most gamma_{n-1}(2 u32) * magnitude (Higham, Lemma 3.1 with a full ulp per add); the float32 result then lies
    in [f32 at or below exact - e, f32 at or above exact + e], and rounding to out_dtype is monotone, so its
    images of those two float32 ends bound every admissible result. A sum rounded to out_dtype twice, or not
    rounded to out_dtype at all where the caller rounds it, is not bounded by this."""
    e = gamma(max(n - 1, 1), unit_roundoff(torch.float32, "toward_zero")) * magnitude
    lo64, hi64 = exact - e, exact + e
    lo, hi = lo64.float(), hi64.float()
    lo = torch.where(lo.double() > lo64, torch.nextafter(lo, torch.full_like(lo, -math.inf)), lo)
    hi = torch.where(hi.double() < hi64, torch.nextafter(hi, torch.full_like(hi, math.inf)), hi)
    return lo.to(out_dtype), hi.to(out_dtype)
