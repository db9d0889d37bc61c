import pytest

from tests.distpool import RankPool
from tests.flash_attn_standin import install_if_missing


@pytest.fixture(scope="session")
def pool():
    """One spawned group of 4 gloo ranks (subgroups for world sizes 1, 2, 4) for every module here
    that asks for it, per test process (each pytest-xdist worker has its own).

    Spawning the ranks and importing into them what the methods need (torch, and for the library
    wrappers DeepSpeed, Transformers, yunchang) costs far more than most checks: once per process,
    not once per module. A check leaves nothing behind on the ranks: a failed one restarts the pool
    (``RankPool.run``). The guide's example modules keep their own pool (``guide_example.fixtures``),
    whose ranks import the example first. Each rank installs the flash-attn stand-in first (when
    flash-attn is missing), as this process did in tests/conftest.py, so the library wrappers run on
    the ranks too.
    """
    p = RankPool(4, setup=install_if_missing)
    yield p
    p.close()
