"""Summarise `ncu --page source --csv --print-source sass` output: per profiled kernel, its warp-stall
samples by reason and the instructions that collect the most samples (with their stall reasons).

    python benchmarks/ncu_stalls.py split_ncu_sass.csv --labels frame plan --json out.json

Used for the split kernel's profile (`device_run.sh s22ncu`, benchmarks/RESULTS.md). Needs only the
standard library, so it runs here on the CSV the device run wrote.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

ALL = "Warp Stall Sampling (All Samples)"


def kernels(path: Path) -> list[dict]:
    """One dict per kernel section of the CSV: name, instructions, samples, stalls, top."""
    rows = list(csv.reader(path.open()))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"]
    out = []
    for k, s in enumerate(starts):
        hdr = rows[s + 1]
        end = starts[k + 1] if k + 1 < len(starts) else len(rows)
        col = {h: i for i, h in enumerate(hdr)}
        body = [r for r in rows[s + 2:end] if len(r) == len(hdr)]
        reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        num = lambda r, h: int(r[col[h]] or 0)  # noqa: E731
        stalls = {h[6:]: sum(num(r, h) for r in body) for h in reasons}
        ranked = sorted(range(len(body)), key=lambda i: -num(body[i], ALL))[:16]
        out.append({"kernel": rows[s][1], "instructions": len(body), "samples": sum(num(r, ALL) for r in body),
                    "executed_warp_instructions": sum(num(r, "Instructions Executed") for r in body),
                    "stalls": {k: v for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v},
                    "top": [{"index": i, "sass": body[i][col["Source"]].strip(), "samples": num(body[i], ALL),
                             "stalls": {h[6:]: num(body[i], h) for h in reasons if num(body[i], h)}}
                            for i in ranked if num(body[i], ALL)]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--labels", nargs="*", default=[], help="a label per kernel section, in order")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    got = kernels(a.csv)
    for k, label in zip(got, a.labels):
        k["label"] = label
    for k in got:
        print(f"{k.get('label', k['kernel'])}: {k['samples']} samples, {k['executed_warp_instructions']} warp "
              f"instructions executed; stalls {k['stalls']}")
        for t in k["top"][:6]:
            print(f"  #{t['index']:5d} {t['samples']:4d} {t['sass'][:56]:56s} {t['stalls']}")
    if a.json:
        a.json.write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
