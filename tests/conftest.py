import os

import pytest


def pytest_collection_modifyitems(config, items):
    """Slow tests run by default (CI runs everything); QUICKDRAFT_SKIP_SLOW=1 skips them locally."""
    if os.environ.get("QUICKDRAFT_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="QUICKDRAFT_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def real_model_path():
    """Path of a default model by alias, pulled (and verified) on first use."""
    from quickdraft.weights.loader import ensure_pulled

    return ensure_pulled
