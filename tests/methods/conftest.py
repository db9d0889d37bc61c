import pytest

from tests.distpool import RankPool


@pytest.fixture(scope="module")
def pool():
    """One spawned group of 4 gloo ranks per test module (subgroups for world sizes 1, 2, 4)."""
    p = RankPool(4)
    yield p
    p.close()
