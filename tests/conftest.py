"""Makes the test helpers importable, skips GPU-marked tests where there is no CUDA, and tells tests/_dist.py
which test is running (its run_ranks refuses gloo ranks to a test not marked multiproc)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # tryfirst: before the fixtures are set up, since a module-scoped fixture may spawn the ranks
    import _dist

    _dist.current_test = (item.nodeid, item.get_closest_marker("multiproc") is not None)


def pytest_runtest_teardown(item, nextitem):
    import _dist

    _dist.current_test = None
