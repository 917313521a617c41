"""Compare two evaluation results of the same settings row by row (an evaluation over workers against one process).

    python benchmarks/tools/compare_eval.py A.json B.json [--rel 1e-4]

Both files are a job's JSON (`perplexity.json` or `passkey.json`). Rows are matched by key (passkey: key and
context). Perplexity rows must agree within ``--rel`` (relative); passkey rows must have the same hits and trials
and every trial's answer must be the same. Prints one line per row and exits 1 on the first kind of mismatch
(rows missing on one side included), 0 when every row agrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{r['key']}@{r['context']}" if "context" in r else r["key"]: r for r in doc["rows"]}


def compare(a: dict[str, Any], b: dict[str, Any], rel: float) -> list[str]:
    """The mismatches between results ``a`` and ``b`` (empty: they agree); prints each row's comparison."""
    if a.get("job") != b.get("job"):
        return [f"different jobs: {a.get('job')} and {b.get('job')}"]
    ra, rb = _rows(a), _rows(b)
    bad = [f"row {k} only in {'the first' if k in ra else 'the second'}" for k in sorted(set(ra) ^ set(rb))]
    for k in sorted(set(ra) & set(rb)):
        x, y = ra[k], rb[k]
        if a["job"] == "passkey":
            same = (x["hits"], x["trials"]) == (y["hits"], y["trials"])
            print(f"{k}: {x['hits']}/{x['trials']} and {y['hits']}/{y['trials']}")
        else:
            d = abs(x["ppl"] - y["ppl"]) / abs(y["ppl"])
            same = d <= rel
            print(f"{k}: {x['ppl']:.6f} and {y['ppl']:.6f} (relative {d:.2e})")
        if not same:
            bad.append(f"row {k} differs")
    if a["job"] == "passkey":
        answers = [{(t["system"], t["context"], t["key"], t["depth"], t["offset"]): t["answer"] for t in d["details"]}
                   for d in (a, b)]
        bad += [f"trial {t}: {answers[0][t]!r} and {answers[1].get(t)!r}" for t in answers[0]
                if answers[0][t] != answers[1].get(t)]
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rel", type=float, default=1e-4, help="perplexity: largest relative difference allowed")
    args = ap.parse_args(argv)
    bad = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()), args.rel)
    for line in bad:
        print("MISMATCH", line)
    print("agree" if not bad else f"{len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
