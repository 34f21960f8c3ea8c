"""The subject and capability records (engines/subjects.py): every subject has one, with a typed signature
every engine's binding accepts and an oracle that harness/oracle.py has; every extras key any engine or
mutant uses is a declared capability, and an undeclared one is refused when the engine is built."""

from __future__ import annotations

import functools
import inspect

import pytest

from k3num.engines import base, registry, subjects
from k3num.harness import coverage, oracle
from tests import mutants


def test_every_subject_has_one_record_and_every_record_names_a_subject() -> None:
    assert set(subjects.SUBJECT_RECORDS) == set(base.SUBJECTS)
    assert all(r.name == n for n, r in subjects.SUBJECT_RECORDS.items())


def test_every_records_oracle_is_an_oracle_entry_point() -> None:
    entries = set(oracle.Oracle.entry_points())
    assert {r.oracle for r in subjects.SUBJECT_RECORDS.values()} <= entries


def test_the_coverage_paths_are_the_records() -> None:
    assert coverage.PATH_OF is subjects.PATH_OF
    for name, r in subjects.SUBJECT_RECORDS.items():
        assert subjects.PATH_OF[name] == r.path in ("1", "2", "3")
    for name, c in subjects.CAPABILITIES.items():
        assert c.kind in ("contract", "fact")
        assert (c.path in ("1", "2", "3")) == (c.kind == "contract"), name
        assert (name in subjects.PATH_OF) == (c.kind == "contract"), name


def _required(signature: type) -> tuple[list[None], dict[str, None]]:
    params = list(inspect.signature(signature.__call__).parameters.values())[1:]  # less self
    return ([None for p in params if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty],
            {p.name: None for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty})


def _engines() -> list[base.Engine]:
    out = []
    for name in registry.known():
        try:
            out.append(registry.get(name))
        except registry.EngineUnavailable:
            continue
    return out


def test_every_bound_subject_accepts_its_records_signature() -> None:
    checked = 0
    for engine in _engines():
        for name, fn in engine.subjects.items():
            signature = subjects.SUBJECT_RECORDS[name].signature
            args, kwargs = _required(signature)
            try:
                inspect.signature(fn).bind(*args, **kwargs)
            except TypeError as e:
                pytest.fail(f"{engine.name} {name}: does not take {signature.__name__}'s arguments ({e})")
            checked += 1
    assert checked >= len(base.SUBJECTS)  # the mirror binds them all


def test_a_binding_with_another_signature_is_caught() -> None:
    args, kwargs = _required(subjects.ProjectUnsharded)
    with pytest.raises(TypeError):
        inspect.signature(lambda taps, fc_weight, eps: None).bind(*args, **kwargs)  # no norm_weight


def test_every_engine_and_mutant_uses_only_declared_capabilities() -> None:
    used = set()
    for engine in _engines():
        used |= set(engine.extras)
    for name in mutants.ALL:
        used |= set(mutants.build(name).extras)
    assert used <= set(subjects.CAPABILITIES)
    assert used >= {"weight_loading", "pp_taps", "kv_transfer", "attn_res_admits"}  # the scan saw the engines


def test_an_undeclared_extras_key_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"engine x: extras \['weight_loader'\] are not declared capabilities"):
        base.Engine(name="x", version="0", mode="reference", subjects={}, extras={"weight_loader": None})


def test_every_adapter_declares_what_it_binds_in_the_one_format() -> None:
    """(engine, file, function, language, K3 path, subjects) rows from each adapter package; the engine is one the
    registry pins, each subject or capability named is a record, and the path is one of theirs."""
    import importlib

    pinned, rows = set(registry.pinned()), []
    for module in registry.adapters():
        mine = importlib.import_module(module).coverage_rows()
        assert mine, f"{module}: declares no row"
        rows += mine
    for engine, file, function, language, path, subject in rows:
        assert engine in pinned and file and function and language in ("python", "triton", "cuda"), (engine, file)
        paths = {subjects.PATH_OF[name] for name in subject.split(",")}  # every name a declared one
        assert path in paths, (engine, function, subject, path)  # a function serving two paths names one
    assert {r[0] for r in rows} == pinned  # every real engine declares its rows


def test_the_replayed_properties_are_the_subject_tables_and_each_has_a_judge() -> None:
    """`k3num replay` judges a bundle with this harness's oracle when the subject's record lists its property;
    every such property has a judge (judges.REPLAYABLE), and every judge serves a record."""
    from k3num.harness import judges

    listed = {p for r in subjects.SUBJECT_RECORDS.values() for p in r.replays}
    assert listed == set(judges.REPLAYABLE)
    assert subjects.replays(base.ATTN_RES, "poisoned_output_fully_written")
    assert not subjects.replays(base.AUX_CAPTURE, "attn_res_within_rounding_budget")
    assert not subjects.replays("weight_loading", "fused_within_budget_of_unfused")  # a capability, not a subject


def test_the_api_gives_each_subjects_oracle_from_the_table_as_the_judges_see_it() -> None:
    from k3num import api
    from k3num.refmodel import mla, partial_projection

    assert api.subjects.SUBJECT_RECORDS is subjects.SUBJECT_RECORDS
    assert api.oracle_of(base.CONTEXT_KV_FUSED) is mla.context_kv
    assert api.oracle_of(base.DRAFT_CONTEXT_KV) is partial_projection.draft_context_kv
    scoped = oracle.PLAIN.wrapped(lambda name, fn: functools.partial(fn))  # another callable per entry point
    with oracle.using(scoped):
        assert api.oracle_of(base.PROJECT_UNSHARDED) is scoped.project_context
    assert api.oracle_of(base.PROJECT_UNSHARDED) is partial_projection.project_context
    with pytest.raises(ValueError, match="no subject 'nope'"):
        api.oracle_of("nope")


def test_an_engines_capabilities_are_one_typed_record_read_as_a_mapping_of_those_it_has() -> None:
    """Engine.extras is subjects.Capabilities whatever the adapter passed: a field per capability (None: not
    had), the table's records read off its fields, and the mapping views only the ones the engine has."""
    import dataclasses

    e = base.Engine(name="x", version="0", mode="reference", subjects={},
                    extras={"kv_transfer_missing": "none here", "pp_taps_hidden": False})
    assert isinstance(e.extras, subjects.Capabilities)
    assert dict(e.extras) == {"pp_taps_hidden": False, "kv_transfer_missing": "none here"}  # False is had
    assert "kv_transfer" not in e.extras and e.extras.get("kv_transfer") is None and len(e.extras) == 2
    with pytest.raises(KeyError):
        e.extras["kv_transfer"]
    with pytest.raises(KeyError):
        e.extras["not_a_capability"]
    assert e.extras.kv_transfer_missing == "none here"  # typed attribute access too
    assert [f.name for f in dataclasses.fields(subjects.Capabilities)] == list(subjects.CAPABILITIES)
    again = dataclasses.replace(e, version="1", extras={**e.extras, "kv_transfer_missing": "other"})
    assert again.extras.kv_transfer_missing == "other" and again.extras.pp_taps_hidden is False


def test_the_real_engines_are_the_pins_builds_each_a_factory_of_its_adapter_package() -> None:
    """Adding an engine is one PINS entry (its `builds`) and one adapter package: the registry's real engines,
    their pins and adapter packages are read from there."""
    import importlib

    from k3num.supply import fetch

    builds = [(name, pin.engine, attr) for pin in fetch.PINS.values() for name, attr in pin.builds]
    assert registry.pinned() == [name for name, _, _ in builds]
    for name, pin, attr in builds:
        assert registry.pin_of(name) == pin
        assert callable(getattr(importlib.import_module(f"k3num.engines.{pin}_adapter"), attr)), (name, attr)
    assert registry.adapters() == list(dict.fromkeys(f"k3num.engines.{pin}_adapter" for _, pin, _ in builds))


def test_a_subject_is_named_once_in_its_record_and_base_reads_the_names_from_there() -> None:
    assert base.SUBJECTS == tuple(subjects.SUBJECT_RECORDS)
    with pytest.raises(ValueError, match="unknown name 'no_such_subject'"):
        base.Engine(name="e", version="0", mode="m", subjects={}).subject("no_such_subject")


def test_the_steps_subjects_it_does_not_call_are_the_records_reasons() -> None:
    from k3num.harness import draft_step

    assert draft_step.NOT_IN_THE_STEP == {n: r.not_in_step for n, r in subjects.SUBJECT_RECORDS.items()
                                          if r.not_in_step}
    in_paths = {n for names in draft_step.PATHS.values() for n in names}
    assert not in_paths & set(draft_step.NOT_IN_THE_STEP)  # a subject the step calls gives no reason it does not


def test_a_new_subject_is_its_record_its_binding_its_property_and_its_mutant(monkeypatch, tmp_path) -> None:
    """A subject added in the four files docs/adding-a-property.md names, simulated: its record (here planted in
    the table), a binding (an engine carrying it), its property module's determinism declaration (a module in a
    temporary properties folder). Nothing else is needed for the vocabulary, the step's placement and the
    determinism rule; without the record's reason the step refuses it, naming it."""
    import dataclasses

    from k3num.harness import draft_step
    from k3num.properties.checks import determinism

    record = subjects.SubjectRecord("planted_subject", "2", subjects.AttnResMix, "attn_res_with_sources",
                                    not_in_step="a planted subject: a test of the record's reason")
    monkeypatch.setitem(subjects.SUBJECT_RECORDS, record.name, record)
    assert "planted_subject" in base.SUBJECTS
    engine = base.Engine(name="e", version="0", mode="reference", subjects={"planted_subject": lambda *a: None})
    assert engine.subject("planted_subject") is not None
    assert draft_step.reach(engine) == {"planted_subject": "not in the step: " + record.not_in_step}
    (tmp_path / "test_planted.py").write_text(
        "test_planted_is_deterministic_across_calls = deterministic_across_calls('planted_subject', None, None)\n")
    assert determinism.without_determinism(coverage.determinism_declared(tmp_path)) == ""
    monkeypatch.setitem(subjects.SUBJECT_RECORDS, record.name, dataclasses.replace(record, not_in_step=""))
    with pytest.raises(KeyError, match="planted_subject is bound but neither in the step's PATHS nor excused"):
        draft_step.reach(engine)


_DECLARING = '''
from k3num.engines import base
from k3num.properties.checks.determinism import deterministic_across_calls

NEW = "attn_res_mix_eager"
test_a_is_deterministic_across_calls = deterministic_across_calls(base.ATTN_RES_MIX, None, None)
test_b_is_deterministic_across_calls = deterministic_across_calls("attn_res_mix_triton", None, None)
test_c_is_deterministic_across_calls = deterministic_across_calls(NEW, None, None)
'''


def test_a_determinism_property_declared_in_a_property_module_is_read_from_its_source(tmp_path) -> None:
    (tmp_path / "test_new.py").write_text(_DECLARING)
    assert coverage.determinism_declared(tmp_path) == {
        "attn_res_mix": "test_new.py::test_a_is_deterministic_across_calls",
        "attn_res_mix_triton": "test_new.py::test_b_is_deterministic_across_calls",
        "attn_res_mix_eager": "test_new.py::test_c_is_deterministic_across_calls"}
    (tmp_path / "test_bad.py").write_text("x = 1\ntest_d = deterministic_across_calls(f(x), None, None)\n")
    with pytest.raises(ValueError, match="test_bad.py:2: .*must be a string"):
        coverage.determinism_declared(tmp_path)
    (tmp_path / "test_bad.py").write_text("helper = deterministic_across_calls('attn_res', None, None)\n")
    with pytest.raises(ValueError, match="assigned to a module-level name starting with test_"):
        coverage.determinism_declared(tmp_path)


def test_a_subject_without_a_determinism_property_or_with_two_is_refused_naming_it(monkeypatch) -> None:
    from k3num.properties.checks import determinism

    assert determinism.without_determinism(coverage.determinism_declared()) == ""  # the repository as it is
    planted = subjects.SubjectRecord("planted_subject", "2", subjects.AttnResMix, "attn_res_with_sources")
    monkeypatch.setitem(subjects.SUBJECT_RECORDS, planted.name, planted)
    assert "no determinism property for ['planted_subject']" in determinism.without_determinism({})
    assert determinism.without_determinism({"planted_subject": "test_x.py::test_y"}) == ""
    assert "declared beside KERNEL_SUBJECTS' own: ['context_kv_fused']" in determinism.without_determinism(
        {"planted_subject": "test_x.py::test_y", "context_kv_fused": "test_x.py::test_z"})


def test_a_declared_determinism_property_fails_a_subject_that_answers_differently_on_repeated_calls() -> None:
    """The property `deterministic_across_calls` builds, run on the mirror's read-only mixture (passes) and on a
    mutant of it whose output moves by one bf16 ulp on every other call (fails: the calls are not bitwise equal)."""
    import torch

    from k3num.properties.checks import determinism

    mirror = registry.get("mirror")
    fn = mirror.subject(base.ATTN_RES_MIX)
    cases = determinism.KERNEL_SUBJECTS[base.ATTN_RES_MIX][0]
    test = determinism.deterministic_across_calls(base.ATTN_RES_MIX, cases, determinism._mix)
    test(engine=mirror)
    count = iter(range(1 << 20))

    def flaky(*args):
        out = fn(*args)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if next(count) % 2 else out

    broken = base.Engine(name="mutant-flaky-mix", version="0", mode="reference", subjects={base.ATTN_RES_MIX: flaky})
    with pytest.raises(AssertionError, match="deterministic_across_calls.*2 distinct of"):
        test(engine=broken)
