"""bench/measure/launch.py: which environment counts as launched, and local spawning."""
from __future__ import annotations

import pytest

from bench.measure import launch


def _rank_info(group, x):
    import torch.distributed as dist

    return (dist.get_rank(group), dist.get_world_size(group), x)


def _fail_on_one(group):
    import torch.distributed as dist

    if dist.get_rank(group) == 1:
        raise RuntimeError("rank one fails")
    return 0


def test_spawn_returns_every_rank_in_order():
    assert launch.spawn(2, _rank_info, "x", timeout_s=120) == [(0, 2, "x"), (1, 2, "x")]


def test_spawn_reports_a_failing_rank():
    with pytest.raises(launch.RankError, match="rank 1 raised:(.|\\n)*rank one fails"):
        launch.spawn(2, _fail_on_one, timeout_s=120)


def test_launched_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "SUBMITIT_EXECUTOR",
                "SUBMITIT_FOLDER"):
        monkeypatch.delenv(var, raising=False)
    assert launch.launched_env() is None and launch.is_rank_zero()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = launch.launched_env()
    assert info == {"source": "torchrun", "rank": 1, "world_size": 4, "local_rank": 1,
                    "master_addr": "10.0.0.1", "master_port": 29500}
    assert not launch.is_rank_zero()
    with pytest.raises(ValueError, match="launched as one of 4 ranks"):
        launch.run_ranks(2, _rank_info, "x")


def test_spawn_again_when_gloo_cannot_connect_the_ranks(monkeypatch, capsys):
    """gloo's full mesh failing to connect (before the task ran) spawns the ranks again, once, and says so;
    any other failure, or the same one twice, is the error."""
    calls = []

    def flaky(world_size, fn, *args, **kw):
        calls.append(world_size)
        if len(calls) == 1:
            raise launch.RankError(f"rank 1 raised:\n{launch.GLOO_CONNECT_FAILED}: Connection closed by peer", 1)
        return ["ok"] * world_size

    monkeypatch.setattr(launch, "_spawn_once", flaky)
    assert launch.spawn(2, _rank_info, "x") == ["ok", "ok"] and calls == [2, 2]
    assert "gloo could not connect the 2 ranks (rank 1" in capsys.readouterr().err

    def always(world_size, fn, *args, **kw):
        calls.append(world_size)
        raise launch.RankError(f"rank 0 raised:\n{launch.GLOO_CONNECT_FAILED}", 0)

    calls.clear()
    monkeypatch.setattr(launch, "_spawn_once", always)
    with pytest.raises(launch.RankError, match=launch.GLOO_CONNECT_FAILED):
        launch.spawn(2, _rank_info, "x")
    assert len(calls) == launch.SPAWN_ATTEMPTS

    def other(world_size, fn, *args, **kw):
        calls.append(world_size)
        raise launch.RankError("rank 1 raised:\nboom", 1)

    calls.clear()
    monkeypatch.setattr(launch, "_spawn_once", other)
    with pytest.raises(launch.RankError, match="boom"):
        launch.spawn(2, _rank_info, "x")
    assert calls == [2]
