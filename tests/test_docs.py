"""The docs match the code: every repository file they cite exists, they cite no outside notes (design
briefs, issue numbers a reader of the repository cannot look up), and the CLI's help says what the
README says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "properties" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# paths inside the engines' wheels and sdist, and the places a run writes, are not files of the repository
OUTSIDE = ("vllm/", "sglang/", "tokenspeed/", "tokenspeed_kernel/", "csrc/", "amd/", "nvidia/", "python/",
           "out/", "history/", "golden/",
           "engine-cache/", "~", "/", "R/", "DIR", "PATH", "OUT", "TREE", "<", "$")
CITED = re.compile(r"`([A-Za-z0-9_.][A-Za-z0-9_./-]*\.(?:py|sh|md|yml|toml|json|txt|safetensors))(?::[\w.]+)?`")


def _cited(text: str) -> set[str]:
    return {m.group(1) for m in CITED.finditer(text)} | {
        m.group(1) for m in re.finditer(r"`([a-z_]+/(?:[a-z_]+/)*)`", text)}


def test_every_file_the_docs_cite_exists() -> None:
    missing = []
    for doc in DOCS:
        for path in sorted(_cited(doc.read_text())):
            if "/" not in path or path.startswith(OUTSIDE) or "*" in path:  # a bare name belongs to its table row
                continue
            if not (ROOT / path).exists() and not (ROOT / path.split(":")[0]).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_the_docs_cite_no_notes_outside_the_repository() -> None:
    bad = [f"{doc.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for doc in DOCS
           for i, line in enumerate(doc.read_text().splitlines(), 1)
           if re.search(r"BRIEF §|\b[Ii]ssues? \d+\b", line)]
    assert not bad, "\n".join(bad)


def test_golden_write_help_names_the_readme_command() -> None:
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "golden", "write", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    readme = (ROOT / "README.md").read_text()
    text = " ".join(r.stdout.split())  # argparse wraps the description
    assert "run_properties.sh --golden" in text and "run_properties.sh --golden" in readme, r.stdout
