#!/usr/bin/env python3
"""The book's pictures, drawn from data committed under docs/data/.

    scripts/docs-figures.py render                  # every figure into docs/src/images/
    scripts/docs-figures.py import-chaos --logs DIR --stdout FILE --json FILE \
        --command CMD --out docs/data/chaos-timeline.json
    scripts/docs-figures.py import-bench --failover FILE --lease FILE \
        --command CMD --out docs/data/failover-distributions.json

`render` needs matplotlib (`python3 -m pip install matplotlib`); the imports
need only the standard library. Every data file names the run it came from
(commit, date, machine, command) and every figure prints that line, so a
picture can always be traced to the run that made it; nothing here invents
a figure. SVG text stays text (svg.fonttype none), so the files diff.
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "data")
IMAGES = os.path.join(ROOT, "docs", "src", "images")


def machine():
    cores = os.cpu_count()
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) // (1024 * 1024)
    except OSError:
        pass
    return f"{cores} cores, {model}, {mem} GiB"


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------- imports

def import_chaos(a):
    """Turns a `pgelect chaos --logs DIR` run into who acted when, the faults
    and the gaps. A worker's log has one line per event:
    `start|tick|stop NODE TERM UNIX_NS PID`; a worker acts from its `start`
    to its last line. The faults come from the command's own report lines
    (`kill on c3 (term 6): term 7 began 426.6 ms later (bound 3399 ms)`):
    a fault's time is the next term's first `start` minus that gap."""
    workers = {}
    logdir = a.logs
    for name in sorted(os.listdir(logdir)):
        if not name.endswith(".log"):
            continue
        for line in open(os.path.join(logdir, name)):
            parts = line.split()
            if len(parts) != 5:
                continue
            what, node, term, ns, pid = parts[0], parts[1], int(parts[2]), int(parts[3]), int(parts[4])
            w = workers.setdefault((node, term, pid), {"node": node, "term": term, "pid": pid,
                                                       "start_ns": None, "last_ns": ns, "stopped": False})
            if what == "start" and w["start_ns"] is None:
                w["start_ns"] = ns
            w["last_ns"] = max(w["last_ns"], ns)
            if what == "stop":
                w["stopped"] = True
    intervals = [w for w in workers.values() if w["start_ns"] is not None]
    t0 = min(w["start_ns"] for w in intervals)
    first_start = {}
    for w in intervals:
        first_start[w["term"]] = min(first_start.get(w["term"], w["start_ns"]), w["start_ns"])
    pat = re.compile(r"^\s+(\S+)\s+on (\S+) \(term (\d+)\): term (\d+) began ([0-9.]+) ms later \(bound (\d+) ms")
    faults = []
    for line in open(a.stdout):
        m = pat.match(line)
        if not m:
            continue
        fault, node, term, next_term, gap, bound = m.groups()
        at = first_start[int(next_term)] - float(gap) * 1e6
        faults.append({"fault": fault, "node": node, "term": int(term), "next_term": int(next_term),
                       "at_s": round((at - t0) / 1e9, 4), "gap_ms": float(gap), "bound_ms": int(bound)})
    summary = json.load(open(a.json)) if a.json else None
    out = {
        "run": {"command": a.command, "commit": a.commit or commit(), "date": a.date,
                "machine": a.machine or machine(), "build": a.build},
        "what": "who acted as leader when (a worker's start to its last log line), each fault and the gap to the next term's first act",
        "intervals": sorted(({"node": w["node"], "term": w["term"],
                              "from_s": round((w["start_ns"] - t0) / 1e9, 4),
                              "to_s": round((w["last_ns"] - t0) / 1e9, 4),
                              "stopped_cleanly": w["stopped"]} for w in intervals),
                            key=lambda i: i["from_s"]),
        "faults": faults,
        "summary": summary,
    }
    write_json(a.out, out)


def import_bench(a):
    """Keeps the samples and the timing reports of `pgelect-bench failover
    --json` and `lease-failover --json` (one JSON line each)."""
    def line(path):
        for l in open(path):
            l = l.strip()
            if l.startswith("{"):
                return json.loads(l)
        sys.exit(f"no JSON line in {path}")
    out = {
        "run": {"command": a.command, "commit": a.commit or commit(), "date": a.date,
                "machine": a.machine or machine(), "build": "release", "load": a.load},
        "failover": line(a.failover),
        "lease_failover": line(a.lease),
    }
    write_json(a.out, out)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")


# ---------------------------------------------------------------- figures

def plt_setup():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.fonttype": "none", "font.size": 10, "axes.spines.top": False,
                         "axes.spines.right": False, "svg.hashsalt": "pgelect"})
    return plt


def source_line(fig, run):
    text = f"Run: {run['command']} — commit {run['commit']}, {run['date']}, {run['machine']}"
    if run.get("build"):
        text += f", {run['build']} build"
    if run.get("load"):
        text += f", {run['load']}"
    fig.text(0.01, 0.005, text, fontsize=7, color="#555555", ha="left", va="bottom", wrap=True)


PREVIEW = None


def save(fig, name):
    path = os.path.join(IMAGES, name)
    fig.savefig(path, metadata={"Date": None, "Creator": None})
    print(f"wrote {os.path.relpath(path, ROOT)}")
    if PREVIEW:
        png = os.path.join(PREVIEW, name.replace(".svg", ".png"))
        fig.savefig(png, dpi=110)
        print(f"wrote {png}")


SERIES_LABELS = {
    "baseline": "bare pg_advisory_lock, holder killed (baseline)",
    "voluntary": "resign() until the standby leads",
    "preferred": "a priority-1 candidate starts until it leads",
    "crash-fast": "crash, fast profile (handover 70 ms)",
    "crash-standard-2s": "crash, --ttl 2s (handover 399 ms)",
    "crash-default": "crash, defaults, ttl 15 s (handover 2.5 s)",
}


def render_failover(plt):
    d = json.load(open(os.path.join(DATA, "failover-distributions.json")))
    series = []
    for key, ms in d["failover"].get("samples", {}).items():
        name = key.split("/", 1)[-1]
        series.append((SERIES_LABELS.get(name, name), ms, "-"))
    for key, ms in d["lease_failover"].get("samples", {}).items():
        name = key.split("/", 1)[-1]
        ttl = name.replace("crash-ttl-", "").replace("s", " s")
        series.append((f"lease backend through PgBouncer, ttl {ttl}: leader killed\nat a random point of its renewal cycle", ms, "--"))
    order = {v: i for i, v in enumerate(SERIES_LABELS.values())}
    series.sort(key=lambda s: (s[2] == "--", order.get(s[0], 99), s[0]))
    fig, ax = plt.subplots(figsize=(11, 5.2))
    for label, ms, style in series:
        xs = sorted(ms)
        n = len(xs)
        ys = [(i + 1) / n for i in range(n)]
        ax.step(xs, ys, where="post", linestyle=style, label=f"{label} (n={n})")
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds from the event until the successor acts (log scale)")
    ax.set_ylabel("share of trials at most x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.25)
    ax.set_title("Failover distributions: each series is one trial per step")
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.subplots_adjust(left=0.07, right=0.64, top=0.93, bottom=0.16)
    source_line(fig, d["run"])
    save(fig, "failover-distributions.svg")
    plt.close(fig)


def render_comparison(plt):
    d = json.load(open(os.path.join(DATA, "comparison.json")))
    el = d["electors"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 5.4), sharey=True)
    names = [e["name"] for e in el]
    ys = list(range(len(el)))[::-1]
    for ax, key, title in ((axes[0], "crash", "leader process killed"),
                           (axes[1], "freeze", "leader paused or partitioned")):
        for y, e in zip(ys, el):
            r = e.get(f"{key}_s")
            mine = e["name"].startswith("pgelect")
            kind = e.get(f"{key}_kind", "")
            if not r:
                ax.text(0.06, y, e.get(f"{key}_note", "–"), va="center", fontsize=7, color="#555555")
                continue
            lo, hi = r
            color = "#1f77b4" if mine else "#999999"
            hatch = None if kind.startswith("measured") else "///"
            width = max(hi - lo, lo * 0.04)
            ax.barh(y, width, left=lo, height=0.55, color=color if hatch is None else "white",
                    edgecolor=color, hatch=hatch, linewidth=1.2)
            ax.text(hi * 1.12, y, f"{fmt(lo)}–{fmt(hi)} s" if hi != lo else f"{fmt(lo)} s",
                    va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(0.05, 200)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds until a new leader acts (log scale)")
        ax.grid(True, axis="x", which="major", alpha=0.3)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(names, fontsize=8)
    fig.suptitle("Failover at defaults: pgelect measured (solid), others derived from their defaults (hatched)",
                 fontsize=10)
    fig.subplots_adjust(left=0.33, right=0.97, top=0.88, bottom=0.2)
    fig.text(0.01, 0.005, "pgelect: docs/src/measurements.md (pgelect-bench failover, commit 86a1f05, 2026-11-26; "
             "lease-failover, commit d5646d6, 2026-11-25; 2-core AMD EPYC). Others: derived from the sources in "
             "docs/data/comparison.json, not measured here.", fontsize=7, color="#555555", wrap=True)
    save(fig, "comparison.svg")
    plt.close(fig)


def fmt(x):
    return f"{x:.3g}"


def render_chaos(plt):
    d = json.load(open(os.path.join(DATA, "chaos-timeline.json")))
    nodes = sorted({i["node"] for i in d["intervals"] if i["to_s"] - i["from_s"] >= 0.05},
                   key=lambda n: (len(n), n))
    lane = {n: k for k, n in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(11, 5.6))
    cmap = plt.get_cmap("tab10")
    for i in d["intervals"]:
        if i["to_s"] - i["from_s"] < 0.05:
            continue  # a term that began as the run ended
        ax.barh(lane[i["node"]], i["to_s"] - i["from_s"], left=i["from_s"], height=0.6,
                color=cmap(i["term"] % 10), edgecolor="black", linewidth=0.4)
        ax.text((i["from_s"] + i["to_s"]) / 2, lane[i["node"]], f"{i['term']}", ha="center",
                va="center", fontsize=7, color="white")
    for f in d["faults"]:
        ax.axvline(f["at_s"], color="#d62728", linewidth=0.8, linestyle=":")
        ax.axvspan(f["at_s"], f["at_s"] + f["gap_ms"] / 1000, color="#d62728", alpha=0.12, linewidth=0)
        ax.text(f["at_s"], -0.75, f"{f['fault']} on {f['node']}: {f['gap_ms']:.0f} ms", rotation=60,
                fontsize=7, color="#b22222", ha="left", va="bottom", rotation_mode="anchor")
    ax.set_yticks(range(len(nodes)))
    ax.set_yticklabels([f"supervisor {n}" for n in nodes], fontsize=8)
    ax.set_ylim(len(nodes) - 0.4, -0.7)
    ax.set_xlabel("seconds since the first leader acted; bars: who acted as leader (the number is the term); "
                  "red: a fault and the gap until the next term acted")
    fig.suptitle("A chaos run: every fault, who led after it, and each gap "
                 "(an overlap is a paused leader; its fenced writes were refused)", fontsize=10, y=0.98)
    ax.grid(True, axis="x", alpha=0.25)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.72, bottom=0.16)
    source_line(fig, d["run"])
    save(fig, "chaos-timeline.svg")
    plt.close(fig)


def render_timing(plt):
    """The session backend's inequalities, drawn on one renewal of a leader,
    with the timing a real run reported (the failover benchmark's timing
    report for the library defaults)."""
    d = json.load(open(os.path.join(DATA, "failover-distributions.json")))
    t = timing_of(d["failover"], "default")
    ttl, margin = t["ttl_ms"] / 1000, t["safety_margin_ms"] / 1000
    renew, hb, hbt = t["renew_every_ms"] / 1000, t["heartbeat_ms"] / 1000, t["heartbeat_timeout_ms"] / 1000
    handover = t["handover_delay_ms"] / 1000
    # The server side of a lock connection gets TCP_USER_TIMEOUT = ttl and
    # keepalives that end later (election/timing.rs, default_tcp_for): the
    # earliest release of a silent client's lock is the TTL.
    tcp = ttl
    deadline = ttl - margin
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 6.4), gridspec_kw={"height_ratios": [3, 2]})
    rows = [
        ("renewals tried (every renew_every);\nnone answered from here on", [(k * renew, 0.05) for k in range(int(deadline // renew) + 1)], "#1f77b4"),
        ("the leader acts until its local deadline", [(0, deadline)], "#2ca02c"),
        ("server: its lease runs (now() + ttl)", [(0, ttl)], "#ff7f0e"),
        ("server: earliest release of a silent\nclient's lock (TCP_USER_TIMEOUT = ttl)", [(tcp, 0.0)], "#9467bd"),
    ]
    for y, (label, spans, color) in enumerate(rows):
        for start, width in spans:
            if width > 0.1:
                ax.barh(y, width, left=start, height=0.5, color=color, alpha=0.8)
            else:
                ax.plot([start], [y], marker="|", markersize=18, color=color, markeredgewidth=2)
        ax.text(-0.3, y, label, ha="right", va="center", fontsize=8)
    ax.axvline(deadline, color="#2ca02c", linestyle="--", linewidth=0.8)
    ax.axvline(ttl, color="#ff7f0e", linestyle="--", linewidth=0.8)
    ax.annotate("", xy=(deadline, 3.75), xytext=(ttl, 3.75), arrowprops=dict(arrowstyle="<->", color="black"))
    ax.text(deadline - 0.15, 3.75, f"(1) deadline {fmt(deadline)} s < lease expiry {fmt(ttl)} s:\nsafety margin {fmt(margin)} s",
            ha="right", va="center", fontsize=7.5)
    ax.text(tcp - 0.2, 3.0, f"(2) deadline < server release ({fmt(tcp)} s)", ha="right", va="center", fontsize=7.5)
    ax.text(renew + 0.15, -0.45, f"(3) renew_every {fmt(renew)} s < deadline {fmt(deadline)} s", fontsize=7.5)
    ax.set_yticks([])
    ax.set_xlim(-0.2, ttl * 1.08)
    ax.set_ylim(4.2, -0.9)
    ax.set_xlabel("seconds after the sending of the leader's last successful renewal", fontsize=8.5)
    ax.set_title(f"The session backend's timing rules at ttl {fmt(ttl)} s (the defaults), as "
                 "ElectorBuilder::build checks them", fontsize=10)
    # (4): the server ended the leader's connection and the goodbye was lost.
    notice = hb + hbt
    brows = [
        ("old leader: may still act until its next\nheartbeat goes unanswered", (0, notice), "#d62728"),
        ("successor: granted the lock, waits\nthe handover delay", (0, handover), "#bbbbbb"),
        ("successor acts", (handover, handover * 0.6), "#2ca02c"),
    ]
    for y, (label, (start, width), color) in enumerate(brows):
        bx.barh(y, width, left=start, height=0.5, color=color, alpha=0.85)
        bx.text(-0.05, y, label, ha="right", va="center", fontsize=8)
    bx.axvline(notice, color="#d62728", linestyle="--", linewidth=0.8)
    bx.text(notice + 0.03, 2.55, f"(4) heartbeat {fmt(hb)} s + timeout {fmt(hbt)} s = {fmt(notice)} s "
            f"≤ handover delay {fmt(handover)} s", fontsize=7.5, va="center")
    bx.set_yticks([])
    bx.set_xlim(-0.05, handover * 1.7)
    bx.set_ylim(2.9, -0.5)
    bx.set_xlabel("seconds after the server ended the leader's connection (its goodbye lost on the way)",
                  fontsize=8.5)
    fig.subplots_adjust(left=0.3, right=0.98, top=0.94, bottom=0.12, hspace=0.45)
    run = dict(d["run"])
    run["command"] = run["command"] + " (its timing report for the defaults)"
    source_line(fig, run)
    save(fig, "timing-inequalities.svg")
    plt.close(fig)


def timing_of(failover, series):
    value = (failover.get("crash") or {}).get(series)
    if isinstance(value, dict) and "timing" in value:
        return value["timing"]
    sys.exit(f"no timing report for {series} in the failover data")


def render(a):
    global PREVIEW
    PREVIEW = a.preview
    plt = plt_setup()
    os.makedirs(IMAGES, exist_ok=True)
    wanted = a.only.split(",") if a.only else ["failover", "comparison", "chaos", "timing"]
    for name in wanted:
        {"failover": render_failover, "comparison": render_comparison,
         "chaos": render_chaos, "timing": render_timing}[name](plt)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--only", help="comma-separated: failover,comparison,chaos,timing")
    r.add_argument("--preview", metavar="DIR", help="also write a PNG of each figure into DIR, to look at")
    for name in ("import-chaos", "import-bench"):
        s = sub.add_parser(name)
        s.add_argument("--command", required=True, help="the command that made the run, as typed")
        s.add_argument("--date", required=True, help="when the run was made (UTC)")
        s.add_argument("--commit")
        s.add_argument("--machine")
        s.add_argument("--out", required=True)
        if name == "import-chaos":
            s.add_argument("--logs", required=True, help="the backend's directory under --logs DIR")
            s.add_argument("--stdout", required=True, help="the command's standard output")
            s.add_argument("--json", help="the command's --json FILE")
            s.add_argument("--build", default="debug")
        else:
            s.add_argument("--failover", required=True)
            s.add_argument("--lease", required=True)
            s.add_argument("--load", help="load average during the run")
    a = p.parse_args()
    {"render": render, "import-chaos": import_chaos, "import-bench": import_bench}[a.cmd](a)


if __name__ == "__main__":
    main()
