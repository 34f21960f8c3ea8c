"""Distance metrics between a subject's output and the float64 oracle.

All metrics are computed in float64 on the subject's values (upcast) against
the oracle's. NaN/Inf disagreement is counted separately and never hides in
a max: positions where either side is non-finite are excluded from the
numeric metrics and reported as `nonfinite_mismatch`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Metrics:
    """max_abs, rel_fro = ||a - r||_F / ||r||_F, max_ulp (in the subject dtype),
    cosine, nonfinite_mismatch (positions where finiteness or the non-finite
    value differs), worst: up to 5 multi-indices of the largest errors; over: the elements whose
    error exceeds the `over` threshold compare() was given, NaN/Inf disagreements included (0 when
    none was given), of numel; roundings: the rounding count (`rounding_unit`)."""

    max_abs: float
    rel_fro: float
    max_ulp: float
    cosine: float
    nonfinite_mismatch: int
    ref_max_abs: float
    worst: tuple[tuple[int, ...], ...]
    over: int = 0
    numel: int = 0
    roundings: float = math.nan  # roundings_of: storage roundings the output carries, estimated

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["worst"] = ";".join(",".join(map(str, w)) for w in self.worst)
        return d


def ulp_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |x| (float64 tensor in, float64 out); subnormal floor included."""
    info = torch.finfo(dtype)
    ax = x.abs().clamp(min=info.tiny)
    exp = torch.floor(torch.log2(ax))
    return torch.exp2(exp) * info.eps  # eps = 2^-(stored mantissa bits)


ROUNDING_FLOOR = torch.bfloat16  # the storage rounding a count is in units of, unless the output's is coarser


def rounding_unit(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose one rounding a rounding count counts: the output's own where it is coarser than bf16
    (an fp8 cache), else bf16 (a float32 or float64 output carries the bf16 roundings of its inputs, which
    are what a kernel adds or loses; counted in float32 units, one bf16 rounding would read 65,536^2)."""
    if not dtype.is_floating_point:
        return ROUNDING_FLOOR
    return dtype if torch.finfo(dtype).eps > torch.finfo(ROUNDING_FLOOR).eps else ROUNDING_FLOOR


def roundings_of(diff: torch.Tensor, ref: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """The rounding count (a float64 scalar tensor): the output's squared error against the oracle over the
    expected squared error of one round-to-nearest of the oracle's value in `unit`, sum(d^2) /
    sum(ulp(r)^2 / 12) (a rounding's error is uniform over one ulp, of variance ulp^2/12). It reads 1 for
    an output rounded once from the exact value, about k + 1 for k more independent roundings of the same
    magnitude, and 0 for an exact one; a rounding of a larger intermediate (cancelling terms) counts for
    more than one. `diff` and `ref` are the finite elements' |a - r| and r, float64, same shape (a zero
    reference element expects the subnormal floor's ulp, so a nonzero error there counts for a great many)."""
    expected = (ulp_of(ref, unit).square() / 12.0).sum()
    return diff.square().sum() / expected


def compare(actual: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype | None = None,
            over: float | None = None) -> Metrics:
    """Metrics of `actual` (any float dtype) against `reference` (float64), same shape.

    Computed on the reference's device (a K3-shape comparison is 10^7 elements: on the GPU it
    stays there), with the scalars brought to the host in one transfer."""
    if actual.shape != reference.shape:
        raise ValueError(f"actual: expected shape {list(reference.shape)}, got {list(actual.shape)}")
    out_dtype = dtype or actual.dtype
    r = reference.detach().to(torch.float64)
    a = actual.detach().to(device=r.device, dtype=torch.float64)
    fa, fr = torch.isfinite(a), torch.isfinite(r)
    both = fa & fr
    same_nonfinite = (~fa & ~fr) & ((a == r) | (torch.isnan(a) & torch.isnan(r)))
    diff = torch.where(both, (a - r).abs(), torch.zeros_like(a))
    rz = torch.where(both, r, torch.zeros_like(r))
    az = torch.where(both, a, torch.zeros_like(a))
    if not diff.numel():
        return Metrics(0.0, 0.0, 0.0, 1.0, 0, 0.0, ())
    zero = torch.zeros((), dtype=torch.float64, device=r.device)
    ulp = (diff / ulp_of(rz, out_dtype)).max() if out_dtype.is_floating_point else zero
    k = min(5, diff.numel())
    top = torch.topk(diff.flatten(), k)
    scalars = torch.cat([torch.stack([
        (~both & ~same_nonfinite).sum().to(torch.float64), diff.max(), rz.abs().max(),
        torch.linalg.vector_norm(rz), torch.linalg.vector_norm(diff), torch.linalg.vector_norm(az),
        (az * rz).sum(), ulp,
        ((diff > over) | (~both & ~same_nonfinite)).sum().to(torch.float64) if over is not None else zero,
        roundings_of(diff, rz, rounding_unit(out_dtype)),
    ]), top.values, top.indices.to(torch.float64)]).tolist()  # the one host sync (indices < 2^53: exact)
    mismatch, max_abs, ref_max, rnorm, dnorm, anorm, dot, max_ulp, n_over, roundings = scalars[:10]
    values, indices = scalars[10:10 + k], scalars[10 + k:]
    rel_fro = dnorm / rnorm if rnorm > 0 else (0.0 if dnorm == 0 else math.inf)
    cosine = dot / (anorm * rnorm) if anorm > 0 and rnorm > 0 else float(anorm == rnorm)
    worst: tuple[tuple[int, ...], ...] = ()
    if max_abs > 0:
        worst = tuple(tuple(int(i) for i in np.unravel_index(int(j), diff.shape))
                      for v, j in zip(values, indices) if v > 0)
    return Metrics(max_abs, rel_fro, max_ulp, cosine, int(mismatch), ref_max, worst, int(n_over), diff.numel(),
                   roundings)


def describe_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Exact-check failure message: mismatch count, first indices, NaN/Inf disagreement."""
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)} != expected {list(expected.shape)}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} != expected {e.dtype}"
    neq = ~((a == e) | (torch.isnan(a) & torch.isnan(e))) if a.is_floating_point() else a != e
    idx = neq.nonzero()[:5].tolist()
    nonfinite = 0
    if a.is_floating_point():
        nonfinite = int((torch.isfinite(a) != torch.isfinite(e)).sum())
    return f"{int(neq.sum())} of {a.numel()} elements differ; first at {idx}; NaN/Inf disagreement {nonfinite}"


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact contract check (torch.equal, NaNs equal): raises AssertionError with the details."""
    if actual.shape == expected.shape and actual.dtype == expected.dtype:
        a, e = actual.detach().cpu(), expected.detach().cpu()
        if torch.equal(a, e) or (a.is_floating_point() and bool(((a == e) | (a.isnan() & e.isnan())).all())):
            return
    raise AssertionError(f"{what}: not bitwise equal: {describe_mismatch(actual, expected)}")


def assert_normwise_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> Metrics:
    """max|a - e| <= rtol * max|e| (a normwise relative check), with verbose failure."""
    m = compare(actual, expected, dtype=torch.float64)
    bound = rtol * m.ref_max_abs
    if m.nonfinite_mismatch or not m.max_abs <= bound:
        raise AssertionError(
            f"{what}: max_abs {m.max_abs:.3e} > bound {bound:.3e} (rtol {rtol:.3e} x max|ref| "
            f"{m.ref_max_abs:.3e}); rel_fro {m.rel_fro:.3e}; worst at {list(m.worst)}; "
            f"NaN/Inf mismatches {m.nonfinite_mismatch}"
        )
    return m
