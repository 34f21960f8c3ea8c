"""Two drift CSVs of derandomized runs, record for record: the check that a speed change changed no
record (what was tried, what was measured, the verdicts).

Usage:
    python scripts/csv_identity.py BEFORE.csv AFTER.csv [--ignore COL,...] [--exclude-ledger]

Records are matched as multisets: sorted by every compared column, since xdist workers finish in any
order. Every column is compared as written (the CSV's own text of each float: a change in the last
bit of a budget shows), except the timing columns (none in the record today; `--ignore` names more).
`--exclude-ledger` leaves out the records filed under a ledger entry (a known race, such as K3N-007's
flaky ROCm kernel, gives different bits from run to run by its nature) and says how many.
Exit 0 when identical; 1 with the first differing records and the columns that differ.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

TIMING = ("wall_s", "seconds", "elapsed_s")


def differences(before: pd.DataFrame, after: pd.DataFrame, ignore: set[str]) -> list[str]:
    """What differs between the two record sets ([] when they are the same multiset of rows)."""
    out = []
    if set(before.columns) != set(after.columns):
        out.append(f"columns: only before {sorted(set(before.columns) - set(after.columns))}, "
                   f"only after {sorted(set(after.columns) - set(before.columns))}")
        return out
    cols = [c for c in before.columns if c not in ignore]
    a = before[cols].astype(str).sort_values(cols).reset_index(drop=True)
    b = after[cols].astype(str).sort_values(cols).reset_index(drop=True)
    if len(a) != len(b):
        out.append(f"records: {len(a)} before, {len(b)} after")
        for key in ("node", "property"):
            if key in cols:
                ca, cb = a[key].value_counts(), b[key].value_counts()
                delta = (ca.sub(cb, fill_value=0)).loc[lambda s: s != 0]
                out.extend(f"  {key} {k}: {int(ca.get(k, 0))} before, {int(cb.get(k, 0))} after"
                           for k in delta.index[:10])
                break
        return out
    neq = a != b
    for r in neq.any(axis=1).to_numpy().nonzero()[0][:10]:
        diff_cols = [c for c in cols if neq.at[r, c]]
        out.append(f"record {r}: " + "; ".join(f"{c}: {a.at[r, c]!r} -> {b.at[r, c]!r}" for c in diff_cols))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--ignore", default="", help="more columns left out of the comparison, comma-separated")
    ap.add_argument("--exclude-ledger", action="store_true", help="leave out records filed under a ledger entry")
    args = ap.parse_args()
    before = pd.read_csv(args.before, dtype=str, keep_default_na=False)
    after = pd.read_csv(args.after, dtype=str, keep_default_na=False)
    if args.exclude_ledger:
        nodes = set(before.loc[before["ledger"] != "", "node"]) | set(after.loc[after["ledger"] != "", "node"])
        cut = (before["node"].isin(nodes).sum(), after["node"].isin(nodes).sum())
        before, after = before[~before["node"].isin(nodes)], after[~after["node"].isin(nodes)]
        print(f"csv_identity: left out the ledger-filed tests {sorted(nodes)} ({cut[0]} / {cut[1]} records)")
    ignore = set(TIMING) | {c for c in args.ignore.split(",") if c}
    diff = differences(before, after, ignore)
    print(f"csv_identity: {len(before)} records before, {len(after)} after: "
          + ("identical" if not diff else f"{len(diff)} difference(s)"))
    for line in diff:
        print(f"  {line}")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
