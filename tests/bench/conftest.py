import pytest

from tests.distpool import RankPool


@pytest.fixture(scope="session")
def pool():
    """One spawned group of 4 gloo ranks for the whole bench test session (subgroups 1, 2, 4)."""
    p = RankPool(4)
    yield p
    p.close()
