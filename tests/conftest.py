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
def bf16_pair(tmp_path_factory):
    """A tiny qwen2 target and a noisy copy of it as its draft (agreeing often, not always), in bf16 on the CPU:
    batch-invariant kernels, so speculative output must equal plain output exactly."""
    from quickdraft.config import EngineConfig
    from tests.helpers import target_and_noisy_draft

    config = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
    return target_and_noisy_draft(tmp_path_factory.mktemp("pair"), config)


@pytest.fixture(scope="session")
def real_model_path():
    """Path of a default model by alias, pulled (and verified) on first use."""
    from quickdraft.weights.loader import ensure_pulled

    return ensure_pulled
