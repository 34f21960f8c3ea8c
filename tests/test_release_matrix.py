"""Pinned releases side by side (supply/fetch.py RELEASES; the default is the newest, 0.34.0): a run names another
per engine (`--engine vllm@0.33.0`),
a local tree's version is read from the tree, a lift that reaches for a name the release added is named before
binding, and each ledger entry is confirmed per release by its reproducer run there (this file, in CI)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from k3num.engines import base, registry, source
from k3num.engines.vllm_adapter import context_kv
from k3num.harness import run_scope
from k3num.oracles import ledger
from k3num.supply import fetch

NEW = "vllm@0.34.0"  # the default release (the newest pinned)
OLD = "vllm@0.33.0"  # the other pinned release, named


def _fetched(spec: str) -> Path:
    try:
        if fetch.verified_manifest(fetch.Source(spec)):
            return fetch.release_root(spec)
    except fetch.FetchError as e:
        pytest.skip(f"{spec}: {e}")
    pytest.skip(f"{spec} is not fetched (k3num fetch {spec})")


def test_a_trees_version_is_read_from_its_version_file(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    with pytest.raises(fetch.TreeVersionError, match="vllm/_version.py"):
        fetch.tree_version("vllm", tmp_path)
    (tmp_path / "vllm" / "_version.py").write_text("# no version here\n")
    with pytest.raises(fetch.TreeVersionError, match=r"_version.py: no `__version__"):
        fetch.tree_version("vllm", tmp_path)
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.34.1.dev3'\n")
    assert fetch.tree_version("vllm", tmp_path) == "0.34.1.dev3"


def test_an_unpinned_release_is_refused_listing_the_pinned_ones() -> None:
    with pytest.raises(ValueError, match=r"vllm@0.35.0: not a pinned release of vllm; pinned: vllm@0.33.0, "
                                         r"vllm@0.34.0"):
        fetch.release_pin("vllm@0.35.0")
    with pytest.raises(ValueError, match="pinned: vllm@0.33.0, vllm@0.34.0"):
        run_scope.engine_releases("vllm@0.35.0")
    with pytest.raises(ValueError, match="one release of vllm per run"):
        run_scope.engine_releases("vllm@0.33.0,vllm-rocm@0.34.0")
    with pytest.raises(ValueError, match="mirror reads no pinned release"):
        run_scope.engine_releases("mirror@1.0")
    # the default release (the newest) has its bare name as its spec; both name a release of the same pin
    assert fetch.PINS["vllm"].version == fetch.releases("vllm")[-1] == "0.34.0"
    assert run_scope.engine_releases("vllm,vllm-rocm@0.33.0") == {"vllm": OLD}
    assert fetch.spec_of(fetch.release_pin("vllm@0.34.0")) == "vllm"


def test_a_release_cache_tree_is_that_release_and_a_copy_of_it_is_local(tmp_path: Path) -> None:
    root = _fetched(OLD)
    pinned = fetch.Source("vllm", root)
    assert (pinned.local, pinned.release, pinned.version, pinned.spec) == (None, "0.33.0", "0.33.0", OLD)
    assert fetch.Source(OLD) == pinned
    for rel in fetch.release_pin(OLD).files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((root / rel).read_bytes())
    copy = fetch.Source("vllm", tmp_path)
    assert copy.version == "0.33.0+local"  # read from the copy, not assumed from the default pin (0.34.0)
    assert copy.pin.version == "0.33.0"  # and compared with the release it names
    assert fetch.pinned_files(copy, ("vllm/models/kimi_k3/nvidia/dspark_mla.py",))
    (tmp_path / "vllm/models/kimi_k3/nvidia/dspark_mla.py").write_text("# edited\n")
    assert not fetch.pinned_files(copy, ("vllm/models/kimi_k3/nvidia/dspark_mla.py",))


def test_a_lifted_body_reading_a_name_the_adapter_lacks_is_named_before_binding(tmp_path: Path) -> None:
    """The planted case: a method that calls a helper and super(), lifted without either."""
    path = tmp_path / "m.py"
    path.write_text("class A:\n    def f(self, x):\n        refill_derived(self, 'y', x)\n"
                    "        return super().f(x) + len([torch for _ in range(2)])\n")
    with pytest.raises(source.SourceError, match=r"A.f reads super\(\).f, refill_derived, torch, which the adapter "
                                                 "does not provide"):
        source.lift_method(path, "A.f", {})
    lifted = source.lift_method(path, "A.f", {"refill_derived": lambda *a: None, "_super_f": lambda s, x: x,
                                              "torch": 1})
    assert lifted(object(), 3) == 5


def test_the_new_releases_fused_context_kv_binds_with_its_own_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34.0's metadata build calls refill_derived (vllm/model_executor/utils.py): lifted from the tree it binds;
    without it the subject is missing with the name, not a NameError inside a property."""
    root = _fetched(NEW)
    engine = registry.build("vllm", {"vllm": root})
    assert engine.version == "0.34.0"
    assert base.CONTEXT_KV_FUSED in engine.subjects
    monkeypatch.setattr(context_kv, "RELEASE_HELPERS", ())
    broken = registry.build("vllm", {"vllm": root})
    assert base.CONTEXT_KV_FUSED not in broken.subjects
    assert "reads refill_derived" in broken.missing[base.CONTEXT_KV_FUSED]


def test_each_entry_is_confirmed_on_the_other_release_exactly_where_its_reproducer_reproduces(tmp_path: Path) -> None:
    """The reproducers on vllm@0.33.0 (the default release's run in the test command confirms 0.34.0): an entry
    confirmed there xfails (reproduced); one not confirmed there must not reproduce (its reproducer asks for the
    confirmation if it does): no failure at all."""
    _fetched(OLD)
    xml = tmp_path / "j.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "k3num.properties.test_ledger_reproducers",
                           "--engine", "vllm@0.33.0,vllm-rocm@0.33.0", "--hypothesis-profile=ci", "-q",
                           "-p", "no:cacheprovider", f"--junitxml={xml}"], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cases = {c.get("name", "").split("[")[-1].rstrip("]"): c for c in ET.parse(xml).getroot().iter("testcase")}
    confirmed = [d.id for d in ledger.LEDGER if "0.33.0" in d.releases]
    assert confirmed, "no entry is confirmed on 0.33.0"
    for d in ledger.LEDGER:
        if "0.33.0" not in d.releases:
            continue
        skipped = cases[d.id].find("skipped")
        if d.modes and "source-interpreter" not in d.modes:  # a GPU race: confirmed on the H200 (gpu-run.md)
            assert skipped is not None and skipped.get("type") == "pytest.skip", f"{d.id} ran on the CPU"
            continue
        assert skipped is not None and skipped.get("type") == "pytest.xfail", \
            f"{d.id} is confirmed on 0.33.0 but its reproducer did not reproduce there"
