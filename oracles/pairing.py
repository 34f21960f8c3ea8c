"""The pre-merge check's judgement (`k3num check`): the same drawn cases through the base and the head.

Two tables come in, both written by harness/pairing_run.py:
- examples: one row per hypothesis example of a property test (node), with each side's outcome
  (`pass`, `fail` or `skip`, and for the head `flaky`: it failed where the base passed four times, and
  passed on a rerun of the same case) and why, and the ledger entry filed for the test on the pinned
  release;
- records: the oracle comparisons each side made in that example, in call order (`index`).

Two judgements come out:
- `outcomes`: per node, the examples that are new (fail on the head, pass on the base), fixed (the
  reverse), known (fail on both), flaky (the head's failure did not repeat on the same case, or the
  test carries a ledger entry for a race: a head-only failure there cannot be told from it), and the
  head's skips where the base ran (a subject the head lost: "contract changed: <file>: <what>" is such
  a reason);
- `paired_drift`: per (node, property, subject), the errors of identical cases side by side, judged
  by a one-sided sign test (below). It flags a head that stays within budget but is worse.

The sign test and its threshold. A pair is the k-th comparison of one example on both sides: the same
inputs, the same reference, the same budget. `worse` counts pairs whose head error (max_abs) exceeds
the base's, `better` the reverse; ties are dropped. With no change:
- a deterministic subject gives bitwise-equal outputs on equal inputs, so every pair ties, n = 0 and
  the test cannot fire (base against base: zero alarms, whatever ALPHA is);
- a nondeterministic one (a race, GPU only: K3N-004/005/007) gives exchangeable errors, so P(worse) =
  1/2 per untied pair and the one-sided p-value P(Binom(n, 1/2) >= worse) is at most ALPHA by
  construction.
The suite has about 160 (property, subject) groups per engine; ALPHA = 1e-4 keeps the chance of any
false alarm in one check under 1.6% (Bonferroni). The smallest group that can fire has 14 untied pairs,
all worse (2^-14 = 6.1e-5); under the `ci` profile's 40 examples, 32 worse of 40 untied pairs fire
(p = 9.1e-5) and 31 of 40 do not (p = 3.4e-4). Exact contracts (budget 0) are judged by pass/fail only.
"""

from __future__ import annotations

import math

import pandas as pd

from k3num.oracles import ledger

ALPHA = 1e-4

EXAMPLE_COLUMNS = ("node", "example", "head", "base", "head_why", "base_why", "ledger")
RECORD_COLUMNS = ("node", "example", "side", "index", "property", "subject", "detail", "verdict", "max_abs",
                  "budget", "ratio", "seed", "shape")
PASS, FAIL, SKIP, FLAKY = "pass", "fail", "skip", "flaky"
# a head failure inside a ledger entry's region that the entry's bug model does not explain carries this
# (harness/ledger_run.py modelled): it is new, even where the base fails the same example
UNEXPLAINED = "[not the ledger entry's bug]"
REPRODUCER = "test_each_ledger_reproducer_still_fails_on_the_pinned_release"  # its rows' ledger: the entry
# one side of a two-process check (harness/pairing_run.py --check-side): `case` digests the drawn arguments
SIDE_COLUMNS = ("node", "example", "side", "engine", "outcome", "why", "ledger", "case")


def sign_test_p(worse: int, better: int) -> float:
    """One-sided p-value of `worse` or more successes in worse + better fair coin flips (1.0 for none)."""
    if worse < 0 or better < 0:
        raise ValueError(f"counts must be >= 0, got worse={worse}, better={better}")
    n = worse + better
    if n == 0:
        return 1.0
    return min(1.0, sum(math.comb(n, k) for k in range(worse, n + 1)) / 2.0**n)


def _require(frame: pd.DataFrame, columns: tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what}: missing columns {missing}")


def join_sides(head: pd.DataFrame, base: pd.DataFrame, head_records: pd.DataFrame,
               base_records: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A two-process check's sides as one process's tables: (examples, records, unpaired).

    The sides are joined by (node, example), the node with its engine parameter read as one name (the
    head's node is kept): the base's process ran the head's cases (harness/side_cases.py), in order. An
    example is paired only where both sides ran it and their `case` digests agree (the
    same drawn arguments); the rest are `unpaired`, one row each with why, never judged. A head's flaky
    failure where the base failed too is the base's failure (known), as the one-process check's rerun of
    the base would find."""
    for frame, what in ((head, "head examples"), (base, "base examples")):
        _require(frame, SIDE_COLUMNS, what)
    for frame, what in ((head_records, "head records"), (base_records, "base records")):
        _require(frame, RECORD_COLUMNS, what)
    keys = ["node", "example"]
    head, base = head.assign(key=_engine_free(head)), base.assign(key=_engine_free(base))
    heads = dict(zip(head["key"], head["node"]))
    both = head.drop(columns="node").merge(base.drop(columns="node"), on=["key", "example"], how="outer",
                                           suffixes=("_head", "_base"), indicator=True)
    both["node"] = [heads.get(k, k) for k in both["key"]]
    only = both["_merge"] != "both"
    differ = ~only & (both["case_head"] != both["case_base"])
    unpaired = both[only | differ].assign(why=lambda f: f["_merge"].map(
        {"left_only": "ran on the head only", "right_only": "ran on the base only"}).where(
        f["_merge"] != "both", "the sides drew different cases"))[[*keys, "why"]]
    paired = both[~(only | differ)]
    paired = paired[~((paired["outcome_head"] == SKIP) & (paired["outcome_base"] == SKIP))]  # neither ran it
    h = paired["outcome_head"].where(~((paired["outcome_head"] == FLAKY) & (paired["outcome_base"] == FAIL)), FAIL)
    examples = pd.DataFrame({
        "node": paired["node"], "example": paired["example"], "head": h, "base": paired["outcome_base"],
        "head_why": paired["why_head"], "base_why": paired["why_base"],
        "ledger": paired["ledger_head"].where(paired["ledger_head"] != "", paired["ledger_base"]),
    }, columns=list(EXAMPLE_COLUMNS)).reset_index(drop=True)
    ok = set(zip(paired["key"], paired["example"].astype(int)))
    out = []
    for frame, side, names in ((head_records, "head", head), (base_records, "base", base)):
        engine_of = dict(zip(names["node"], names["engine"]))
        key = [node_key(n, engine_of.get(n, "")) for n in frame["node"]]
        keep = [(k, int(e)) in ok for k, e in zip(key, frame["example"])]
        out.append(frame.assign(side=side, node=[heads.get(k, k) for k in key])[keep])
    records = pd.concat(out, ignore_index=True)
    return examples, records.reset_index(drop=True), unpaired.reset_index(drop=True)


def node_key(node: str, engine: str) -> str:
    """A node id with its engine parameter (`[NAME]`, `[NAME-...]`, `[...-NAME]`, `[...-NAME-...]`) as `{engine}`,
    and its file by its name alone (each process's rootdir sets the folders: `k3num/properties/test_x.py` in
    one is `test_x.py` in another)."""
    file, sep, rest = node.partition("::")
    node = f"{file.rsplit('/', 1)[-1]}{sep}{rest}"
    name, bracket, params = node.partition("[")
    if not bracket or not engine:
        return node
    parts = params[:-1].split("-") if params.endswith("]") else params.split("-")
    width = len(engine.split("-"))
    for i in range(len(parts) - width + 1):
        if "-".join(parts[i:i + width]) == engine:
            return f"{name}[{'-'.join([*parts[:i], '{engine}', *parts[i + width:]])}]"
    return node


def _engine_free(frame: pd.DataFrame) -> list[str]:
    return [node_key(n, e) for n, e in zip(frame["node"], frame["engine"])]


def outcomes(examples: pd.DataFrame) -> pd.DataFrame:
    """Per node: examples paired, new / fixed / known / head_skipped counts, the first new failure's
    message, the head's skip reason where the base ran, and the status (the most serious finding)."""
    _require(examples, EXAMPLE_COLUMNS, "examples")
    fixed_entries = reproducers_fixed(examples)
    rows = []
    for node, g in examples.groupby("node", sort=True):
        ran = g[(g["head"] != SKIP) & (g["base"] != SKIP)]
        entry = ledger.by_id(next((x for x in g["ledger"] if x), ""))
        # a head failure the entry's bug model rejects is new whatever the base did; a head-only failure that
        # repeated under CONFIRM (FAIL, not FLAKY) is new whatever entry its test has
        unexplained = (ran["head"] == FAIL) & ran["head_why"].astype(str).str.contains(UNEXPLAINED, regex=False)
        if entry is not None and entry.race and entry.id not in fixed_entries:
            # a race that did not fire on the head fixes nothing: "fixed" needs the entry's reproducer to pass there
            unfired = (ran["head"] == PASS) & (ran["base"] == FAIL)
            ran = ran.assign(head=ran["head"].where(~unfired, FLAKY))
        # both fail, but not alike: the head raised another exception than the base (a TypeError where the base's
        # assertion failed) is a new failure, not the base's known one
        unlike = (ran["head"] == FAIL) & (ran["base"] == FAIL) & (
            ran["head_why"].astype(str).map(failure_kind) != ran["base_why"].astype(str).map(failure_kind))
        new = ran[((ran["head"] == FAIL) & (ran["base"] == PASS)) | unexplained | unlike]
        fixed = ran[(ran["head"] == PASS) & (ran["base"] == FAIL)]
        known = ran[(ran["head"] == FAIL) & (ran["base"] == FAIL) & ~unexplained & ~unlike]
        flaky = ran[ran["head"] == FLAKY]
        lost = g[(g["head"] == SKIP) & (g["base"] != SKIP)]
        status = ("new" if len(new) else "head cannot run" if len(lost) else "flaky" if len(flaky)
                  else "fixed" if len(fixed) else "known" if len(known) else "same")
        rows.append({
            "node": node, "examples": len(ran), "new": len(new), "fixed": len(fixed), "known": len(known),
            "flaky": len(flaky), "head_skipped": len(lost), "status": status,
            "ledger": next((x for x in g["ledger"] if x), ""),
            "first_new": new["head_why"].iloc[0] if len(new) else "",
            "head_skip_why": lost["head_why"].iloc[0] if len(lost) else "",
        })
    return pd.DataFrame(rows, columns=["node", "examples", "new", "fixed", "known", "flaky", "head_skipped",
                                       "status", "ledger", "first_new", "head_skip_why"])


def failure_kind(why: str) -> str:
    """The exception a side's failure raised, as its `why` names it ("AssertionError: ..." -> "AssertionError"; a
    failure the harness marked UNEXPLAINED keeps the kind it wraps)."""
    text = why.removeprefix(UNEXPLAINED).strip()
    head = text.split(":", 1)[0].strip()
    return head if head.isidentifier() else ""


def reproducers_fixed(examples: pd.DataFrame) -> set[str]:
    """The ledger entries whose reproducer passes on the head and fails on the base (the rows of REPRODUCER's
    node carry the entry id in `ledger`)."""
    rows = examples[examples["node"].astype(str).str.contains(REPRODUCER, regex=False)]
    return {e for e, h, b in zip(rows["ledger"], rows["head"], rows["base"]) if e and h == PASS and b == FAIL}


def paired_drift(records: pd.DataFrame, alpha: float = ALPHA) -> pd.DataFrame:
    """Per (node, property, subject): pairs, worse / better / tied counts, the median head/base error
    ratio over untied pairs with a nonzero base error, the sign test's p-values and the verdict
    (`worse`, `better` or `same`)."""
    _require(records, RECORD_COLUMNS, "records")
    keys = ["node", "example", "index"]
    both = records[records["side"] == "head"].merge(records[records["side"] == "base"], on=keys, how="inner",
                                                     suffixes=("_head", "_base"))
    same_call = ((both["property_head"] == both["property_base"]) & (both["subject_head"] == both["subject_base"])
                 & (both["detail_head"] == both["detail_base"]))
    both = both[same_call & (both["budget_head"] > 0) & both["max_abs_head"].map(math.isfinite)
                & both["max_abs_base"].map(math.isfinite)]
    rows = []
    for (node, prop, subj), g in both.groupby(["node", "property_head", "subject_head"], sort=True):
        eh, eb = g["max_abs_head"], g["max_abs_base"]
        worse, better = int((eh > eb).sum()), int((eh < eb).sum())
        untied = g[(eh != eb) & (eb > 0)]
        median = float((untied["max_abs_head"] / untied["max_abs_base"]).median()) if len(untied) else 1.0
        p_worse, p_better = sign_test_p(worse, better), sign_test_p(better, worse)
        verdict = "worse" if p_worse < alpha else "better" if p_better < alpha else "same"
        rows.append({"node": node, "property": prop, "subject": subj, "pairs": len(g), "worse": worse,
                     "better": better, "tied": len(g) - worse - better, "median_ratio": median,
                     "p_worse": p_worse, "p_better": p_better, "drift": verdict})
    return pd.DataFrame(rows, columns=["node", "property", "subject", "pairs", "worse", "better", "tied",
                                       "median_ratio", "p_worse", "p_better", "drift"])


def exit_code(found: pd.DataFrame, drift: pd.DataFrame) -> int:
    """0: nothing new, nothing the head lost, no flaky failure outside the ledger (a known race), no drift
    beyond noise; 1: any of them."""
    # a flaky failure is a known race only in a test whose entry is a race (its model judged the failing output:
    # harness/ledger_run.modelled marks what it rejects new); a flaky failure anywhere else is a finding
    race = found["ledger"].map(lambda e: bool(e) and bool(getattr(ledger.by_id(e), "race", False)))
    unexplained = (found["flaky"] > 0) & ~race
    bad = (found["status"].isin(["new", "head cannot run"]).any() or unexplained.any()
           or (drift["drift"] == "worse").any())
    return 1 if bad else 0
