"""Tables and plots from the jobs' JSON: ``report.md`` (quality, logical read as % of dense,
capacity as % of dense, per system and budget) and ``quality_vs_read.png``.

Runs directly: ``python -m planekv.evaluation.report DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _load(out: Path, name: str) -> dict[str, Any] | None:
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from .common import ALL_SYSTEMS, VARIANTS

    order = ALL_SYSTEMS + VARIANTS
    return sorted(rows, key=lambda r: (-r["rate"] if r["name"] not in ("dense", "fp8") else -99,
                                       order.index(r["name"])))


def _decode_note(ppl: dict[str, Any]) -> str:
    if not any(r.get("decode") or r.get("hot") is not None for r in ppl["rows"]):
        return ""
    note = (" Rows marked \"decode steps\" read one token per decode step through the PlaneKV cache instead (every "
            "token written, then read over the tokens up to it, token 0 included)")
    if "promotion_mib" in ppl:
        note += (f"; \"tiered h = N\" rows the same from a tiered cache (N hot planes, a promotion cache of "
                 f"{ppl['promotion_mib']:g} MiB filled by prefetch after every step, caps counted)")
    return note + "."


def _tiered_table(ppl: dict[str, Any]) -> list[str]:
    """Each tiered row beside its all-GPU decode row: perplexity, difference, caps and promotion hits."""
    rows = [r for r in ppl["rows"] if r.get("hot") is not None]
    if not rows:
        return []
    by_key = {r["key"]: r for r in ppl["rows"]}
    lines = ["Tiered reads (decode steps) against the same decode steps with every plane on the device:", "",
             "| system | R | h | perplexity | all-GPU perplexity | Δ vs all-GPU | Δ vs all-GPU, pp of dense | "
             "caps % of wanted bits | past h served by promotion |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = by_key.get(r.get("all_gpu_key", ""))
        pp = r.get("vs_all_gpu_pp")
        cells = [r["label"], f"{r['rate']:g}", str(r["hot"]), f"{r['ppl']:.4f}",
                 "" if base is None else f"{base['ppl']:.4f}",
                 "" if base is None else f"{r['vs_all_gpu_pct']:+.2f}%", "" if pp is None else f"{pp:+.2f}",
                 _pct(r.get("cap_rate"), 2), _pct(r.get("promotion_hit_rate"), 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def markdown(out: str | Path) -> str:
    """The Markdown report of everything found in ``out``."""
    out = Path(out)
    ppl, pk, split = _load(out, "perplexity.json"), _load(out, "passkey.json"), _load(out, "split_search.json")
    meta = _load(out, "run.json") or {}
    lines: list[str] = []
    if meta:
        lines += [f"Model `{meta.get('model_id')}`, calibration `{meta.get('calibration_id')}`, "
                  f"hardware: {meta.get('hardware')}, date {meta.get('date')}.", ""]
    pk_rows = {} if pk is None else {(r["key"], r["context"]): r for r in pk["rows"]}
    contexts = sorted({r["context"] for r in pk["rows"]}) if pk else []
    if ppl:
        lines += [f"Perplexity: teacher-forced, per-query reads; {ppl['n_windows']} windows of {ppl['window']} tokens "
                  f"of each of {', '.join(ppl['texts'])} ({ppl['tokens_per_row']} predicted tokens per row). "
                  f"The model's own dense loss gives perplexity {ppl['model_ppl']:.4f}." + _decode_note(ppl), ""]
        head = ["system", "R", "perplexity", "Δ vs dense", "read % of dense", "capacity % of dense"]
        head += [f"passkey {c // 1024}K" for c in contexts]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in _order(ppl["rows"]):
            rate = "16" if r["name"] == "dense" else ("8" if r["name"] == "fp8" else f"{r['rate']:g}")
            pct = r.get("ppl_change_pct")
            chg = "" if r["name"] == "dense" or pct is None else f"{pct:+.2f}%"  # no dense row: no change
            cells = [r["label"], rate, f"{r['ppl']:.4f}", chg, _pct(r["read_fraction"]), _pct(r["capacity_fraction"])]
            for c in contexts:
                p = pk_rows.get((r["key"], c))
                cells.append("" if p is None else f"{p['hits']}/{p['trials']}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _tiered_table(ppl)
    if pk:
        lines += ["Passkey retrieval (exact match of the 5-digit key; paired trials: the same keys, depths and "
                  "filler for every system; one dense prefill, then decode steps reading the compressed cache).", ""]
        lines += ["| system | context | hits | hit rate | vs dense | read % of dense (decode steps) | "
                  "caps % of wanted bits |", "|---|---|---|---|---|---|---|"]
        for r in sorted(pk["rows"], key=lambda r: (r["context"], _order(pk["rows"]).index(r))):
            caps = _pct(r["cap_rate"], 2) if "cap_rate" in r else ""
            lines.append(f"| {r['label']} | {r['context']} | {r['hits']}/{r['trials']} | {_pct(r['hit_rate'], 0)} | "
                         f"{_pct(r['vs_dense'], 0)} | {_pct(r['read_fraction'])} | {caps} |")
        lines.append("")
    if split:
        lines += [f"K/V split search (flexible reader) on {split['text']}, {split['n_windows']} windows of "
                  f"{split['window']} tokens:", "", "| R | K share | dev perplexity |", "|---|---|---|"]
        for r in split["rows"]:
            mark = " (chosen)" if split["k_share"].get(f"{r['rate']:g}") == r["k_share"] else ""
            lines.append(f"| {r['rate']:g} | {r['k_share']:g}{mark} | {r['ppl']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def plot(out: str | Path) -> Path | None:
    """quality_vs_read.png: perplexity change and passkey hit rate against logical read."""
    out = Path(out)
    ppl, pk = _load(out, "perplexity.json"), _load(out, "passkey.json")
    if not ppl and not pk:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [x for x in (ppl, pk) if x]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    markers = {"dense": "*", "readkv-flexible": "o", "readkv-constrained": "s", "full-reader": "^",
               "turboquant": "v", "kivi": "D", "sparq": "P", "fp8": "X"}
    # named variants of the flexible reader (planekv.evaluation.common.VARIANTS) get markers too
    for name in sorted({r["name"] for x in (ppl, pk) if x for r in x["rows"]} - set(markers)):
        markers[name] = "h"
    ax_i = 0
    if ppl:
        ax = axes[0][ax_i]
        ax_i += 1
        for name in markers:
            rs = [r for r in ppl["rows"] if r["name"] == name]
            if rs:
                ax.scatter([100 * r["read_fraction"] for r in rs], [r["ppl_change_pct"] or 0.0 for r in rs],
                           marker=markers[name], s=60, label=name)
                for r in rs:
                    ax.annotate(f"R={r['rate']:g}", (100 * r["read_fraction"], r["ppl_change_pct"] or 0.0),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("logical read, % of dense fp16")
        ax.set_ylabel("perplexity change vs dense, %")
        ax.set_title("Teacher-forced perplexity")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if pk:
        from matplotlib.lines import Line2D

        ax = axes[0][ax_i]
        colors = {name: f"C{i}" for i, name in enumerate(markers)}
        ctx_marker = dict(zip(sorted({r["context"] for r in pk["rows"]}), ("o", "s", "*", "D", "^"), strict=False))
        for r in pk["rows"]:
            if r["read_fraction"]:
                ax.scatter(100 * r["read_fraction"], 100 * r["hit_rate"], marker=ctx_marker[r["context"]],
                           color=colors[r["name"]], s=70, alpha=0.8)
        handles = [Line2D([], [], color=colors[n], marker="o", ls="", label=n)
                   for n in markers if any(r["name"] == n for r in pk["rows"])]
        handles += [Line2D([], [], color="k", marker=m, ls="", label=f"{c // 1024}K tokens")
                    for c, m in ctx_marker.items()]
        ax.set_xscale("log")
        ax.set_xlabel("logical read per decode step, % of dense fp16")
        ax.set_ylabel("passkey hits, %")
        ax.set_title("Passkey retrieval")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(handles=handles, fontsize=7, ncol=2)
    fig.tight_layout()
    p = out / "quality_vs_read.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def write_report(out: str | Path) -> Path:
    """Write ``report.md`` (and the plot) from the JSON found in ``out``."""
    out = Path(out)
    md = out / "report.md"
    md.write_text(markdown(out))
    png = plot(out)
    log.info("report written to %s%s", md, f" and {png}" if png else "")
    return md


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planekv.evaluation.report", description=__doc__)
    p.add_argument("out", help="directory holding perplexity.json / passkey.json / split_search.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    write_report(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
