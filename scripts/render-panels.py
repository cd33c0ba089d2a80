#!/usr/bin/env python3
"""Renders the Grafana dashboard's main panels (deploy/grafana/pgelect.json)
from a real run's metrics, as an SVG: no Grafana needed, python3's standard
library only.

  scripts/render-panels.py record --pgelect target/debug/pgelect \\
      --database-url-file FILE --samples /tmp/samples.jsonl
  scripts/render-panels.py render --samples /tmp/samples.jsonl \\
      --out docs/src/images/dashboard-panels.svg

`record` runs a scenario against the database named in FILE (for example
the one `pgelect demo --keep` prints): role "scheduler" (session backend,
three candidates) and role "sweeper" (lease backend, two candidates), all
`pgelect run --ttl 6s --metrics-addr 127.0.0.1:PORT -- sleep 1000`. It
kills leaders with SIGKILL and starts them again, asks for a resign, and
freezes a leader with SIGSTOP past its deadline, while it scrapes every
candidate's /metrics every 250 ms (a target that does not answer within
200 ms counts as down, as for Prometheus). Each line of the samples file is
one scrape or one event. With `--targets-file FILE` it also writes the
candidates' addresses as Prometheus file_sd JSON before starting them, so
that a real Prometheus (file_sd_configs on FILE) can scrape the same run and
evaluate the dashboard's queries and the alerts. `render` draws, per role, what the dashboard's
panels show: which node leads, the term, the time without a leader, the
renewal latency (the exporter's summary: p99 over its 60 s window, and the
mean between scrapes), and the losses by reason.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict

SCRAPE_EVERY = 0.25
SCRAPE_TIMEOUT = 0.2
LINE = re.compile(r'^(pgelect_[a-z_]+)(?:\{([^}]*)\})? (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# ---------------------------------------------------------------- record


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Candidate:
    def __init__(self, args, role, node, backend, logdir):
        self.args, self.role, self.node, self.backend = args, role, node, backend
        self.port = free_port()
        self.log = open(os.path.join(logdir, node + ".log"), "ab")
        self.proc = None

    def start(self):
        cmd = [self.args.pgelect, "--database-url-file", self.args.database_url_file,
               "run", "--role", self.role, "--id", self.node, "--backend", self.backend,
               "--ttl", "6s", "--metrics-addr", f"127.0.0.1:{self.port}", "--", "sleep", "1000"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def scrape(self):
        url = f"http://127.0.0.1:{self.port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as r:
                text = r.read().decode()
        except (OSError, ValueError):
            return None
        series = {}
        for line in text.splitlines():
            m = LINE.match(line)
            if m:
                labels = dict(LABEL.findall(m.group(2) or ""))
                key = m.group(1) + "".join(f";{k}={v}" for k, v in sorted(labels.items())
                                           if k != "role")
                series[key] = float(m.group(3))
        return series

    def is_leader(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/is-leader",
                                        timeout=SCRAPE_TIMEOUT):
                return True
        except (OSError, ValueError):
            return False


def record(args):
    logdir = os.path.dirname(os.path.abspath(args.samples))
    out = open(args.samples, "w")
    cands = [Candidate(args, "scheduler", f"sched-{c}", "session", logdir) for c in "abc"]
    cands += [Candidate(args, "sweeper", f"sweep-{c}", "lease", logdir) for c in "de"]
    t0 = time.monotonic()
    frozen = []

    def now():
        return round(time.monotonic() - t0, 3)

    def event(text):
        print(f"{now():6.2f}s  {text}", file=sys.stderr)
        out.write(json.dumps({"t": now(), "event": text}) + "\n")

    def leader(role):
        for c in cands:
            if c.role == role and c.alive() and c not in frozen and c.is_leader():
                return c
        return None

    def kill(role):
        c = leader(role)
        if c is None:
            event(f"no leader of {role} to kill")
            return None
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait()
        event(f"kill -9 {c.node}")
        return c

    killed = {}

    def restart(role):
        c = killed.pop(role, None)
        if c is not None:
            c.start()
            event(f"{c.node} restarted")

    def resign(role):
        subprocess.run([args.pgelect, "--database-url-file", args.database_url_file, "-q",
                        "resign", "--role", role], check=False)
        event(f"pgelect resign --role {role}")

    def freeze(role):
        c = leader(role)
        if c is None:
            event(f"no leader of {role} to freeze")
            return
        os.kill(c.proc.pid, signal.SIGSTOP)
        frozen.append(c)
        event(f"SIGSTOP {c.node}")

    def thaw():
        for c in frozen:
            os.kill(c.proc.pid, signal.SIGCONT)
            event(f"SIGCONT {c.node}")
        frozen.clear()

    script = [
        (8, lambda: killed.__setitem__("scheduler", kill("scheduler"))),
        (14, lambda: restart("scheduler")),
        (20, lambda: resign("scheduler")),
        (28, lambda: killed.__setitem__("sweeper", kill("sweeper"))),
        (34, lambda: restart("sweeper")),
        (40, lambda: freeze("scheduler")),
        (50, thaw),
    ]
    if args.targets_file:
        # Prometheus file_sd: a real Prometheus can scrape the same run.
        with open(args.targets_file + ".tmp", "w") as f:
            json.dump([{"targets": [f"127.0.0.1:{c.port}"],
                        "labels": {"node": c.node, "job": "pgelect"}} for c in cands], f)
        os.replace(args.targets_file + ".tmp", args.targets_file)
    for c in cands:
        c.start()
    event("5 candidates started (scheduler: session backend, sweeper: lease backend; ttl 6s)")
    try:
        while now() < args.seconds:
            tick = time.monotonic()
            while script and now() >= script[0][0]:
                script.pop(0)[1]()
            for c in cands:
                s = c.scrape() if c.alive() else None
                out.write(json.dumps({"t": now(), "node": c.node, "role": c.role,
                                      "up": s is not None, "series": s or {}}) + "\n")
            time.sleep(max(0.0, SCRAPE_EVERY - (time.monotonic() - tick)))
    finally:
        thaw()
        for c in cands:
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        for c in cands:
            if c.proc is not None:
                c.proc.wait()
        out.close()
    print(f"wrote {args.samples}; candidates' logs in {logdir}", file=sys.stderr)


# ---------------------------------------------------------------- render

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]
W, LEFT, RIGHT = 1200, 150, 215


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Svg:
    def __init__(self, t_end):
        self.parts, self.y, self.t_end = [], 0, t_end

    def x(self, t):
        return LEFT + (W - LEFT - RIGHT) * t / self.t_end

    def add(self, s):
        self.parts.append(s)

    def text(self, x, y, s, size=12, anchor="start", color="#333", weight="normal"):
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                 f'fill="{color}" font-weight="{weight}">{esc(s)}</text>')

    def panel(self, title, subtitle, height, events):
        top = self.y + 10
        self.add(f'<rect x="5" y="{top}" width="{W - 10}" height="{height + 46}" rx="4" '
                 'fill="#fff" stroke="#ccc"/>')
        self.text(15, top + 18, title, 14, weight="bold")
        self.text(15, top + 34, subtitle, 11, color="#666")
        body = top + 42
        for t, _ in events:
            self.add(f'<line x1="{self.x(t):.1f}" y1="{body}" x2="{self.x(t):.1f}" '
                     f'y2="{body + height}" stroke="#bbb" stroke-dasharray="3,3"/>')
        self.y = top + height + 50
        return body

    def time_axis(self, y):
        for s in range(0, int(self.t_end) + 1, 5):
            self.text(self.x(s), y, f"{s}s", 10, "middle", "#666")

    def plot(self, body, height, lines, unit, fmt, y_min=0.0):
        """lines: [(label, [(t, v)], color)]; v None breaks the line."""
        vals = [v for _, pts, _ in lines for _, v in pts if v is not None]
        y_max = max(vals) if vals else 1.0
        y_max = y_max * 1.1 if y_max > y_min else y_min + 1
        def y(v):
            return body + height - (v - y_min) / (y_max - y_min) * height
        for i in range(5):
            v = y_min + (y_max - y_min) * i / 4
            self.add(f'<line x1="{LEFT}" y1="{y(v):.1f}" x2="{W - RIGHT}" y2="{y(v):.1f}" '
                     'stroke="#eee"/>')
            self.text(LEFT - 6, y(v) + 4, fmt(v) + unit, 10, "end", "#666")
        for n, (label, pts, color) in enumerate(lines):
            seg = []
            for t, v in pts + [(None, None)]:
                if v is None:
                    if len(seg) > 1:
                        self.add(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" '
                                 f'points="{" ".join(seg)}"/>')
                    elif seg:
                        cx, cy = seg[0].split(",")
                        self.add(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}"/>')
                    seg = []
                else:
                    seg.append(f"{self.x(t):.1f},{y(v):.1f}")
            self.text(W - RIGHT + 10, body + 10 + 14 * n, label, 11, "start", color)


def load(path):
    scrapes, events = [], []
    for line in open(path):
        r = json.loads(line)
        (events if "event" in r else scrapes).append(r)
    return scrapes, events


def render(args):
    scrapes, events = load(args.samples)
    t_end = max(r["t"] for r in scrapes)
    roles = sorted({r["role"] for r in scrapes})
    nodes = {role: sorted({r["node"] for r in scrapes if r["role"] == role}) for role in roles}
    by_node = defaultdict(list)
    for r in scrapes:
        by_node[r["node"]].append(r)
    # One scrape round: every node scraped once, in file order (a round that
    # waited for a frozen target takes longer than 250 ms).
    rounds, current = {}, {}
    for r in scrapes:
        if r["node"] in current:
            rounds[len(rounds)] = current
            current = {}
        current[r["node"]] = r
    rounds[len(rounds)] = current
    svg = Svg(t_end)
    marks = [(e["t"], e["event"]) for e in events if e["t"] > 0.5]

    # Events, numbered, as the dashboard's annotations would be.
    svg.text(15, 22, "pgelect: the dashboard's main panels, rendered from a real run's metrics "
             "(scrapes every 250 ms; not a Grafana screenshot)", 15, weight="bold")
    legend = [f"[{i + 1}] {t:.1f}s {e}" for i, (t, e) in enumerate(marks)]
    half = (len(legend) + 1) // 2
    svg.text(15, 40, "   ".join(legend[:half]), 11, color="#444")
    svg.text(15, 55, "   ".join(legend[half:]), 11, color="#444")
    svg.y = 60

    def number_marks(body):
        for i, (t, _) in enumerate(marks):
            svg.text(svg.x(t) + 2, body + 10, f"[{i + 1}]", 9, color="#888")

    # Leader per role: one lane per node (pgelect_is_leader; grey: not scraped).
    lanes = [(role, n) for role in roles for n in nodes[role]]
    h = 18 * len(lanes)
    body = svg.panel("Leader per role", "max by (role, instance) (pgelect_is_leader)  "
                     "green: 1 (leads), light: 0 (stands by), grey: target down, "
                     "blank: series absent (never led)", h, marks)
    for i, (role, n) in enumerate(lanes):
        y = body + 18 * i
        svg.text(LEFT - 6, y + 13, f"{role} · {n}", 11, "end")
        rs = by_node[n]
        runs = []  # [t_start, t_end, colour]
        for a, b in zip(rs, rs[1:] + [None]):
            t1 = b["t"] if b else t_end
            if not a["up"]:
                color = "#bbb"
            elif "pgelect_is_leader" not in a["series"]:
                color = None
            else:
                color = "#37a852" if a["series"]["pgelect_is_leader"] == 1 else "#dcefe0"
            if runs and runs[-1][2] == color:
                runs[-1][1] = t1
            else:
                runs.append([a["t"], t1, color])
        for t_a, t_b, color in runs:
            if color is not None:
                svg.add(f'<rect x="{svg.x(t_a):.1f}" y="{y + 2}" '
                        f'width="{max(svg.x(t_b) - svg.x(t_a), 0.5):.2f}" height="14" '
                        f'fill="{color}"/>')
    number_marks(body)

    # Term per role: the highest term any candidate reported in the last
    # 5 minutes (here: so far).
    h = 110
    body = svg.panel("Term", "max by (role) (max_over_time(pgelect_term[5m]))", h, marks)
    lines = []
    for i, role in enumerate(roles):
        pts, highest = [], None
        for k in sorted(rounds):
            terms = [r["series"].get("pgelect_term") for r in rounds[k].values()
                     if r["role"] == role and r["up"]]
            terms = [v for v in terms if v is not None]
            if terms:
                highest = max([highest or 0] + terms)
            pts.append((next(iter(rounds[k].values()))["t"], highest))
        lines.append((role, pts, COLORS[i]))
    svg.plot(body, h, lines, "", lambda v: f"{v:.0f}")
    number_marks(body)

    # Time without a leader: no scraped candidate of the role reports 1.
    h = 22 * len(roles)
    body = svg.panel("Time without a leader", "no candidate of the role reports "
                     "pgelect_is_leader = 1 (the alert PgelectNoLeader's expression); "
                     "total in the range on the right", h, marks)
    for i, role in enumerate(roles):
        y = body + 22 * i
        svg.text(LEFT - 6, y + 15, role, 11, "end")
        ks = sorted(rounds)
        total, runs = 0.0, []
        for a, b in zip(ks, ks[1:] + [None]):
            ra = rounds[a]
            t_a = next(iter(ra.values()))["t"]
            t_b = next(iter(rounds[b].values()))["t"] if b is not None else t_end
            led = any(r["up"] and r["series"].get("pgelect_is_leader") == 1
                      for r in ra.values() if r["role"] == role)
            if not led:
                total += t_b - t_a
                if runs and runs[-1][1] == t_a:
                    runs[-1][1] = t_b
                else:
                    runs.append([t_a, t_b])
        for t_a, t_b in runs:
            svg.add(f'<rect x="{svg.x(t_a):.1f}" y="{y + 3}" '
                    f'width="{max(svg.x(t_b) - svg.x(t_a), 0.5):.2f}" height="16" '
                    'fill="#e0554a"/>')
        svg.add(f'<line x1="{LEFT}" y1="{y + 19}" x2="{W - RIGHT}" y2="{y + 19}" stroke="#eee"/>')
        svg.text(W - RIGHT + 10, y + 15, f"{total:.1f} s without a leader", 11, "start", "#b0302a")
    number_marks(body)

    # Renewal latency: the exporter's summary (p99 of its 60 s window) and
    # the mean between scrapes (rate of _sum / rate of _count).
    h = 120
    body = svg.panel("Renewal latency", "pgelect_renew_duration_seconds{quantile=\"0.99\"} "
                     "while leading (solid), and rate(_sum) / rate(_count) over 1 s (dots), per node", h, marks)
    lines = []
    c = 0
    for role in roles:
        for n in nodes[role]:
            rs = [r for r in by_node[n]]
            p99 = [(r["t"], 1000 * r["series"]["pgelect_renew_duration_seconds;quantile=0.99"])
                   if r["up"] and "pgelect_renew_duration_seconds;quantile=0.99" in r["series"]
                   and r["series"].get("pgelect_is_leader") == 1
                   else (r["t"], None) for r in rs]
            if all(v is None for _, v in p99):
                continue
            lines.append((f"{role} · {n} p99", p99, COLORS[c % len(COLORS)]))
            c += 1
    svg.plot(body, h, lines, " ms", lambda v: f"{v:.1f}")
    # The means, as dots: over 1 s windows (4 scrapes).
    c = 0
    y_vals = [v for _, pts, _ in lines for _, v in pts if v is not None]
    y_max = (max(y_vals) * 1.1) if y_vals else 1.0
    for role in roles:
        for n in nodes[role]:
            rs = [r for r in by_node[n] if r["up"]]
            if not any("pgelect_renew_duration_seconds;quantile=0.99" in r["series"] for r in rs):
                continue
            color = COLORS[c % len(COLORS)]
            c += 1
            for a, b in zip(rs, rs[4:]):
                sa, sb = a["series"], b["series"]
                k_s, k_c = "pgelect_renew_duration_seconds_sum", "pgelect_renew_duration_seconds_count"
                if k_c in sa and k_c in sb and sb[k_c] > sa[k_c]:
                    mean = 1000 * (sb[k_s] - sa[k_s]) / (sb[k_c] - sa[k_c])
                    yy = body + h - min(mean, y_max) / y_max * h
                    svg.add(f'<circle cx="{svg.x(b["t"]):.1f}" cy="{yy:.1f}" r="1.5" '
                            f'fill="{color}"/>')
    number_marks(body)

    # Losses by reason: the counters summed over the role's candidates.
    h = 100
    body = svg.panel("Leadership losses by reason", "sum by (role, reason) "
                     "(pgelect_leadership_losses_total), cumulative over the run; "
                     "a killed candidate's counters go with it", h, marks)
    lines = []
    keys = sorted({(r["role"], k.split("reason=")[1]) for r in scrapes for k in r["series"]
                   if k.startswith("pgelect_leadership_losses_total;")})
    seen = defaultdict(float)  # (node, key) -> last value, so that a killed node still counts
    for i, (role, reason) in enumerate(keys):
        pts = []
        for k in sorted(rounds):
            for r in rounds[k].values():
                if r["role"] == role and r["up"]:
                    v = r["series"].get(f"pgelect_leadership_losses_total;reason={reason}")
                    if v is not None:
                        seen[(r["node"], role, reason)] = max(seen[(r["node"], role, reason)], v)
            total = sum(v for (n, ro, re_), v in seen.items() if ro == role and re_ == reason)
            pts.append((next(iter(rounds[k].values()))["t"], total))
        lines.append((f"{role} · {reason}", pts, COLORS[i % len(COLORS)]))
    svg.plot(body, h, lines, "", lambda v: f"{v:.1f}")
    number_marks(body)

    svg.time_axis(svg.y + 4)
    height = svg.y + 14
    with open(args.out, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
                f'viewBox="0 0 {W} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n')
        f.write(f'<rect width="{W}" height="{height}" fill="#f7f7f7"/>\n')
        f.write("\n".join(svg.parts))
        f.write("\n</svg>\n")
    print(f"wrote {args.out}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the scenario and scrape every candidate")
    r.add_argument("--pgelect", default="target/debug/pgelect")
    r.add_argument("--database-url-file", required=True)
    r.add_argument("--samples", required=True)
    r.add_argument("--seconds", type=float, default=62)
    r.add_argument("--targets-file", help="also write the candidates' addresses here, as "
                   "Prometheus file_sd JSON, before starting them")
    d = sub.add_parser("render", help="draw the panels from a samples file")
    d.add_argument("--samples", required=True)
    d.add_argument("--out", default="docs/src/images/dashboard-panels.svg")
    args = p.parse_args()
    record(args) if args.cmd == "record" else render(args)


if __name__ == "__main__":
    main()
