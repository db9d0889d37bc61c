"""Document-length distributions (``records.workloads``): every one loads with its source, packs a
sequence exactly, is deterministic by seed, truncates its last document, and honours its source's
rules (MagiAttention's quarter cap, ProLong's long-domain shares); ``DocsSpec`` parses and refuses
bad input in one line."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from records.workloads import DocsSpec, check_fields, get, names, parse_lengths, sample, summary
from records.workloads.distributions import DATA, FAMILIES, Histogram, Mixture, published

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = ["pile", "prolong64k", "prolong512k", "magiattention-cp", "prolong-mix-64k", "prolong-mix-512k"]
ALL = PUBLISHED + ["uniform-1K-16K", "fixed-3K"]
LENGTHS = [1, 1000, 64 << 10, 1 << 20]


def test_the_published_distributions_are_there_with_their_sources():
    assert sorted(published()) == sorted(PUBLISHED)
    assert names() == [*published(), *FAMILIES]
    readme = (DATA / "README.md").read_text()
    for name in PUBLISHED:
        d = get(name)
        assert d.name == name and d.description
        assert {"repository", "commit", "path"} <= set(d.source), name
        assert len(d.source["commit"]) == 40 and d.source["commit"] in readme, name
        assert f"`{name}`" in readme, f"{name} is not in records/workloads/data/README.md's table"


def test_histograms_hold_the_sources_numbers():
    pile, magi = get("pile"), get("magiattention-cp")
    assert isinstance(pile, Histogram) and len(pile.bins) == 41 and pile.bins[0] == (0, 32, 0.029931)
    assert pile.bins[-1] == (14208, 9323168, 0.002246) and pile.within == "uniform"
    assert len(get("prolong64k").bins) == 44 and len(get("prolong512k").bins) == 42
    # MagiAttention: 13.46M documents, closed ranges stored half-open, midpoints, a quarter cap
    assert sum(w for _, _, w in magi.bins) == 13_463_214
    assert magi.bins[0] == (0, 11, 30254) and magi.bins[-1] == (131073, 196609, 18284)
    assert magi.within == "midpoint" and magi.cap_fraction == 0.25
    mix = get("prolong-mix-64k")
    assert isinstance(mix, Mixture) and mix.short is get("pile")
    long_share = sum(f for _, f, n in mix.components if n is not None)
    assert long_share == pytest.approx(0.6) and {n for _, _, n in mix.components} == {65536, None}


@pytest.mark.parametrize("name", ALL)
def test_every_distribution_packs_the_sequence_exactly(name):
    for seq_len in LENGTHS:
        lengths = sample(name, seq_len, 3)
        assert sum(lengths) == seq_len and min(lengths) >= 1 and all(isinstance(n, int) for n in lengths)


@pytest.mark.parametrize("name", ALL)
def test_deterministic_by_seed(name):
    a = sample(name, 256 << 10, 7)
    sample.cache_clear()  # drawn again, not read from the cache
    assert sample(name, 256 << 10, 7) == a
    if name != "fixed-3K":  # every fixed document is the same; the rest differ by seed
        assert any(sample(name, 256 << 10, s) != a for s in range(1, 4))


def test_the_last_document_is_truncated():
    assert sample("fixed-3K", 8 << 10) == (3072, 3072, 2048)
    assert sample("uniform-1K-16K", 1000) == (1000,)  # one draw of at least 1K, cut to the sequence
    # an unbounded histogram's draw is cut to what is left: every document but the last is a draw
    lengths = sample("pile", 4 << 10, 0)
    pile = get("pile")
    assert all(pile.bins[0][0] <= n < pile.bins[-1][1] for n in lengths)


def test_magiattention_cuts_documents_at_a_quarter_of_the_sequence():
    for seq_len in (64 << 10, 1 << 20):
        for seed in range(5):
            assert max(sample("magiattention-cp", seq_len, seed)) <= seq_len // 4
    # each length is a bin midpoint, a quarter piece, or a remainder of either
    magi = get("magiattention-cp")
    mids = {(lo + hi - 1) // 2 if lo else (1 + hi - 1) // 2 for lo, hi, _ in magi.bins}
    lengths = sample("magiattention-cp", 1 << 20, 1)
    assert sum(n in mids or n == (1 << 18) for n in lengths) >= len(lengths) - 10


def test_prolong_mix_fills_each_long_domain_share_with_its_documents():
    seq_len = 1 << 20
    lengths = sample("prolong-mix-512k", seq_len, 0)
    # 15% code and 5% books at 512K: shares below one document, each one truncated piece
    assert lengths.count(int(seq_len * 0.15)) >= 1 and int(seq_len * 0.05) in lengths
    # 64K domains: 15% code and 25% books -> floor(share / 64K) whole documents each
    assert lengths.count(65536) == int(seq_len * 0.15) // 65536 + int(seq_len * 0.25) // 65536


def test_lengths_are_what_documents_take():
    from methods import Documents

    lengths = sample("prolong64k", 128 << 10, 2)
    docs = Documents.from_lengths(lengths, 128 << 10)
    assert docs.lengths == lengths and DocsSpec("prolong64k", 2).documents(128 << 10) == docs


def test_summary():
    assert summary([1, 2, 6]) == {"count": 3, "min": 1, "max": 6, "mean": 3.0}


def test_records_workloads_imports_no_torch():
    code = ("import sys; import records.workloads as w; w.sample('prolong-mix-64k', 65536, 1); "
            "w.DocsSpec.parse('pile:2').fields(4096); sys.exit('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr or "records.workloads imported torch"


# ----------------------------------------------------------------------------- DocsSpec

def test_docs_spec_forms_and_fields():
    assert DocsSpec.parse("prolong64k") == DocsSpec("prolong64k", 0)
    assert DocsSpec.parse("uniform-1K-4K:12") == DocsSpec("uniform-1K-4K", 12)
    spec = DocsSpec.parse("fixed-1K:5")
    assert spec.fields(4096) == {"distribution": "fixed-1K", "seed": 5, "count": 4, "min": 1024, "max": 1024,
                                 "mean": 1024.0}
    assert spec.fields() == spec.identity() == {"distribution": "fixed-1K", "seed": 5}
    explicit = DocsSpec.from_lengths_text("4K, 2K\n2048")
    assert explicit.lengths == (4096, 2048, 2048) and explicit.fields(8192)["lengths"] == [4096, 2048, 2048]
    for d in (spec, explicit):
        assert DocsSpec.from_fields(d.fields(8192)) == d
        check_fields(d.fields(8192))
    assert DocsSpec.from_value(None) is None and DocsSpec.from_value("none") is None
    assert DocsSpec.from_value({"distribution": "pile", "seed": 3}) == DocsSpec("pile", 3)
    assert DocsSpec.from_value({"lengths": ["1K", 1024]}) == DocsSpec(lengths=(1024, 1024))


def test_lengths_files(tmp_path):
    good = tmp_path / "lengths.txt"
    good.write_text("4096\n4K\n")
    assert DocsSpec.from_lengths_file(good).lengths == (4096, 4096)
    assert DocsSpec.from_argument(str(good)).lengths == (4096, 4096)
    as_json = tmp_path / "lengths.json"
    as_json.write_text(json.dumps([1024, 3072]))
    assert DocsSpec.from_value({"lengths_file": str(as_json)}).lengths == (1024, 3072)
    assert parse_lengths("[1, 2]") == (1, 2) and parse_lengths("1,2 3") == (1, 2, 3)


BAD_LINES = [
    (lambda: DocsSpec.parse("nope"), "unknown document-length distribution 'nope'; choose one of ['magiattention-cp'"),
    (lambda: DocsSpec.parse("pile:two"), "the seed after ':' must be an integer, got 'two'"),
    (lambda: DocsSpec("pile", 1.5), "seed must be an integer, got 1.5"),
    (lambda: DocsSpec("pile", True), "seed must be an integer, got True"),
    (lambda: DocsSpec.parse("uniform-8K-1K"), "below the lower bound"),
    (lambda: DocsSpec.from_lengths_text("4K, x"), "entry 2 ('x') is not a positive token count"),
    (lambda: DocsSpec.from_lengths_text("4K, 0"), "entry 2 ('0') is not a positive token count"),
    (lambda: DocsSpec.from_lengths_text(""), "empty"),
    (lambda: DocsSpec.from_lengths_text("[1, 2"), "not a JSON list"),
    (lambda: DocsSpec.from_argument("no/such/file"), "and no file 'no/such/file' exists"),
    (lambda: DocsSpec.from_lengths_text("4K,4K").lengths_for(4096), "sum to 8192 but the sequence has 4096"),
    (lambda: DocsSpec.from_lengths_text("8K").lengths_for(4096), "a document of 8192 tokens is longer than the 4096"),
    (lambda: DocsSpec(), "exactly one of the two"),
    (lambda: DocsSpec(lengths=(4, 4), seed=3), "take no seed"),
    (lambda: DocsSpec.from_value({"foo": 1}), "expected none, NAME[:SEED]"),
    (lambda: check_fields({"distribution": "pile", "seed": 0, "colour": 1}), "unknown key(s) ['colour']"),
    (lambda: sample("pile", 0), "positive number of tokens"),
]


@pytest.mark.parametrize("make,needle", BAD_LINES, ids=[b[1][:30] for b in BAD_LINES])
def test_bad_input_is_one_line(make, needle):
    with pytest.raises(ValueError) as err:
        make()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_bad_lengths_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("4096\nfour thousand\n")
    with pytest.raises(ValueError, match=r"^lengths file .*bad.txt: entry 2 \('four'\) is not a positive") as err:
        DocsSpec.from_argument(str(bad))
    assert "\n" not in str(err.value)
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot be read: UnicodeDecodeError"):
        DocsSpec.from_lengths_file(binary)


def test_a_seeded_rng_is_what_sampling_uses():
    """The packing takes random.Random(seed) and nothing else: the same draws by hand agree."""
    expected = get("uniform-1K-16K").pack(64 << 10, random.Random(11))
    assert sample("uniform-1K-16K", 64 << 10, 11) == tuple(expected)
