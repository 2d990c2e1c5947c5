"""The shape sweep's data (bench/sweep/models.py): every model usable by every op, the token
counts and layouts the sweep covers, strided rows, and GEMMs with K not a multiple of 128."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "sweep", "models.py")
_spec = importlib.util.spec_from_file_location("sweep_models", _PATH)
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


def test_models_are_consistent():
    assert len({m.name for m in models.MODELS}) == len(models.MODELS) >= 12
    for m in models.MODELS:
        assert m.heads % m.kv_heads == 0, m.name  # grouped-query attention
        assert m.rotary_dim % 2 == 0 and m.rotary_dim <= m.head_dim, m.name
        assert min(m.hidden, m.intermediate, m.heads, m.head_dim) > 0, m.name


def test_every_op_has_points_with_the_asked_layouts():
    assert set(models.TOKENS) == {1, 3, 16, 77, 1000, 4095, 8191, 16384}
    assert any(b > 1 and s % 2 for b, s in models.BATCHES)
    for op in models.all_ops():
        pts = models.points(op)
        assert {p["model"] for p in pts} >= {m.name for m in models.MODELS}, op
        assert len({p["rows_label"] for p in pts}) == len(models.TOKENS) + len(models.BATCHES), op
        if op in models.ROW_OPS:
            assert any(p["row_stride"] > p["cols"] for p in pts), op
        if op in models.GEMM_OPS:
            assert any(p["k"] % 128 for p in pts), op


def test_dedupe_measures_each_size_once_and_keeps_its_models():
    pts = models.points("rms_norm")
    merged = models.dedupe(pts)
    assert len(merged) == len({tuple(sorted((k, v) for k, v in p.items() if k != "model")) for p in pts})
    by_key = {(p["rows_label"], p["cols"], p["row_stride"]): p["models"] for p in merged}
    # hidden 4096 without padding at 1000 tokens stands for every model of that width
    assert sorted(by_key[("t1000", 4096, 4096)]) == ["llama3-8b", "mistral-7b", "mixtral-8x7b", "qwen3-8b"]
    assert all("model" not in p for p in merged)
    assert sum(len(p["models"]) for p in merged) == len(pts)
    for p in merged:
        assert p["rows"] == p["batch"] * p["seq"]
