"""Results of `ctxcache eval`: results.json, results.md (markdown tables) and PNG plots.

Plots (matplotlib, Agg backend):
* `recall_vs_kv.png`: recall of the exact top-K vs fraction of KV touched, per method and length;
* `fidelity_vs_sparsity.png`: KL(full || method) and top-1 agreement vs fraction of KV touched;
* `recall_heatmap.png`: recall per layer (columns) and run (rows), one panel per length.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

PLOTS = ("recall_vs_kv.png", "fidelity_vs_sparsity.png", "recall_heatmap.png")


def write_json(results: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, path)


def write_all(results: dict, out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    write_json(results, paths["json"])
    paths["markdown"].write_text(markdown(results))
    for name, path in write_plots(results, out_dir).items():
        paths[name] = path
    return paths


# ---------------------------------------------------------------------------------------------
# Rows


def fidelity_rows(results: dict) -> list[dict]:
    """One row per (length, run) of the fidelity section, flattened."""
    rows = []
    for entry in results.get("fidelity", []):
        for label, r in entry["results"].items():
            row = {"label": label, "method": r.get("method", label.split("[")[0]), "length": entry["length"],
                   "status": r["status"], "reason": r.get("reason", "")}
            if r["status"] == "ok":
                a = r.get("attention", {})
                row.update({
                    "kv_touched_decode": r["kv_touched_decode"], "top1_agreement": r["top1_agreement"],
                    "kl_mean": r["kl_mean"], "kl_max": r["kl_max"], "positions": r["positions"],
                    "kv_touched": a.get("kv_touched"), "recall": a.get("recall"), "mass_recall": a.get("mass_recall"),
                    "rel_l2_err": a.get("rel_l2_err"), "bypass": a.get("bypass_fraction"), "k": a.get("k"),
                    "recall_per_layer": a.get("recall_per_layer"),
                })
            rows.append(row)
    return rows


def _f(x, nd: int = 3, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{100 * x:.1f}%"
    if isinstance(x, float) and x != 0 and abs(x) < 10 ** -nd:
        return f"{x:.1e}"
    return f"{x:.{nd}f}"


def markdown(results: dict) -> str:
    lines = [f"# ctxcache eval: {results.get('name', '')}", ""]
    m = results.get("model", {})
    mach = results.get("machine", {})
    lines += [f"Model {m.get('name')} ({m.get('layers')} layers, {m.get('heads')} q heads, {m.get('kv_heads')} KV heads, "
              f"d={m.get('head_dim')}, fingerprint {m.get('fingerprint')}). Started {results.get('started_at')}, "
              f"runtime {results.get('runtime_s', 'unfinished')} s, {mach.get('nproc')} CPUs, torch {mach.get('torch')} "
              f"({mach.get('torch_threads')} threads).", ""]
    rows = fidelity_rows(results)
    if rows:
        fc = results.get("config", {}).get("fidelity") or {}
        lines += ["## Fidelity and attention-level metrics", "",
                  f"Teacher-forced continuation of {fc.get('positions')} tokens after a stored context; attention level on "
                  f"the first {fc.get('queries')} real decode queries of the reference run, exact top-K with K = "
                  f"{fc.get('recall_ratio')} of the visible tokens. KV touched: fraction of the visible KV attended "
                  "(sink + window + selection), in the attention replay and in the teacher-forced decode.", "",
                  "| length | run | KV touched | KV touched (decode) | recall top-K | attention mass | rel. L2 err | "
                  "top-1 agree | KL mean | KL max |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['length']} | {r['label']} | {r['status']}: {r['reason'][:80]} | | | | | | | |")
                continue
            rec = _f(r["recall"])
            if r.get("bypass"):
                rec += f" ({_f(r['bypass'], 2, pct=True)} heads bypassed)"
            lines.append(f"| {r['length']} | {r['label']} | {_f(r['kv_touched'], pct=True)} | "
                         f"{_f(r['kv_touched_decode'], pct=True)} | {rec} | {_f(r['mass_recall'])} | "
                         f"{_f(r['rel_l2_err'])} | {_f(r['top1_agreement'])} | {_f(r['kl_mean'], 4)} | {_f(r['kl_max'], 3)} |")
        lines.append("")
    tasks = results.get("tasks", [])
    if tasks:
        cols = [(t["task"], t["length"]) for t in tasks]
        labels = list(dict.fromkeys(label for t in tasks for s in t["samples"] for label in s["results"]))
        n_samples = {(t["task"], t["length"]): len(t["samples"]) for t in tasks}
        lines += ["## Task accuracy (RULER-style, substring match)", "",
                  "Each cell: mean score over the samples (depths evenly spaced); `all` = fraction of the references "
                  "found (RULER's string_match_all).", "",
                  "| run | " + " | ".join(f"{t}@{n} (n={n_samples[(t, n)]})" for t, n in cols) + " | mean |",
                  "|---|" + "---:|" * (len(cols) + 1)]
        for label in labels:
            vals = []
            for t in tasks:
                acc = t["accuracy"].get(label)
                if acc is None and t["samples"]:
                    st = t["samples"][0]["results"].get(label, {})
                    vals.append(None if st.get("status") == "ok" else st.get("status", "–"))
                else:
                    vals.append(acc)
            nums = [v for v in vals if isinstance(v, (int, float))]
            cells = [_f(v, 2) if not isinstance(v, str) else v for v in vals]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_f(sum(nums) / len(nums), 2) if nums else '–'} |")
        lines.append("")
    skipped = {}
    for entry in results.get("fidelity", []):
        for label, r in entry["results"].items():
            if r["status"] != "ok":
                skipped.setdefault(label, r.get("reason", ""))
    for t in tasks:
        for s in t["samples"]:
            for label, r in s["results"].items():
                if r["status"] != "ok":
                    skipped.setdefault(label, r.get("reason", ""))
    if skipped:
        lines += ["## Runs that did not run", ""] + [f"* `{k}`: {v}" for k, v in skipped.items()] + [""]
    src = results.get("natural_source")
    if src:
        lines += [f"Natural text: {src['source']}, {src['words']} words, sha256 {src['sha256'][:16]}.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_MARKERS = "osD^v<>pP*hX"


def _styles(rows: list[dict]):
    plt = _plt()
    methods = sorted({r["method"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    cmap = plt.get_cmap("tab10")
    color = {m: cmap(i % 10) for i, m in enumerate(methods)}
    marker = {n: _MARKERS[i % len(_MARKERS)] for i, n in enumerate(lengths)}
    return methods, lengths, color, marker


def _legend(ax, rows, color, marker):
    """Two keys: colour = method, marker = context length (placed right of the axes)."""
    from matplotlib.lines import Line2D

    methods = sorted({r["method"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    handles = [Line2D([], [], color=color[m], marker="o", linestyle="-", label=m) for m in methods]
    handles += [Line2D([], [], color="gray", marker=marker[n], linestyle="", label=f"{n} tokens") for n in lengths]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _scatter(ax, rows, x: str, y: str, color, marker):
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get(x) is None or r.get(y) is None:
            continue
        groups.setdefault((r["method"], r["length"]), []).append(r)
    for (method, n), pts in sorted(groups.items()):
        pts = sorted(pts, key=lambda r: r[x])
        ax.plot([100 * p[x] for p in pts], [p[y] for p in pts], marker=marker[n], color=color[method],
                linestyle="-", linewidth=0.8, markersize=6)


def write_plots(results: dict, out_dir: Path) -> dict[str, Path]:
    plt = _plt()
    rows = [r for r in fidelity_rows(results) if r["status"] == "ok"]
    paths = {}
    if not rows:
        return paths
    _, lengths, color, marker = _styles(rows)

    fig, ax = plt.subplots(figsize=(7.5, 5))
    _scatter(ax, rows, "kv_touched", "recall", color, marker)
    ax.set_xscale("log")
    ax.set_xlabel("KV touched (% of visible tokens, log)")
    ax.set_ylabel("recall of the exact top-K")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    _legend(ax, rows, color, marker)
    ax.set_title("Recall of the exact top-K vs fraction of KV touched")
    paths["recall_vs_kv"] = out_dir / PLOTS[0]
    fig.savefig(paths["recall_vs_kv"], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    _scatter(a1, rows, "kv_touched_decode", "kl_mean", color, marker)
    a1.set_xscale("log")
    a1.set_yscale("symlog", linthresh=1e-4)
    a1.set_ylim(bottom=0)
    a1.set_xlabel("KV touched in decode (% of visible tokens, log)")
    a1.set_ylabel("KL(full || method), mean per position")
    a1.grid(alpha=0.3)
    _scatter(a2, rows, "kv_touched_decode", "top1_agreement", color, marker)
    a2.set_xscale("log")
    a2.set_xlabel("KV touched in decode (% of visible tokens, log)")
    a2.set_ylabel("top-1 agreement with full")
    a2.set_ylim(-0.02, 1.02)
    a2.grid(alpha=0.3)
    _legend(a2, rows, color, marker)
    fig.suptitle("Model-level fidelity vs sparsity (teacher-forced continuation)")
    paths["fidelity_vs_sparsity"] = out_dir / PLOTS[1]
    fig.savefig(paths["fidelity_vs_sparsity"], dpi=110, bbox_inches="tight")
    plt.close(fig)

    import numpy as np

    with_layers = [r for r in rows if r.get("recall_per_layer")]
    if with_layers:
        lens = [n for n in lengths if any(r["length"] == n for r in with_layers)]
        n_runs = max(sum(r["length"] == n for r in with_layers) for n in lens)
        fig, axes = plt.subplots(len(lens), 1, figsize=(11, 0.35 * n_runs * len(lens) + 1.5 * len(lens)), squeeze=False)
        cmap = plt.get_cmap("viridis").with_extremes(bad="lightgray")
        im = None
        for ax, n in zip(axes[:, 0], lens):
            rs = [r for r in with_layers if r["length"] == n]
            mat = np.array([[np.nan if v is None else v for v in r["recall_per_layer"]] for r in rs], dtype=float)
            im = ax.imshow(np.ma.masked_invalid(mat), aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
            ax.set_yticks(range(len(rs)), [r["label"] for r in rs], fontsize=7)
            ax.set_xticks(range(mat.shape[1]), [str(i) for i in range(mat.shape[1])], fontsize=6)
            ax.set_xlabel("layer")
            ax.set_title(f"recall of the exact top-K per layer, context {n} tokens", fontsize=9)
        fig.colorbar(im, ax=axes[:, 0].tolist(), fraction=0.025, pad=0.01)
        paths["recall_heatmap"] = out_dir / PLOTS[2]
        fig.savefig(paths["recall_heatmap"], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths
