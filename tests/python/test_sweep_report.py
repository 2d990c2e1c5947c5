"""The shape sweep's report (bench/sweep/report.py) on small synthetic run files: the ratio
quantiles, ties at 0.98, errors counted as failing, the worst points, copy fractions at 1000+ rows,
shards merged, and the Markdown block rewritten in place."""
import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "sweep", "report.py")
_spec = importlib.util.spec_from_file_location("sweep_report", _PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

HEADER = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "liger": "0.8.5", "date": "2026-11-25 10:00 UTC"}


def point(label, rows, ratio=None, best="eager", status="ok", copy=None, cols=4096, models=("llama3-8b",), **extra):
    direction = "backward" if "_backward" in label else "forward"
    p = {"op": label.split("[")[0], "label": label, "direction": direction, "memory_bound": not label.startswith("fp8"),
         "models": list(models), "sizes": {"rows_label": f"t{rows}", "batch": 1, "seq": rows, "rows": rows,
                                           "cols": cols, "row_stride": cols}, "status": status}
    if status == "ok":
        p.update(ratio=ratio, best_peer=best if ratio is not None else None, copy_fraction=copy)
    p.update(extra)
    return p


def rms_norm_points():
    return [
        point("rms_norm", 1, 1.10, "liger", cols=896),
        point("rms_norm", 3, 0.98, "liger", cols=896),  # a tie, not below
        point("rms_norm", 16, 0.97, "liger", cols=896, models=("qwen2.5-0.5b",)),
        point("rms_norm", 1000, 1.50, "eager", copy=0.95),
        point("rms_norm", 4095, 0.50, "compile", copy=0.40, models=("llama3-8b", "mistral-7b")),
        point("rms_norm", 8191, 1.00, "eager", copy=0.99),
        point("rms_norm", 77, 1.2, "eager", copy=0.10),  # under 1000 rows: no copy fraction counted
        point("rms_norm", 16384, status="error", error="kiln disagrees with the fp32 reference: relative error 0.5"),
        point("rms_norm", 8188, status="not_run"),
    ]


def test_quantiles_ties_errors_and_worst_points():
    (row,) = report.summarize(rms_norm_points())
    ratios = [0.5, 0.97, 0.98, 1.0, 1.1, 1.2, 1.5]
    assert row["points"] == 8 and row["errors"] == 1 and row["not_run"] == 1
    assert row["min"] == 0.5
    # Linear interpolation between the closest ranks: p10 at rank 0.6, the median at rank 3.
    assert row["p10"] == pytest.approx(0.5 + 0.6 * (0.97 - 0.5))
    assert row["median"] == 1.0
    assert report.percentile(ratios[:6], 0.5) == pytest.approx((0.98 + 1.0) / 2)
    # 0.98 is a tie; the error counts as below.
    assert row["below"] == 3
    assert [p["status"] for p in row["worst"]] == ["error", "ok", "ok"]
    assert [p.get("ratio") for p in row["worst"][1:]] == [0.5, 0.97]
    assert row["best_peer"] == "eager"  # eager 3, liger 3: a tie goes to the name first alphabetically
    assert row["copy_min"] == 0.40 and row["copy_median"] == 0.95


def test_the_most_frequent_best_peer_and_at_most_five_worst():
    pts = [point("act_and_mul_backward[silu]", r, 0.5 + r / 1000, "liger", cols=14336) for r in range(1, 9)]
    pts.append(point("act_and_mul_backward[silu]", 20, 1.3, "compile", cols=14336))
    (row,) = report.summarize(pts)
    assert row["direction"] == "backward" and row["best_peer"] == "liger"
    assert row["below"] == 8 and len(row["worst"]) == 5
    assert [p["ratio"] for p in row["worst"]] == [0.501, 0.502, 0.503, 0.504, 0.505]


def test_points_without_a_peer_have_no_ratio():
    pts = [point("fp8_gemm[block]", 16, None), point("fp8_gemm[block]", 77, 1.02, "cublas")]
    (row,) = report.summarize(pts)
    assert row["points"] == 2 and row["no_peer"] == 1
    assert row["min"] == row["median"] == 1.02 and row["below"] == 0
    assert row["copy_min"] is None
    assert "| fp8_gemm[block] | forward | 2 (1 without a peer) | 1.02 |" in report.markdown([HEADER], [row])


def write(tmp_path, name, points, header=HEADER):
    path = tmp_path / name
    path.write_text(json.dumps({"header": header, "ops": {}, "points": points}))
    return str(path)


def test_shards_merge_and_a_point_not_run_never_replaces_one_that_ran(tmp_path):
    a = write(tmp_path, "a.json", [point("rms_norm", 1000, 0.9, copy=0.9), point("rms_norm", 4095, status="not_run")])
    b = write(tmp_path, "b.json", [point("rms_norm", 1000, status="not_run"), point("rms_norm", 4095, 1.2, copy=0.8)])
    headers, pts = report.load([a, b])
    assert len(headers) == 2 and len(pts) == 2
    assert sorted(p["ratio"] for p in pts) == [0.9, 1.2]
    c = write(tmp_path, "c.json", [point("rms_norm", 1000, 1.05, copy=0.97)])
    _, pts = report.load([a, b, c])  # a later measurement replaces an earlier one
    assert sorted(p["ratio"] for p in pts) == [1.05, 1.2]


def test_markdown_table_and_worst_list():
    pts = rms_norm_points() + [point("fp8_gemm[tensor]", 16, 1.01, "cublas"),
                               point("rms_norm_rope", 3, status="skipped", error="CUDA only")]
    text = report.markdown([HEADER], report.summarize(pts), ["docs/results/sweep.json"])
    assert "NVIDIA H100 80GB HBM3; torch 2.11.0+cu130, Liger 0.8.5; 2026-11-25 10:00 UTC" in text
    assert "Source: `docs/results/sweep.json`." in text
    assert "| rms_norm | forward | 8 | 0.50 | 0.78 | 1.00 | eager | 3 | 1 | 1 | 0.40 | 0.95 |" in text
    assert "| fp8_gemm[tensor] | forward | 1 | 1.01 | 1.01 | 1.01 | cublas | 0 | 0 | 0 |  |  |" in text
    assert "| rms_norm_rope | forward | skipped: CUDA only |" in text
    assert "  - llama3-8b, mistral-7b: t4095 (4095) x 4096: 0.500 against compile" in text
    assert "  - llama3-8b: t16384 (16384) x 4096: kiln error: kiln disagrees" in text
    assert "- rms_norm (3 below):" in text


def test_markdown_block_is_rewritten_between_the_markers(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold table\n{report.END}\n\n## After\nkept\n")
    path = write(tmp_path, "sweep.json", rms_norm_points())
    report.main([path, "--markdown", str(doc)])
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n" + report.BEGIN + "\nShape sweep: ")
    assert "old table" not in text
    assert text.endswith(report.END + "\n\n## After\nkept\n")
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    once = text
    report.main([path, "--markdown", str(doc)])
    assert doc.read_text() == once  # idempotent


def test_markdown_block_is_appended_where_there_is_none_and_a_lone_begin_is_refused():
    assert report.rewrite_block("text", "B\n") == f"text\n{report.BEGIN}\nB\n{report.END}\n"
    assert report.rewrite_block("", "B\n") == f"{report.BEGIN}\nB\n{report.END}\n"
    with pytest.raises(ValueError):
        report.rewrite_block(f"a\n{report.BEGIN}\nno end\n", "B\n")


def test_replace_keeps_only_the_latest_run_of_an_op_that_changed(tmp_path):
    """An op re-run after it changed: only its points of the last file that measured it count,
    those that run left out become not run; other ops merge as shards do."""
    old = [point("add_rms_norm_backward", 16, 0.4), point("add_rms_norm_backward", 4095, 0.7),
           point("rms_norm", 16, 1.1), point("rms_norm", 4095, 1.0)]
    new = [point("add_rms_norm_backward", 4095, 1.4), point("add_rms_norm_backward", 16, status="not_run"),
           point("rms_norm", 4095, 1.2), point("rms_norm", 16, status="not_run")]
    paths = []
    for name, pts in (("old.json", old), ("new.json", new)):
        (tmp_path / name).write_text(json.dumps({"header": HEADER, "points": pts}))
        paths.append(str(tmp_path / name))
    _, merged = report.load(paths, replace=("add_rms_norm_backward",))
    by = {(p["label"], p["sizes"]["rows"]): p for p in merged}
    assert by[("add_rms_norm_backward", 4095)]["ratio"] == 1.4
    assert by[("add_rms_norm_backward", 16)]["status"] == "not_run"
    assert by[("rms_norm", 16)]["ratio"] == 1.1 and by[("rms_norm", 4095)]["ratio"] == 1.2
    _, plain = report.load(paths)
    assert {(p["label"], p["sizes"]["rows"]): p.get("ratio") for p in plain}[("add_rms_norm_backward", 16)] == 0.4


def test_update_files_replace_point_by_point_after_replace(tmp_path):
    """A later run of only the sizes whose code changed: its points replace those of the same
    sizes, even for an op --replace limits to an earlier file, and the others stay."""
    old = [point("add_rms_norm_backward", 16, 0.4), point("add_rms_norm_backward", 4095, 0.7)]
    redo = [point("add_rms_norm_backward", 16, 0.9), point("add_rms_norm_backward", 4095, 1.3)]
    later = [point("add_rms_norm_backward", 1, 1.5), point("add_rms_norm_backward", 16, 1.2),
             point("add_rms_norm_backward", 4095, status="not_run")]
    paths = []
    for name, pts in (("old.json", old), ("redo.json", redo), ("later.json", later)):
        (tmp_path / name).write_text(json.dumps({"header": HEADER, "points": pts}))
        paths.append(str(tmp_path / name))
    headers, merged = report.load(paths[:2], replace=("add_rms_norm_backward",), updates=paths[2:])
    assert len(headers) == 3
    by = {p["sizes"]["rows"]: p.get("ratio") for p in merged}
    assert by == {1: 1.5, 16: 1.2, 4095: 1.3}  # not run never replaces a point that ran
