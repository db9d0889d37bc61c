"""The result-row schema and its JSON Lines file: validation names the bad field; appends are
atomic (concurrent writers lose nothing, a SIGKILLed writer leaves only whole lines); the reader
skips and reports corrupt lines; trial_key is a stable, hashable identity of inputs only."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from records import Figures, RowError, append_rows, encode, finished_keys, read_rows, trial_key, validate_row
from tests.rowfactory import make_row

REPO = Path(__file__).resolve().parents[3]


def test_round_trip(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [make_row(seq_len=s, figures=Figures(peak_bytes=123)) for s in (1024, 2048)]
    assert append_rows(path, rows) == 2
    back = read_rows(path, on_error="raise")
    assert [r.to_dict() for r in back] == [r.to_dict() for r in rows]
    assert isinstance(back[0].figures, Figures) and back[0].figures.peak_bytes == 123


@pytest.mark.parametrize("field,value,needle", [
    ("mode", "fast", "row.mode"),
    ("status", "crashed", "row.status"),
    ("seq_len", "4096", "row.seq_len"),
    ("seq_len", 0, "row.seq_len"),
    ("world_size", 2.5, "row.world_size"),
    ("options", [], "row.options"),
    ("status", "oom", "row.message"),  # an oom row must say why
    ("dtype", "fp8", "row.dtype"),
])
def test_invalid_rows_are_refused_naming_the_field(tmp_path, field, value, needle):
    path = tmp_path / "rows.jsonl"
    with pytest.raises(RowError, match=needle.replace(".", r"\.")):
        bad = make_row(message="")
        setattr(bad, field, value)  # the raw value, past the factory's conveniences
        append_rows(path, [make_row(), bad])
    assert not path.exists(), "nothing may be written when any row is invalid"


def test_invalid_nested_fields_are_named():
    d = make_row().to_dict()
    d["figures"]["peak_bytes"] = "big"
    with pytest.raises(RowError, match=r"row\.figures\.peak_bytes"):
        validate_row(d)
    d = make_row().to_dict()
    d["env"].pop("git_commit")
    with pytest.raises(RowError, match=r"row\.env\.git_commit is missing"):
        validate_row(d)
    d = make_row().to_dict()
    d["surprise"] = 1
    with pytest.raises(RowError, match=r"unknown field\(s\) \['surprise'\]"):
        validate_row(d)
    d = make_row().to_dict()
    d["figures"]["step_time_s"] = float("nan")
    with pytest.raises(RowError, match="NaN"):
        validate_row(d)
    with pytest.raises(RowError, match=r"row\.link"):
        validate_row(make_row(mode="emulated", link=None))
    with pytest.raises(RowError, match=r"row\.search"):
        validate_row(make_row(kind="max_context"))


def test_trial_key_is_stable_and_ignores_outcomes():
    a = make_row(options={"b": 1, "a": 2})
    b = make_row(options={"a": 2, "b": 1}, status="oom", message="too big", figures=Figures(peak_bytes=9))
    assert trial_key(a) == trial_key(b) == trial_key(a.to_dict())
    assert hash(trial_key(a)) == hash(trial_key(b))
    assert trial_key(make_row(seq_len=8192)) != trial_key(a)
    assert trial_key(make_row(levers={"fsdp": False})) != trial_key(a)
    assert trial_key(make_row(mode="real")) != trial_key(a)
    # the key survives a trip through the file
    assert trial_key(json.loads(encode(a))) == trial_key(a)


def test_trial_key_of_an_auto_row_is_the_request():
    """A chunk_heads=auto row records the U it chose; the trial it answers asked for auto."""
    auto = make_row(options={"chunk_heads": 8, "chunk_heads_requested": "auto"})
    assert trial_key(auto) == trial_key(make_row(options={"chunk_heads": "auto"}))
    assert trial_key(auto) != trial_key(make_row(options={"chunk_heads": 8}))


def test_reader_skips_and_reports_corrupt_lines(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    append_rows(path, [make_row(seq_len=1024)])
    with open(path, "a") as f:
        f.write('{"kind": "trial", "oops\n')  # not JSON
        f.write(json.dumps({**make_row().to_dict(), "mode": "warp"}) + "\n")  # not a valid row
    append_rows(path, [make_row(seq_len=2048)])
    with open(path, "a") as f:
        f.write('{"half": ')  # a cut-off last line, no newline
    bad: list = []
    rows = read_rows(path, on_error="skip", bad=bad)
    assert [r.seq_len for r in rows] == [1024, 2048]
    assert [b.line_no for b in bad] == [2, 3, 5]
    assert "row.mode" in bad[1].error and "incomplete last line" in bad[2].error
    read_rows(path)  # default: warn
    err = capsys.readouterr().err
    assert err.count("warning: skipping corrupt row") == 3 and f"{path}:2:" in err
    with pytest.raises(RowError, match=r"rows\.jsonl:2: "):
        read_rows(path, on_error="raise")
    # appending after a cut-off line removes the fragment (a killed writer's part of a row) under its lock:
    # nothing is glued to it, and the file's bad lines are the two in its middle
    append_rows(path, [make_row(seq_len=4096)])
    bad = []
    assert [r.seq_len for r in read_rows(path, on_error="skip", bad=bad)] == [1024, 2048, 4096]
    assert [b.line_no for b in bad] == [2, 3] and b'{"half": ' not in path.read_bytes()


def test_an_unterminated_last_line_is_never_a_row_and_never_raises(tmp_path):
    """A row is complete with its newline, its last byte: a line without one is a write in progress or a
    writer killed mid-write (one write of a row longer than a page can be cut by SIGKILL), so even
    ``on_error="raise"`` passes over it, and the next append drops it (here the whole file was one)."""
    path = tmp_path / "rows.jsonl"
    line = json.dumps(make_row(seq_len=1024).to_dict()) + "\n"
    path.write_text(line[: len(line) // 2])
    assert read_rows(path, on_error="raise") == []
    append_rows(path, [make_row(seq_len=2048)])
    path.write_bytes(path.read_bytes() + line.encode()[:-1])  # all of a row but its newline
    bad = []
    assert [r.seq_len for r in read_rows(path, on_error="raise")] == [2048]
    assert [r.seq_len for r in read_rows(path, on_error="skip", bad=bad)] == [2048]
    assert len(bad) == 1 and bad[0].line_no == 2 and "incomplete last line" in bad[0].error
    append_rows(path, [make_row(seq_len=4096)])
    assert [r.seq_len for r in read_rows(path, on_error="raise")] == [2048, 4096]


def test_finished_keys(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_rows(path, [make_row(seq_len=1024), make_row(seq_len=2048, status="error", message="boom")])
    assert finished_keys(path) == {trial_key(make_row(seq_len=1024))}
    assert finished_keys(tmp_path / "missing.jsonl") == set()


def _writer(path: str, tag: int, n: int) -> None:
    for i in range(n):
        append_rows(path, [make_row(seq_len=1 + i, world_size=1 + tag, message="x" * (i % 7) * 500)])


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "rows.jsonl")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, t, 60)) for t in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = read_rows(path, on_error="raise")
    assert len(rows) == 240
    for t in range(4):
        assert sorted(r.seq_len for r in rows if r.world_size == 1 + t) == list(range(1, 61))


KILL_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from tests.rowfactory import make_row
from records import append_rows
i = 0
while True:
    i += 1
    append_rows({path!r}, [make_row(seq_len=i, message="y" * 20000)])
"""


def test_writer_killed_mid_loop_leaves_whole_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT.format(repo=str(REPO), path=str(path))])
    try:
        deadline = time.time() + 60
        while (not path.exists() or path.stat().st_size < 2_000_000) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    rows = read_rows(path, on_error="raise")  # every line is whole and valid, but an unterminated last one
    assert len(rows) > 50
    assert [r.seq_len for r in rows] == list(range(1, len(rows) + 1))
    append_rows(path, [make_row(seq_len=len(rows) + 1)])  # the next writer goes on from the whole rows
    assert path.read_bytes().endswith(b"\n")
    assert [r.seq_len for r in read_rows(path, on_error="raise")] == list(range(1, len(rows) + 2))


def _spread_row(times=(2.0, 1.0, 4.0, 3.0, 1.5), **figs):
    f = Figures(step_time_s=2.0, step_time_min_s=1.0, step_time_max_s=4.0, step_times_s=list(times),
                host_load_before=2.5, host_load_after=3.0, host_cpus=2, trial_threads=2, host_shared=True)
    for k, v in figs.items():
        setattr(f, k, v)
    return make_row(mode="real", device="cpu", figures=f)


def test_step_spread_and_host_load_round_trip(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_rows(path, [_spread_row()])
    (back,) = read_rows(path, on_error="raise")
    f = back.figures
    assert f.step_times_s == [2.0, 1.0, 4.0, 3.0, 1.5]
    assert (f.step_time_s, f.step_time_min_s, f.step_time_max_s) == (2.0, 1.0, 4.0)
    assert (f.host_load_before, f.host_load_after, f.host_cpus, f.trial_threads, f.host_shared) == (2.5, 3.0, 2, 2,
                                                                                                     True)


def test_rows_without_a_spread_stay_valid():
    old = make_row(mode="real", device="cpu", figures=Figures(step_time_s=14.45, compute_time_s=14.45))
    assert validate_row(old.to_dict()).figures.step_times_s is None


@pytest.mark.parametrize("figs,needle", [
    (dict(step_time_s=2.5), "not the median/min/max"),       # the mean, not the median
    (dict(step_time_max_s=3.0), "not the median/min/max"),
    (dict(step_times_s=[]), "non-empty list of seconds"),
    (dict(step_times_s=[1.0, "x"]), "non-empty list of seconds"),
    (dict(step_times_s=None), "need the steps they summarise"),
    (dict(step_time_min_s=None), "needs step_time_s"),
])
def test_a_spread_that_does_not_match_its_steps_is_refused(figs, needle):
    with pytest.raises(RowError, match=needle):
        validate_row(_spread_row(**figs).to_dict())
