"""`k3num`: one module (harness/cli.py), one function per subcommand, all listed by --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_subcommand() -> None:
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True)
    assert r.returncode == 0
    for cmd in ("fetch", "build-ops", "golden", "replay", "repro", "report", "bisect"):
        assert cmd in r.stdout, (cmd, r.stdout)


def test_an_unknown_subcommand_is_refused_with_the_list() -> None:
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", "frobnicate"], cwd=ROOT, capture_output=True,
                          text=True)
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr


def _help(*cmd: str) -> str:
    r = subprocess.run([sys.executable, "-m", "k3num.harness.cli", *cmd, "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def test_every_option_of_the_user_facing_commands_has_help_and_the_exit_codes_are_stated() -> None:
    """issue 41's --help gaps: each option says what it does; check and impact state their exit codes, check's
    profile lists the profiles and its device its default; fetch has a description."""
    import argparse

    from k3num.harness import check, coverage, impact

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    for mod in (check, coverage, impact):
        mod.add_parser(sub)
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"k3num {name} {action.option_strings[0]}: no help text"
    text = _help("check")
    assert "exit codes: 0" in text and "nightly-1k" in text and "default: cuda where CUDA is, else cpu" in text
    assert "exit codes: 0 no decided token flipped outside the ledger" in _help("impact")
    assert "sha256" in _help("fetch") and "Exit 0" in _help("fetch")


def test_tree_writes_the_pinned_files_for_editing_and_refuses_bad_input(tmp_path: Path) -> None:
    import pytest

    from k3num.supply import fetch

    if not fetch.verified_manifest("tokenspeed"):
        pytest.skip("tokenspeed is not fetched (k3num fetch tokenspeed)")
    dest = tmp_path / "ts"
    run = lambda *a: subprocess.run([sys.executable, "-m", "k3num.harness.cli", "tree", *a],  # noqa: E731
                                    cwd=ROOT, capture_output=True, text=True)
    r = run("tokenspeed", str(dest))
    assert r.returncode == 0, r.stderr
    pin = fetch.PINS["tokenspeed"]
    assert r.stdout.split() == list(pin.files) and "k3num check --engine tokenspeed --head" in r.stderr
    src = fetch.cache_root() / f"tokenspeed-{pin.version}"
    assert all((dest / f).read_bytes() == (src / f).read_bytes() for f in pin.files)
    # a tree already there is kept unless --force; an unknown engine is named with the valid ones
    assert run("tokenspeed", str(dest)).returncode == 2
    assert run("tokenspeed", str(dest), "--force").returncode == 0
    r = run("nosuch", str(tmp_path / "n"))
    assert r.returncode == 2 and "valid: sglang, tokenspeed, vllm" in r.stderr


def test_fetch_says_each_library_once(monkeypatch, capsys) -> None:
    """issue 41's log noise: `tokenspeed:rope` was printed twice (the extraction, then the path)."""
    from k3num.harness import cli
    from k3num.supply import fetch

    monkeypatch.setattr(fetch, "fetch", lambda engine: None)
    for extracts in (True, False):
        def binary(key, log=print, _e=extracts):
            if _e:
                log(f"[fetch] {key}: extracted lib.so (1 KiB, sha256 ok) to /x/lib.so")
            return "/x/lib.so"

        monkeypatch.setattr(fetch, "binary", binary)
        assert cli.main(["fetch", "tokenspeed-bin"]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "tokenspeed:rope" in ln]
        assert len(lines) == 1, lines
        assert ("extracted" if extracts else "up to date") in lines[0]
