"""Every method's facts (``@register(..., facts=MethodFacts(...))``, ``records.facts``): declared
consistently with the method itself and with the paper's tables, readable without torch from the
committed table, and the only place outside ``methods/`` knowledge about methods comes from."""
from __future__ import annotations

import ast
import csv
import dataclasses
from pathlib import Path

import pytest

import methods
from bench.measure.config import StepConfig
from bench.stackmodel import fidelity
from methods.core import registry
from records import facts as records_facts
from records.facts import OURS, PAPER_COLUMNS, TABLE3_COLUMNS, MethodFacts, PaperRun

REPO = Path(__file__).resolve().parents[2]
PAPER_DIR = REPO / "results" / "paper"
INFOS = registry.package_infos()


def test_the_committed_table_is_the_registrys():
    text = records_facts.TABLE.read_text()
    assert text == registry.facts_table_text(), (
        "records/method_facts.json is not what the methods declare: run `python -m methods --write-facts`")
    assert len(INFOS) >= 16
    for info in INFOS:
        assert records_facts.facts_of(info.name) == info.facts, info.name
    assert len(set(INFOS)) == len(INFOS)  # entries stay hashable with their facts' mappings


def test_the_table_is_written_from_the_registry(tmp_path):
    path = registry.write_facts_table(tmp_path / "facts.json")
    assert records_facts.table(path) == {i.name: i.facts for i in INFOS if i.facts != MethodFacts()}
    (tmp_path / "old.json").write_text('{"upipe": {"column": "upipe", "colour": "red"}}')
    with pytest.raises(ValueError, match=r"unknown method facts \['colour'\]"):
        records_facts.table(tmp_path / "old.json")


def paper_rows() -> list[dict[str, str]]:
    rows = []
    for path in sorted(PAPER_DIR.glob("*.csv")):
        with open(path, newline="") as f:
            rows += [dict(r, table=path.stem) for r in csv.DictReader(f) if r.get("method")]
    return rows


def test_every_paper_column_of_the_paper_tables_has_its_implementation():
    """Each method name in results/paper/ is a paper column, simulated by exactly one registered
    method at the GPU count of the row (``bench.stackmodel.fidelity.implementation``), whose options parse."""
    rows = paper_rows()
    assert {r["table"] for r in rows} >= {"table3_throughput", "max_context", "fig5_multinode", "memory_anchors"}
    for r in rows:
        assert r["method"] in PAPER_COLUMNS, f"{r['table']}: {r['method']!r} is not in records.facts.PAPER_COLUMNS"
        impl = fidelity.implementation(r["method"], int(r["gpus"]))
        info = methods.get_info(impl.method)
        info.cls.parse_options(**impl.options)
    for column in TABLE3_COLUMNS:  # every Table 3 column has a family, listed in the paper's order
        assert any(i.facts.column == column for i in INFOS), column
    assert list(TABLE3_COLUMNS) == list(dict.fromkeys(r["method"] for r in rows if r["table"] == "table3_throughput"))


def test_each_paper_column_and_gpu_count_is_simulated_once():
    for column in PAPER_COLUMNS:
        for gpus in (1, 8, 9, 16):
            found = [i.name for i in INFOS for run in i.facts.simulates if run.column == column and run.covers(gpus)]
            assert len(found) == 1, (column, gpus, found)


def test_facts_agree_with_what_each_method_needs_and_takes():
    for info in INFOS:
        f = info.facts
        assert f.problems() == [], info.name
        # a library's kernels are the library's: it calls flash-attn itself exactly when it needs flash-attn
        assert f.library_kernels == ("flash_attn" in info.requires), info.name
        # our own methods need no optional module; every wrapper needs its library
        assert (f.library == OURS) == (not info.requires), info.name
        # a mesh is set by the ulysses_degree option, and every method taking one is a mesh
        option_names = {fl.name for fl in dataclasses.fields(info.cls.Options)}
        assert f.mesh == ("ulysses_degree" in option_names), info.name
        # a ring-step barrier needs a ring
        assert not f.ring_barrier or f.mesh or f.column == "ring", info.name
        for run in f.simulates:
            info.cls.parse_options(**run.options)
        assert set(f.levers) <= {fl.name for fl in dataclasses.fields(StepConfig)}, info.name


def test_one_reference_of_ours_per_column_and_mesh():
    seen: dict[tuple, str] = {}
    for info in INFOS:
        if info.facts.reference:
            key = (info.facts.column, info.facts.mesh)
            assert key not in seen, f"{info.name} and {seen[key]} are both our reference of {key}"
            seen[key] = info.name
    assert {c for c, mesh in seen if not mesh} >= set(TABLE3_COLUMNS) - {"torch-cp"}


def test_a_new_method_needs_no_facts_and_bad_facts_are_refused():
    class Plain(methods.core.base.AttentionMethod):
        pass

    try:
        registry.register("facts-test-plain", "a throw-away method")(Plain)
        info = methods.get_info("facts-test-plain")
        assert info.facts == MethodFacts() and records_facts.facts_of("facts-test-plain") == MethodFacts()
        assert "facts-test-plain" not in registry.facts_table_text()  # registered outside methods/
    finally:
        methods.unregister("facts-test-plain")
    bad = [(MethodFacts(library_kernels=True), "library_kernels=True needs the library"),
           (MethodFacts(column="Ring"), "column='Ring' is not a paper column"),
           (MethodFacts(library="flash-attn"), "library='flash-attn'"),
           (MethodFacts(kernel="fa4"), "kernel='fa4'"),
           (MethodFacts(simulates=(PaperRun("upipe", min_gpus=9, max_gpus=8),)), "simulates 'upipe' on no GPU"),
           (MethodFacts(reference=True), "reference=True is for our own implementation")]
    for facts, needle in bad:
        with pytest.raises(ValueError, match="inconsistent facts: .*" + needle.replace("(", r"\(")) as err:
            registry.register("facts-test-bad", "refused", facts=facts)
        assert "\n" not in str(err.value)
    assert "facts-test-bad" not in {i.name for i in methods.all_infos()}


# ----------------------------------------------------------------------------- no name lists elsewhere

PACKAGES = ("records", "bench", "sweeps", "analysis")
# names of methods that are words of another vocabulary too, which a scan of literals cannot tell
# apart: the paper's columns (records.facts.PAPER_COLUMNS: its Ring, Ulysses, UPipe, ... are
# columns of its tables) and the ``ac`` lever's value ``offload`` (``ac: offload``)
OTHER_VOCABULARY = {*PAPER_COLUMNS, "offload"}
# modules that may name methods, and why (each must still name one, so the list cannot go stale)
ALLOWED = {
    "analysis/style.py": "presentation: each method's display name and fixed colour in every figure "
                         "(a method not listed shows its own name and a colour hashed from it)",
    "bench/search/plan.py": "the planner's search space: the configurations it tries, by name",
    "bench/stackmodel/hfstack.py": "the hf stack's two paths: which methods Accelerate runs on sp_size "
                                   "(DeepSpeed ALST, UPipe through its integration) and which on cp_size",
    "bench/measure/trial.py": "AUTO_METHODS: the methods whose chunk_heads may be 'auto' "
                              "(bench.search.autochunk), not part of the method facts yet",
}


def method_literals(path: Path, names: set[str], root: Path = REPO) -> list[str]:
    """String literals in ``path`` (named relative to ``root``) that are a method's name or a prefix
    of method names (``yc-``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text in names or (text.endswith("-") and any(n.startswith(text) for n in names)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {text!r}")
    return found


def test_no_module_outside_methods_names_methods():
    """Knowledge about methods is in their facts: outside ``methods/`` no module holds method names
    or name prefixes, but those of ``ALLOWED`` (with their reasons)."""
    names = {i.name for i in INFOS} - OTHER_VOCABULARY
    assert {"yc-usp", "usp-upipe", "no-cp", "ds-fpdt", "rfa-zigzag"} <= names
    offending, allowed_hits = [], {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            hits = method_literals(path, names)
            if rel in ALLOWED:
                allowed_hits[rel] = hits
            else:
                offending += hits
    assert not offending, "method names outside methods/ (declare them as MethodFacts instead):\n" + "\n".join(
        offending)
    stale = [rel for rel in ALLOWED if not allowed_hits.get(rel)]
    assert not stale, f"allowed but naming no method any more (remove them from ALLOWED): {stale}"


def test_the_scan_finds_names_and_prefixes(tmp_path):
    # in a temporary folder, not the repository: a concurrent test must never see the probe
    probe = tmp_path / "records" / "_facts_scan_probe.py"
    probe.parent.mkdir()
    probe.write_text('LIBS = ("yc-", "ds-ulysses")\nLABEL = "yc-usp uses yunchang"\n')
    hits = method_literals(probe, {"ds-ulysses", "yc-usp"}, root=tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == ["'yc-'", "'ds-ulysses'"]
