#!/usr/bin/env python3
"""Draws a loom trace (Chrome trace events, as LOOM_TRACE writes them) as an SVG timeline: one row per rank and
resource, one box per span, nested spans below their parent.  Usage: trace_to_svg.py TRACE.json OUT.svg [FROM_US TO_US]"""
import json
import sys

COLOURS = {"forward block": "#4e79a7", "backward_input block": "#f28e2b", "backward_weight block": "#e15759",
           "backward": "#bab0ac", "all_reduce buckets": "#d4d4d4", "all_reduce": "#59a14f", "barrier": "#9c755f",
           "F": "#4e79a7", "B": "#f28e2b", "W": "#e15759", "BW": "#f28e2b", "pipeline exchange": "#d4d4d4"}


def main():
    events = json.load(open(sys.argv[1]))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    t0 = float(sys.argv[3]) if len(sys.argv) > 4 else min(e["ts"] for e in spans)
    t1 = float(sys.argv[4]) if len(sys.argv) > 4 else max(e["ts"] + e["dur"] for e in spans)
    spans = [e for e in spans if e["ts"] + e["dur"] >= t0 and e["ts"] <= t1]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    width, label, row_h, depth_h = 1100, 150, 46, 14
    scale = (width - label - 10) / (t1 - t0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(rows) * row_h + 60}" '
           'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for r, key in enumerate(rows):
        y = 10 + r * row_h
        out.append(f'<text x="5" y="{y + 16}">rank {key[0]} {names.get(key, "")}</text>')
        mine = sorted((e for e in spans if (e["pid"], e["tid"]) == key), key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in mine:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            d = len(stack)
            stack.append(e["ts"] + e["dur"])
            x = label + (max(e["ts"], t0) - t0) * scale
            w = max(0.5, (min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)) * scale)
            c = COLOURS.get(e["name"], "#76b7b2")
            out.append(f'<rect x="{x:.1f}" y="{y + d * depth_h}" width="{w:.1f}" height="{depth_h - 2}" fill="{c}">'
                       f'<title>{e["name"]} {e["dur"]:.0f} us</title></rect>')
    y = 10 + len(rows) * row_h
    x = label
    for name, c in COLOURS.items():
        out.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{c}"/><text x="{x + 14}" y="{y + 9}">{name}</text>')
        x += 14 + 7 * len(name) + 16
    out.append(f'<text x="{label}" y="{y + 30}">{(t1 - t0) / 1000:.1f} ms shown</text></svg>')
    open(sys.argv[2], "w").write("\n".join(out))


if __name__ == "__main__":
    main()
