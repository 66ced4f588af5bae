#!/usr/bin/env python3
"""Draws grafana/dashboards/spool.json from a Prometheus to a PNG, Grafana-style.

Every panel of the dashboard is drawn where its gridPos puts it, from the same PromQL
(variables substituted: $dataset -> .*, $__rate_interval -> --rate-interval), evaluated with
/api/v1/query_range over [--start, --end]. Used by `make dashboard-png`
(scripts/dashboard_png.sh) to render docs/dashboard.png from a demo run.

Needs matplotlib (Debian: python3-matplotlib).
"""

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import gridspec  # noqa: E402

BG, PANEL, GRID, TEXT, DIM = "#111217", "#181b1f", "#2c3235", "#d8d9da", "#8e8e8e"
PALETTE = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#fade2a", "#8ab8ff"]


def query_range(prom, expr, start, end, step):
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    out = []
    for s in body["data"]["result"]:
        pts = [(float(t), float(v)) for t, v in s["values"]]
        out.append((s["metric"], pts))
    return out


def legend(fmt, metric):
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in metric.items() if k not in ("job", "instance")) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def human(x):
    a = abs(x)
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{x / div:.1f}{suf}"
    return f"{x:.0f}" if a >= 10 or x == int(x) else f"{x:.2f}"


def fmt_unit(x, unit):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if unit == "percentunit":
        return f"{100 * x:.0f}%"
    if unit in ("dtdurations", "s"):
        if unit == "s" and x < 60:
            return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.1f} s"
        s = int(round(x))
        h, m, sec = s // 3600, (s % 3600) // 60, s % 60
        return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")
    if unit == "Bps":
        return human(x) + "B/s"
    if unit == "reqps":
        return f"{x:.1f} req/s"
    return human(x)


def style(ax, title):
    ax.set_facecolor(PANEL)
    ax.set_title(title, color=TEXT, fontsize=9, loc="left", pad=4)
    for s in ax.spines.values():
        s.set_color(GRID)
    ax.tick_params(colors=DIM, labelsize=7)
    ax.grid(True, color=GRID, linewidth=0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", required=True)
    ap.add_argument("--dashboard", default="grafana/dashboards/spool.json")
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--end", type=float, required=True)
    ap.add_argument("--step", default="2")
    ap.add_argument("--rate-interval", default="15s")
    ap.add_argument("--out", default="docs/dashboard.png")
    a = ap.parse_args()

    dash = json.load(open(a.dashboard))
    panels = dash["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(20, rows * 0.42), facecolor=BG)
    gs = gridspec.GridSpec(rows, 24, figure=fig, hspace=1.6, wspace=1.2,
                           left=0.03, right=0.99, top=0.975, bottom=0.01)
    fig.suptitle(f"{dash['title']} — {dash.get('description', '')}", color=TEXT, fontsize=12, x=0.01,
                 ha="left")
    empty = []
    for p in panels:
        g = p["gridPos"]
        if p["type"] == "row":
            ax = fig.add_subplot(gs[g["y"], :])
            ax.axis("off")
            ax.text(0, 0.2, p["title"], color=TEXT, fontsize=11, fontweight="bold",
                    transform=ax.transAxes)
            continue
        ax = fig.add_subplot(gs[g["y"] + 1:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        style(ax, p["title"])
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        series = []
        for t in p["targets"]:
            expr = (t["expr"].replace("${dataset}", ".*").replace("$dataset", ".*")
                    .replace("$__rate_interval", a.rate_interval).replace("$__interval", "5s")
                    .replace("$__range", "5m"))
            for metric, pts in query_range(a.prometheus, expr, a.start, a.end, a.step):
                pts = [(t0 - a.start, v) for t0, v in pts if math.isfinite(v)]
                if pts:
                    series.append((legend(t.get("legendFormat", ""), metric), pts))
        if not series:
            empty.append(p["title"])
            ax.text(0.5, 0.5, "no data", color=DIM, ha="center", va="center", transform=ax.transAxes)
            continue
        if p["type"] == "stat":
            ax.axis("off")
            ax.set_facecolor(PANEL)
            for i, (name, pts) in enumerate(series[:2]):
                y = 0.55 if len(series) == 1 else 0.68 - 0.45 * i
                ax.text(0.5, y, fmt_unit(pts[-1][1], unit if name != "bytes" else "bytes"),
                        color=PALETTE[i], fontsize=20, ha="center", va="center",
                        transform=ax.transAxes, fontweight="bold")
                ax.text(0.5, y - 0.2, name, color=DIM, fontsize=7, ha="center", transform=ax.transAxes)
            ax.add_patch(plt.Rectangle((0, 0), 1, 1, transform=ax.transAxes, color=PANEL, zorder=-1))
            ax.set_title(p["title"], color=TEXT, fontsize=9, loc="left", pad=4)
            continue
        if p["type"] == "bargauge":
            names = [n for n, _ in series]
            vals = [pts[-1][1] for _, pts in series]
            ax.barh(names, vals, color=[PALETTE[i % len(PALETTE)] for i in range(len(vals))])
            ax.set_xlim(0, max(1.0, max(vals)))
            for i, v in enumerate(vals):
                ax.text(v, i, " " + fmt_unit(v, unit), color=TEXT, va="center", fontsize=8)
            ax.invert_yaxis()
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: fmt_unit(x, unit)))
            continue
        for i, (name, pts) in enumerate(series):
            xs, ys = zip(*pts)
            kw = {"drawstyle": "steps-post"} if p["type"] == "state-timeline" else {}
            ax.plot(xs, ys, color=PALETTE[i % len(PALETTE)], linewidth=1.2, label=name, **kw)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: fmt_unit(x, unit)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:.0f}s"))
        ax.legend(fontsize=6, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, loc="best")
    fig.savefig(a.out, dpi=80, facecolor=BG)
    print(f"wrote {a.out} ({len(panels)} panels)")
    if empty:
        print("panels without data: " + ", ".join(empty), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
