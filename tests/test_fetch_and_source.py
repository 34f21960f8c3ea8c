"""`k3num fetch` and the source-mode loader: pinned hashes enforced, idempotence, a clear error without
network, and stub modules that leave sys.modules exactly as they found it."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

from k3num.engines import source
from k3num.supply import fetch


def _wheel(directory: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3NUM_ENGINE_CACHE", str(tmp_path))
    return tmp_path


def _pin(monkeypatch: pytest.MonkeyPatch, sha: str, files: tuple[str, ...], pip_args: tuple[str, ...] = ()) -> None:
    monkeypatch.setitem(fetch.PINS, "toy", fetch.Pin("toy", "toy-engine", "1.0", sha, files, pip_args))


def test_fetch_extracts_the_pinned_files_and_is_idempotent(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _wheel(cache / "wheels", "toy_engine", "1.0", {"toy/a.py": "A = 1\n", "toy/b.py": "B = 2\n"})
    _pin(monkeypatch, fetch.sha256_of(wheel), ("toy/a.py",))
    lines: list[str] = []
    root = fetch.fetch("toy", log=lines.append)
    assert (root / "toy/a.py").read_text() == "A = 1\n" and not (root / "toy/b.py").exists()
    assert fetch.manifest("toy") == {"toy/a.py": fetch.sha256_of(root / "toy/a.py")}
    mtime = (root / "toy/a.py").stat().st_mtime_ns
    lines.clear()
    fetch.fetch("toy", log=lines.append)
    assert any("up to date" in line for line in lines) and (root / "toy/a.py").stat().st_mtime_ns == mtime


def test_fetch_refuses_and_deletes_a_wheel_whose_sha256_differs(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _wheel(cache / "wheels", "toy_engine", "1.0", {"toy/a.py": "A = 1\n"})
    _pin(monkeypatch, "0" * 64, ("toy/a.py",))
    with pytest.raises(fetch.FetchError, match=r"has sha256 [0-9a-f]{64}, the pin is 0{64}: refused and deleted"):
        fetch.fetch("toy", log=lambda _: None)
    assert not wheel.exists()


def _companion_pin(monkeypatch: pytest.MonkeyPatch, sha: str, kernel_sha: str) -> None:
    kernel = fetch.Pin("toy", "toy-kernel", "0.2", kernel_sha, ("toy_kernel/k.py",))
    monkeypatch.setitem(fetch.PINS, "toy", fetch.Pin("toy", "toy-engine", "1.0", sha, ("toy/a.py", "toy_kernel/k.py"),
                                                     companions=(kernel,)))


def test_a_companion_wheel_lands_in_the_same_tree_as_in_site_packages(cache: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """TokenSpeed's layout: the engine wheel and the kernel wheel it requires, one tree, one manifest; an
    edited kernel file is repaired from the kernel wheel."""
    wheel = _wheel(cache / "wheels", "toy_engine", "1.0", {"toy/a.py": "A = 1\n"})
    kwheel = _wheel(cache / "wheels", "toy_kernel", "0.2", {"toy_kernel/k.py": "K = 3\n", "toy_kernel/x.so": "bin"})
    _companion_pin(monkeypatch, fetch.sha256_of(wheel), fetch.sha256_of(kwheel))
    root = fetch.fetch("toy", log=lambda _: None)
    assert (root / "toy/a.py").read_text() == "A = 1\n" and (root / "toy_kernel/k.py").read_text() == "K = 3\n"
    assert not (root / "toy_kernel/x.so").exists()
    assert set(fetch.manifest("toy")) == {"toy/a.py", "toy_kernel/k.py"}
    (root / "toy_kernel/k.py").write_text("K = 4\n")
    fetch.forget_verified()
    lines: list[str] = []
    fetch.verified_manifest("toy", log=lines.append)
    assert (root / "toy_kernel/k.py").read_text() == "K = 3\n" and "toy_kernel-0.2" in lines[0]


def test_a_companion_wheel_whose_sha256_differs_is_refused_and_deleted(cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _wheel(cache / "wheels", "toy_engine", "1.0", {"toy/a.py": "A = 1\n"})
    kwheel = _wheel(cache / "wheels", "toy_kernel", "0.2", {"toy_kernel/k.py": "K = 3\n"})
    _companion_pin(monkeypatch, fetch.sha256_of(wheel), "0" * 64)
    with pytest.raises(fetch.FetchError, match=r"toy_kernel-0.2-py3-none-any.whl has sha256 [0-9a-f]{64}, the pin is "
                                               r"0{64}: refused and deleted"):
        fetch.fetch("toy", log=lambda _: None)
    assert wheel.exists() and not kwheel.exists()
    assert not (cache / "toy-1.0" / fetch.MANIFEST).exists()


def test_the_tokenspeed_pin_carries_tokenspeed_kernel_0_1_4_by_its_sha256() -> None:
    pin = fetch.PINS["tokenspeed"]
    (kernel,) = pin.companions
    assert (kernel.dist, kernel.version, kernel.sha256) == (
        "tokenspeed-kernel", "0.1.4", "958ed94e8ec272ba198277bda56b0b4fa10b03626a80bb7d2a5a50440cd0b38b")
    assert all(pin.wheel_of(f) is kernel for f in pin.files if f.startswith("tokenspeed_kernel/"))
    assert all(pin.wheel_of(f) is pin for f in pin.files if f.startswith("tokenspeed/"))


def test_fetch_without_network_says_so(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an index nobody listens on: pip fails at once, as it does on a machine without network
    _pin(monkeypatch, "0" * 64, ("toy/a.py",),
         ("--index-url", "http://127.0.0.1:9/simple", "--retries", "0", "--timeout", "2"))
    with pytest.raises(fetch.FetchError, match=r"could not download toy-engine==1.0 .*no network"):
        fetch.fetch("toy", log=lambda _: None)


def test_stubbed_modules_leave_sys_modules_exactly_as_they_were(tmp_path: Path) -> None:
    mod_file = tmp_path / "engine_mod.py"
    mod_file.write_text("from fake_engine.sub import VALUE\nimport json\nDOUBLE = 2 * VALUE\n")
    before = dict(sys.modules)
    stubs = {"fake_engine": source.stub("fake_engine"), "fake_engine.sub": source.stub("fake_engine.sub", VALUE=21)}
    module = source.load_module(mod_file, "k3num_test_mod", stubs)
    assert module.DOUBLE == 42
    assert sys.modules.keys() == before.keys() and all(sys.modules[k] is v for k, v in before.items())


def test_lift_runs_one_method_with_injected_names_and_reports_a_missing_one(tmp_path: Path) -> None:
    f = tmp_path / "heavy.py"
    f.write_text("import not_installed_anywhere\n\n"
                 "class M:\n    def scaled(self, x):\n        return helper(x) * self.k\n")
    scaled = source.lift(f, "M.scaled", {"helper": lambda x: x + 1})
    assert scaled(type("S", (), {"k": 3})(), 1) == 6
    assert source.signature_of(f, "M.scaled") == ["self", "x"]
    with pytest.raises(source.SourceError, match="M.missing: missing not found"):
        source.lift(f, "M.missing", {})
