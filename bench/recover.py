"""Results JSON from the log of a bench run that was cut short (time limit, a crashing anchor).

``python -m bench.recover LOG --op gdn --name h200-gdn --command "..." --note "why partial"``: the log's
first JSON line (env + ceilings, printed by bench.run) and its ``[row]`` lines whose op starts with ``--op``.
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--op", required=True, help="keep rows whose op starts with this")
    ap.add_argument("--name", required=True, help="output file stem under bench/results/")
    ap.add_argument("--command", required=True)
    ap.add_argument("--note", required=True)
    a = ap.parse_args()
    head, rows = None, []
    with open(a.log) as f:
        for line in f:
            if head is None and line.startswith('{"env"'):
                head = json.loads(line)
            elif line.startswith("[row] "):
                r = json.loads(line[6:])
                if r["op"].startswith(a.op):
                    rows.append(r)
    if head is None or not rows:
        raise SystemExit(f"{a.log}: no env line or no rows for op {a.op!r}")
    out = RESULTS / f"{a.name}.json"
    with open(out, "w") as f:
        json.dump({"env": head["env"], "command": a.command, "partial": a.note, "ceilings": head["ceilings"],
                   "rows": rows}, f, indent=1)
    print(f"wrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
