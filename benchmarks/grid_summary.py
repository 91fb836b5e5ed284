"""The grid's cells side by side at each precision, from the raw files of ``bench_grid.py --json``.

    python benchmarks/grid_summary.py benchmarks/results/grid_cpu2_vocab100.json \\
        benchmarks/results/grid_cpu2_bf16_100.json ...

One row per cell (vocabulary, model size, response length), one column of ours / TRL per
precision found: each ratio is from one run of alternating processes at that precision, with
the commit and date of its file. A cell measured in several files keeps the last one given.
Each ratio compares the two frameworks inside one run; ratios from different files (another day,
another host) are not compared with each other here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SIZES = ["0.07M", "0.6M", "25M"]


def load(paths: list[str]) -> tuple[dict, list[dict]]:
    """``{(vocab, size, length): {precision: measurement}}`` and the files' stamps, in the order given."""
    cells, sources = {}, []
    for path in paths:
        report = json.loads(Path(path).read_text())
        stamp = report["stamp"]
        source = {"file": Path(path).name, "commit": (stamp.get("commit") or "?")[:7], "date": stamp.get("date", "?"),
                  "cpu": stamp.get("cpu", "?")}
        sources.append(source)
        for cell in report["cells"]:
            if "gspo" not in cell or "trl" not in cell:
                continue
            key = (cell["vocab"], cell["size"], cell["length"])
            cells.setdefault(key, {})[cell.get("precision", "fp32")] = {
                "ours": cell["gspo"]["step_s"], "trl": cell["trl"]["step_s"], "source": source}
    return cells, sources


def table(cells: dict, goal: float = 0.5) -> str:
    precisions = sorted({p for by_precision in cells.values() for p in by_precision}, key=lambda p: (p != "fp32", p))
    head = ["vocab", "model", "resp. tokens"]
    for p in precisions:
        head += [f"{p} ours / TRL", f"{p} s/step ours / TRL", f"{p} at"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(cells, key=lambda k: (SIZES.index(k[1]) if k[1] in SIZES else 9, {"100": 0, "2k": 1, "32k": 2}.get(k[0], 9), k[2]))
    met = {p: [0, 0] for p in precisions}
    for key in order:
        row = [key[0], key[1], str(key[2])]
        for p in precisions:
            m = cells[key].get(p)
            if m is None:
                row += ["", "", ""]
                continue
            ratio = m["ours"] / m["trl"]
            met[p][0] += ratio <= goal
            met[p][1] += 1
            row += [f"**{ratio:.2f}x**", f"{m['ours']:.3f} / {m['trl']:.3f}", m["source"]["commit"]]
        lines.append("| " + " | ".join(row) + " |")
    counts = "; ".join(f"{p}: {n} of {total} cells at or under {goal}x" for p, (n, total) in met.items())
    return "\n".join(lines) + "\n\n" + counts + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="bench_grid.py --json files; a later file's cell replaces an earlier one's")
    parser.add_argument("--goal", type=float, default=0.5, help="the ratio counted as met (default 0.5)")
    args = parser.parse_args(argv)
    cells, sources = load(args.files)
    print(table(cells, args.goal))
    for s in sources:
        print(f"- `{s['file']}`: commit {s['commit']}, {s['date']}, {s['cpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
