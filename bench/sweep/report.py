"""The shape sweep's distribution table, as Markdown, from bench/sweep/run.py's JSON (one file per
shard, or several runs, plain or gzipped (.json.gz, as docs/results keeps them): a point measured
in a later file replaces an earlier one, one not run never replaces one that ran).

  python3 bench/sweep/report.py SWEEP.json [MORE.json ...] [--replace OP,...] [--update LATER.json,...]
                                [--markdown docs/benchmarks.md]

--replace names ops re-run after they changed: only their points from the last file that measured
them count (the earlier ones timed other code). --update names files measured after all of those,
point by point: each of their points replaces the one of the same sizes, whatever --replace says
(a re-run of only the sizes whose code changed, say the row counts a new kernel took over).

Per op and direction: the points measured, the min, p10 and median of the ratio best peer / kiln
(above 1: kiln is faster; at or above TIE a peer is within 2%, a tie), the peer that was best most
often, the points below TIE with the worst five, and for memory-bound ops the min and median
fraction of a same-size device copy's speed that kiln reaches at COPY_ROWS rows or more. A point
where kiln erred has no ratio and counts as below TIE; one where no peer ran has no ratio either
and is counted apart. --markdown rewrites the block between
BEGIN and END in FILE (appending one where FILE has none). Plain Python: no torch needed.
"""
import argparse
import gzip
import json
import math
from collections import Counter

TIE = 0.98
COPY_ROWS = 1000
WORST = 5
BEGIN, END = "<!-- BEGIN sweep -->", "<!-- END sweep -->"


def point_key(p):
    return p["label"], json.dumps(p["sizes"], sort_keys=True)


def load(paths, replace=(), updates=()):
    """(headers, points) of the files, each point once (see the module's note on merging). An op
    label in `replace` keeps only the points of the last file that measured it (re-run after the
    op changed: its earlier points timed other code). The files of `updates` come last, each point
    replacing the one of the same key."""
    headers, merged = [], {}
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
        headers.append(data["header"])
        fresh = {p["label"] for p in data["points"] if p["label"] in replace and p["status"] != "not_run"}
        if fresh:
            merged = {k: v for k, v in merged.items() if v["label"] not in fresh}
        for p in data["points"]:
            key = point_key(p)
            if p["status"] == "not_run" and key in merged and merged[key]["status"] != "not_run":
                continue
            merged[key] = p
    for path in updates:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
        headers.append(data["header"])
        for p in data["points"]:
            if p["status"] != "not_run" or point_key(p) not in merged:
                merged[point_key(p)] = p
    return headers, list(merged.values())


def percentile(values, q):
    """The q-quantile (0..1) of values, interpolating linearly between the closest ranks (NumPy's
    default method); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def rows_of(p):
    s = p["sizes"]
    return s.get("rows", s.get("tokens", s.get("m", 0)))


def shape_text(sizes):
    """The sizes of a point in a few words: rows x width for row ops, heads for RoPE, M N K."""
    layout = sizes.get("rows_label", "")
    if "cols" in sizes:
        text = f"{layout} ({sizes['rows']}) x {sizes['cols']}"
        return text + (f", row stride {sizes['row_stride']}" if sizes["row_stride"] != sizes["cols"] else "")
    if "head_dim" in sizes:
        return f"{layout} ({sizes['tokens']} tokens), {sizes['q_heads']}/{sizes['kv_heads']} heads x {sizes['head_dim']}"
    if "n" in sizes:
        return f"M {sizes['m']} ({layout}), N {sizes['n']}, K {sizes['k']}"
    return json.dumps(sizes, sort_keys=True)


def summarize(points):
    """One dict per op label (in the order the points first name them): counts, ratio quantiles,
    the most frequent best peer, the points below TIE (worst first) and copy fractions."""
    by_label = {}
    for p in points:
        by_label.setdefault(p["label"], []).append(p)
    rows = []
    for label, pts in by_label.items():
        ok = [p for p in pts if p["status"] == "ok"]
        ratios = [p["ratio"] for p in ok if p.get("ratio") is not None]
        errors = [p for p in pts if p["status"] == "error"]
        below = sorted((p for p in ok if p.get("ratio") is not None and p["ratio"] < TIE), key=lambda p: p["ratio"])
        best = Counter(p["best_peer"] for p in ok if p.get("best_peer"))
        copies = [p["copy_fraction"] for p in ok if p.get("copy_fraction") is not None and rows_of(p) >= COPY_ROWS]
        top = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))
        rows.append({
            "label": label,
            "direction": pts[0]["direction"],
            "memory_bound": pts[0].get("memory_bound", False),
            "points": len(ok) + len(errors),
            "errors": len(errors),
            "no_peer": len(ok) - len(ratios),
            "not_run": sum(p["status"] == "not_run" for p in pts),
            "skipped": sum(p["status"] == "skipped" for p in pts),
            "skip_reason": next((p.get("error") for p in pts if p["status"] == "skipped"), None),
            "min": min(ratios) if ratios else None,
            "p10": percentile(ratios, 0.10),
            "median": percentile(ratios, 0.5),
            "best_peer": top[0][0] if top else None,
            "below": len(below) + len(errors),
            "worst": (errors + below)[:WORST],
            "copy_min": min(copies) if copies else None,
            "copy_median": percentile(copies, 0.5),
        })
    return rows


def _num(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def header_text(headers):
    if not headers:
        return "no data"
    h = headers[0]
    devices = sorted({x.get("device", "?") for x in headers})
    text = (f"{', '.join(devices)}; torch {h.get('torch', '?')}, Liger {h.get('liger') or 'absent'}; "
            f"{h.get('date', '?')}")
    if len(headers) > 1:
        text += f"; {len(headers)} runs"
    return text


def worst_text(p):
    if p["status"] == "error":
        return f"{', '.join(p['models'])}: {shape_text(p['sizes'])}: kiln error: {p.get('error', '')}"
    return f"{', '.join(p['models'])}: {shape_text(p['sizes'])}: {p['ratio']:.3f} against {p['best_peer']}"


def markdown(headers, rows, sources=()):
    """The table and the worst points below TIE, as Markdown; sources names the JSON files."""
    out = [f"Shape sweep: {header_text(headers)}. Ratio = best peer's time / kiln's (above 1: kiln is faster; "
           f"at or above {TIE} a tie). Copy = a same-size device copy's time / kiln's, at {COPY_ROWS}+ rows.", ""]
    if sources:
        out += ["Source: " + ", ".join(f"`{s}`" for s in sources) + ".", ""]
    out += ["| op | dir | points | min | p10 | median | best peer (most often) | < " + f"{TIE} | errors | not run "
           "| copy min | copy median |",
           "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["points"] == 0 and r["skipped"]:
            out.append(f"| {r['label']} | {r['direction']} | skipped: {r['skip_reason']} "
                       "| | | | | | | | | |")
            continue
        points = f"{r['points']} ({r['no_peer']} without a peer)" if r["no_peer"] else f"{r['points']}"
        out.append(f"| {r['label']} | {r['direction']} | {points} | {_num(r['min'])} | {_num(r['p10'])} | "
                   f"{_num(r['median'])} | {r['best_peer'] or '-'} | {r['below']} | {r['errors']} | {r['not_run']} | "
                   f"{_num(r['copy_min']) if r['memory_bound'] else ''} | "
                   f"{_num(r['copy_median']) if r['memory_bound'] else ''} |")
    below = [r for r in rows if r["worst"]]
    if below:
        out += ["", f"Worst points below {TIE} (model(s): sizes: ratio against the best peer):"]
        for r in below:
            out.append(f"- {r['label']} ({r['below']} below):")
            out += [f"  - {worst_text(p)}" for p in r["worst"]]
    return "\n".join(out) + "\n"


def text_table(rows):
    """The short table run.py prints at the end: one line per op and direction."""
    lines = [f"{'op':<32} {'dir':<8} {'points':>6} {'min':>6} {'p10':>6} {'median':>6} {'<' + str(TIE):>6} "
             f"{'errors':>6} {'not run':>7} {'copy min':>8}"]
    for r in rows:
        if r["points"] == 0 and r["skipped"]:
            lines.append(f"{r['label']:<32} {r['direction']:<8} skipped: {r['skip_reason']}")
            continue
        lines.append(f"{r['label']:<32} {r['direction']:<8} {r['points']:>6} {_num(r['min']):>6} {_num(r['p10']):>6} "
                     f"{_num(r['median']):>6} {r['below']:>6} {r['errors']:>6} {r['not_run']:>7} "
                     f"{_num(r['copy_min']) if r['memory_bound'] else '':>8}")
    return "\n".join(lines)


def rewrite_block(text, block):
    """text with what lies between BEGIN and END replaced by block (BEGIN, block, END appended
    where text has no BEGIN)."""
    start = text.find(BEGIN)
    if start < 0:
        return text + ("" if text.endswith("\n") or not text else "\n") + f"{BEGIN}\n{block}{END}\n"
    end = text.find(END, start)
    if end < 0:
        raise ValueError(f"{BEGIN} without {END}")
    return text[:start] + f"{BEGIN}\n{block}" + text[end:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="run.py's JSON files (shards)")
    ap.add_argument("--markdown", metavar="FILE", help="rewrite the sweep block of FILE")
    ap.add_argument("--replace", default="", metavar="LABEL,...",
                    help="ops re-run after a change: only their points from the last file that measured them count")
    ap.add_argument("--update", default="", metavar="FILE,...",
                    help="files measured after the others: each point replaces the one of the same sizes")
    args = ap.parse_args(argv)
    updates = list(filter(None, args.update.split(",")))
    headers, points = load(args.json, tuple(filter(None, args.replace.split(","))), updates)
    block = markdown(headers, summarize(points), args.json + updates)
    print(block, end="")
    if args.markdown:
        try:
            with open(args.markdown) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        with open(args.markdown, "w") as f:
            f.write(rewrite_block(text, block))


if __name__ == "__main__":
    main()
