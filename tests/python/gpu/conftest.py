import pytest


@pytest.fixture(autouse=True)
def _seed():
    torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
    torch.manual_seed(0)
