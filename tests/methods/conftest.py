import pytest

from tests.distpool import RankPool
from tests.flash_attn_standin import install_if_missing


@pytest.fixture(scope="module")
def pool():
    """One spawned group of 4 gloo ranks per test module (subgroups for world sizes 1, 2, 4).

    Each rank installs the flash-attn stand-in first (when flash-attn is missing), as this
    process did in tests/conftest.py, so the library wrappers run on the ranks too.
    """
    p = RankPool(4, setup=install_if_missing)
    yield p
    p.close()
