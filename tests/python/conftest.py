import os
import tempfile

import pytest

# Runtimes the tests create open a kernel cache: a private one unless the caller chose one.
os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-pytest-cache-"))


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)
