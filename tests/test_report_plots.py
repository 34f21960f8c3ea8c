"""The report's plots keep their text readable (issue 20): legends outside the plotting area, zeros on a
log axis drawn at a labelled floor, and no two labels overlapping, checked on matplotlib's rendered
bounding boxes (not by eye) for the three kinds of plot at their most crowded: a dozen properties on
one error-vs-length plot, 25 repeat groups on the nondeterminism plot, four stacked ratio panels, a dozen
engine/drafter series on the token plots."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from k3num.harness.nightly import report


def _runs(n_runs: int = 8, props: int = 4, repeats: int = 25) -> list[dict]:
    rng = np.random.default_rng(0)
    runs = []
    for i in range(n_runs):
        groups = []
        for p in range(props):
            q = np.sort(rng.uniform(0.0, 0.9, 101)).tolist()
            groups.append({"engine": "vllm", "subject": "attn_res", "property": f"property_number_{p}",
                           "mode": "source-gpu", "device": "cuda", "q": q, "records": 40, "exact": False,
                           "repeat_records": 0, "nondeterministic": 0})
        for k in range(repeats):
            groups.append({"engine": f"engine{k % 5}", "subject": f"subject_{k}", "property": "deterministic",
                           "mode": "m", "device": "cuda", "q": [0.0] * 101, "records": 40, "exact": True,
                           "repeat_records": 40, "nondeterministic": int(rng.integers(0, 3))})
        by_len = [{"engine": "sglang", "subject": "attn_res_mix", "property": f"prop_{p:02d}", "reduction_len": n,
                   "err_median": 0.0 if (p == 0 and n == 64) else float(rng.uniform(1e-4, 1e-2)),
                   "err_max": float(rng.uniform(1e-3, 1e-1)), "budget_median": 0.05 * n ** 0.5 / 30}
                  for p in range(12) for n in (64, 1024, 7168)]
        tokens = [{"engine": engine, "subject": f"draft_step:{kind}", "blocks": 40,
                   "agreement": float(rng.uniform(0.5, 7)), "noise_agreement": float(rng.uniform(4, 7)),
                   "points": [[float(10 ** rng.uniform(-4, 1.5)), int(rng.integers(0, 8))] for _ in range(40)]}
                  for engine in ("mirror", "vllm", "vllm-rocm", "sglang", "tokenspeed", "engine-with-a-long-name")
                  for kind in ("dspark", "dflash")]
        runs.append({"meta": {"date": f"2026-11-{i + 1:02d}T00:00:00Z", "harness_commit": f"{i:07d}"},
                     "groups": groups, "by_len": by_len, "tokens": tokens, "file": f"r{i}.json"})
    return runs


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Every figure the report draws, kept (not closed) with its file name."""
    kept: list = []

    def keep(fig, path: Path) -> Path:
        kept.append((path.name, fig))
        return path

    monkeypatch.setattr(report, "_save", keep)
    runs = _runs()
    report.plot_ratios(runs, tmp_path)
    report.plot_err_vs_len(runs, tmp_path)
    report.plot_nondeterminism(runs, tmp_path)
    report.plot_tokens(runs, tmp_path)
    yield kept
    for _, fig in kept:
        report._plt().close(fig)


def _texts(fig, renderer):
    """(label, bbox) of every visible text of the figure: titles, axis labels, tick labels, legend boxes."""
    out = []
    for i, ax in enumerate(fig.axes):
        drawn = [ax.title, ax.xaxis.label, ax.yaxis.label]
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            # matplotlib keeps labels for ticks outside the view too; it draws only those inside
            drawn += [tick.label1 for tick in axis.get_major_ticks() if lo <= tick.get_loc() <= hi]
        for t in drawn:
            if t.get_visible() and t.get_text():
                out.append((f"ax{i}:{t.get_text()[:30]}", t.get_window_extent(renderer)))
        leg = ax.get_legend()
        if leg is not None:
            out.append((f"ax{i}:legend", leg.get_window_extent(renderer)))
    return out


def test_legends_sit_outside_every_plotting_area(figures) -> None:
    for name, fig in figures:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        for i, ax in enumerate(fig.axes):
            leg = ax.get_legend()
            if leg is None:
                continue
            lb = leg.get_window_extent(r)
            for j, other in enumerate(fig.axes):
                assert not lb.overlaps(other.get_window_extent(r)), f"{name}: ax{i}'s legend covers ax{j}"


def test_no_two_labels_overlap(figures) -> None:
    for name, fig in figures:
        fig.canvas.draw()
        boxes = _texts(fig, fig.canvas.get_renderer())
        bad = [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]
        assert not bad, f"{name}: {bad[:5]}"


def test_a_zero_on_a_log_axis_is_drawn_at_a_labelled_floor(figures) -> None:
    name, fig = next((n, f) for n, f in figures if n.startswith("err-vs-len"))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    floor_label = next(lb for lb in labels if lb.startswith("0 (drawn at "))
    floor = float(floor_label.removeprefix("0 (drawn at ").removesuffix(")"))
    ymin = ax.get_ylim()[0]
    assert 0 < ymin < floor, (ymin, floor)  # the floor is inside the axis, not on its edge
    ys = np.concatenate([line.get_ydata() for line in ax.get_lines()])
    assert (ys > 0).all() and np.isclose(ys, floor).any(), name


def _series_colours(ax) -> list[tuple]:
    import matplotlib.colors as mcolors

    # a line whose label starts with "_" is left out of the legend by matplotlib: a series' companion (the
    # token plot's dashed noise floor in its series' colour), not a series
    return [mcolors.to_rgba(line.get_color()) for line in ax.get_lines()
            if not line.get_label().startswith(("0 (", "_"))]


def test_every_series_of_a_plot_has_its_own_colour_and_a_readable_legend(figures) -> None:
    """Issue 32: two series of err-vs-len shared a colour and the legend's 6-point text was unreadable."""
    for name, fig in figures:
        for ax in fig.axes:
            leg = ax.get_legend()
            if leg is None:
                continue
            assert min(t.get_fontsize() for t in leg.get_texts()) >= 8, name
            colours = _series_colours(ax)
            assert len(set(colours)) == len(colours), f"{name}: {len(colours) - len(set(colours))} shared colour(s)"


def test_budget_marks_are_not_joined_across_shapes(figures) -> None:
    """The budget per length is a median over the shapes of that length: drawn as marks, never a line
    joining lengths (which made a zigzag between shapes)."""
    for name, fig in figures:
        if not name.startswith("err-vs-len"):
            continue
        budgets = [line for line in fig.axes[0].get_lines() if ": budget" in line.get_label()]
        assert budgets and all(line.get_linestyle() in ("None", "none", "") for line in budgets), name


def test_a_one_run_nondeterminism_plot_is_a_bar_per_group_and_says_so(monkeypatch, tmp_path) -> None:
    kept: list = []
    monkeypatch.setattr(report, "_save", lambda fig, path: kept.append(fig) or path)
    report.plot_nondeterminism(_runs(n_runs=1), tmp_path)
    (fig,) = kept
    ax = fig.axes[0]
    try:
        assert "one run" in ax.get_title() and ax.get_legend() is None
        assert len(ax.patches) == 25 and ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= 1
        fig.canvas.draw()
        boxes = _texts(fig, fig.canvas.get_renderer())
        assert not [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]
    finally:
        report._plt().close(fig)


def test_the_token_plots_show_every_engine_and_drafter_with_its_noise_floor(figures) -> None:
    names = {name: fig for name, fig in figures}
    assert {"token-flips.png", "token-agreement.png"} <= set(names)
    ax = names["token-agreement.png"].axes[0]
    series = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(series) == 12 and len(dashed) == 12
    flips = names["token-flips.png"].axes[0]
    assert flips.get_xscale() == "log" and len(flips.collections) == 6


def test_a_one_run_agreement_plot_draws_its_noise_floor_at_that_runs_label(monkeypatch, tmp_path) -> None:
    """One run is one point per series: the noise floor carries a marker (a dashed line of one point draws
    nothing), and the x axis is that run, labelled, not +-0.045 around it."""
    kept: list = []
    monkeypatch.setattr(report, "_save", lambda fig, path: kept.append((path.name, fig)) or path)
    report.plot_tokens(_runs(n_runs=1), tmp_path)
    fig = dict(kept)["token-agreement.png"]
    ax = fig.axes[0]
    try:
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert dashed and all(line.get_marker() not in (None, "", "None") for line in dashed)
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert ax.get_xlim() == (-1.0, 1.0) and labels == ["2026-11-01 0000000"], (ax.get_xlim(), labels)
    finally:
        for _, f in kept:
            report._plt().close(f)


def test_a_known_divergences_ratio_panel_is_logarithmic_above_the_slack_and_says_it_is_the_ledgers(
        monkeypatch, tmp_path) -> None:
    """A group of ledger-filed records only, at 1,000x its budget: the panel says so in its title, its y axis is
    linear to the slack line and logarithmic above (the budget line stays readable), and both lines are named."""
    kept: list = []
    monkeypatch.setattr(report, "_save", lambda fig, path: kept.append(fig) or path)
    runs = _runs(n_runs=3, props=1, repeats=0)
    for r in runs:
        g = r["groups"][0]
        g.update(q=np.linspace(0.5, 1200.0, 101).tolist(), only_ledger=True)
    report.plot_ratios(runs, tmp_path)
    (fig,) = kept
    ax = fig.axes[0]
    try:
        assert "known divergences only" in ax.get_title() and ax.get_yscale() == "symlog"
        texts = [t.get_text() for t in ax.texts]
        assert "budget" in texts and any("catches nothing" in t for t in texts)
    finally:
        report._plt().close(fig)
