#!/usr/bin/env python3
"""sluice against nginx and haproxy, measured with wrk on this machine.

    python3 bench/bench.py [--rounds N] [--duration S] [--quick] [--no-pgo]

Installs what it needs when missing (wrk, nginx, haproxy, redis-server: Debian packages,
needs root), builds sluice in release mode and with profile-guided
optimisation (bench/pgo.py, about 8 minutes; `--no-pgo` skips it and measures
the plain build as sluice), then starts:

  upstream      nginx, 1 worker, `return 200`                  (the API; its
                stub_status, on a port of its own, counts the connections
                each setup opens to it)
  nginx         nginx, 1 worker, reverse proxy as its operators configure
                it: an upstream keep-alive pool of 1024 (at least the
                client concurrency), keepalive_requests 1000000 on both
                sides, multi_accept, reuseport
  nginx-limit   the same with `limit_req` (local memory, never rejecting)
  haproxy       haproxy, 1 process, 1 thread, `http-reuse always`
  haproxy-limit the same with a stick-table counting each client address's
                request rate and a deny rule it never reaches
  sluice        sluice, 1 worker, no policy (the PGO build, as every sluice
                below but sluice-plain)
  sluice-plain  the same, built by `cargo build --release` alone
  sluice-mem    sluice, memory store, policy 10/1s + 120/1m + 240/1h (1m precision)
  sluice-redis  sluice, Redis store, the same policy
  sluice-redis-null
                the same binary and policy, with bench/redis_null.lua in
                place of lua/acquire.lua (a copy, patched): Redis answers at
                once, so this is the proxy's own part of a Redis policy,
                whatever Redis costs on the machine (not a target)
  floor         a TCP relay with no HTTP (bench/floor.rs): tokio, 1 worker,
                mimalloc, like sluice; what any proxy built so pays before its
                own work (not a target: a scale for the others)
  http-floor    the same program with --http: the least an HTTP/1.1 reverse
                proxy does (parse both heads, drop hop-by-hop fields, add
                X-Forwarded-For, a shared keep-alive pool); sluice's features
                are what it spends above this (also not a target)

(limits high enough never to reject) and runs `wrk -t1 --latency` against each,
interleaved, for several rounds, at -c50 and -c200. Then two runs of sluice with
Redis: many distinct client identities (random X-Forwarded-For from a trusted
peer), and most requests rejected (deny cache warm); and nginx and sluice (no
policy) with requests that carry eight more fields, as browsers and API
clients send (wrk sends only Host). Reported per setup, as the
median over rounds: req/s, p50, p99, proxy CPU µs per request (utime+stime of
the proxy process over the run / requests), Redis CPU µs per request
(redis-server's own CPU), Redis calls per request (INFO commandstats), the new
connections the upstream accepted during the run (a setup that opens more
than its client connections in a run is flagged `!`: under keep-alive load a
well configured proxy opens none), and each figure as a ratio to the best
peer for that figure (nginx or haproxy, whichever has the most req/s, the
lowest p99, the least CPU; a flagged peer is not a reference): the median of
the ratios within each round (a round
runs the setups back to back, so its ratios are spared most of the drift a busy
machine adds between rounds; each round starts one setup later than the one
before, so no setup always runs first or after the same one), and the
proxies' CPU split into user and system.
Also each setup's quietest round (its lowest CPU per request): a neighbour on a
shared machine only adds time, so that figure moves least between runs.
Writes bench/results/table.txt and bench/results/plot.svg, and ends with the
issue's targets, met or not. Everything it started is stopped at the end.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
TICK = os.sysconf("SC_CLK_TCK")
# The fields a browser or an API client adds to a GET (see the run with them).
REAL_FIELDS = [
    ("User-Agent", "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
                   "Chrome/120.0 Safari/537.36"),
    ("Accept", "application/json, text/plain, */*"),
    ("Accept-Encoding", "gzip, deflate, br"),
    ("Accept-Language", "en-US,en;q=0.9"),
    ("Authorization", "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijklmnop"),
    ("Cookie", "session=0123456789abcdef; theme=dark"),
    ("Referer", "https://example.com/app/page"),
    ("X-Request-Id", "7f9c2ba4-e88f-11ee-a6d2-0242ac120002"),
]
# The peers sluice is measured against; each ratio is to the best of them
# for that figure (the most req/s, the lowest p99, the least CPU).
PEERS = ["nginx", "haproxy"]
# The peers with a rate limit (never rejecting), for sluice's policies.
LIMIT_PEERS = ["nginx-limit", "haproxy-limit"]
FIGURES = {"rps": max, "p99": min, "cpu_us": min}
POLICY = """limits = [
  { limit = 1000000000, window = "1s" },
  { limit = 1000000000, window = "1m" },
  { limit = 1000000000, window = "1h", precision = "1m" },
]"""


def apt_install(*packages):
    """Installs the first of `packages` Debian has; says whether one was."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    for package in packages:
        done = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", package], env=env)
        if done.returncode == 0:
            return True
    return False


def need(tool, *packages):
    """Installs `tool` from the first of `packages` Debian has, unless it is on PATH."""
    if shutil.which(tool):
        return
    print(f"--- installing {packages[0]}", flush=True)
    if not apt_install(*packages):
        sys.exit(f"bench: could not install {tool} (tried {', '.join(packages)})")


def need_redis_module():
    """bench/redis_cost.py needs the Python redis client: pip where this Python
    has a usable pip (a venv, pyenv), else Debian's python3-redis (Debian's
    own Python has no pip, and refuses system-wide pip installs)."""
    probe = [sys.executable, "-c", "import redis"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return
    print("--- installing the Python redis client", flush=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "redis"], capture_output=True)
    if pip.returncode != 0:
        apt_install("python3-redis")
    if subprocess.run(probe, capture_output=True).returncode != 0:
        sys.exit(f"bench: {sys.executable} cannot import redis; install it (pip install redis)")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def cpu_split(pid):
    """(user, system) CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid):
    return sum(cpu_split(pid))


def children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    except OSError:
        return []


def exit_on_signals():
    """SIGTERM and SIGHUP (a `timeout`, a CI job cancelled, a closed terminal)
    end the run the way Ctrl-C does: through the `finally` that stops what
    it started. Python's default for them exits at once and leaves nginx,
    Redis and the sluices running."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


class Procs:
    """Everything started, stopped at the end whatever happens."""

    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        p = subprocess.Popen(args, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=10)
            except Exception:
                p.kill()


# The largest client concurrency (wrk -c) the bench runs; the peers' upstream
# keep-alive pools hold at least this many idle connections.
MAX_CONNS = 1024


def nginx_conf(dir_, port, body):
    """One nginx worker as its operators tune it for keep-alive load: every
    connection ready is accepted at once (`multi_accept`), a client
    connection serves up to a million requests (the default, 1000, closes
    wrk's connections every second or so) and may idle for five minutes."""
    conf = os.path.join(dir_, f"nginx-{port}.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1;
daemon off;
pid {dir_}/nginx-{port}.pid;
error_log {dir_}/nginx-{port}.log error;
events {{ worker_connections 8192; multi_accept on; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 300s;
  {body}
}}
""")
    return conf


def upstream_conf(dir_, port, tls=None, status_port=None):
    """nginx as the API: one worker answering `200 ok`; over TLS when `tls`
    is (certificate, key). With `status_port`, its stub_status answers there
    (its `accepts` counts the connections the proxies open to it)."""
    ssl = f" ssl; ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]}" if tls else ""
    status = (f" server {{ listen 127.0.0.1:{status_port}; location / {{ stub_status; }} }}"
              if status_port else "")
    return nginx_conf(dir_, port, f'server {{ listen 127.0.0.1:{port} reuseport{ssl}; '
                                  f'location / {{ return 200 "ok"; }} }}{status}')


def proxy_nginx_conf(dir_, port, up, limit=False):
    """nginx as a reverse proxy to `up`, configured as its operators do: an
    upstream keep-alive pool at least the client concurrency, a million
    requests per upstream connection, HTTP/1.1 to the upstream with the
    client's `Connection` field cleared (else the upstream connection is not
    kept). With `limit`, `limit_req` by client address, never rejecting at
    the bench's rates."""
    zone = "limit_req_zone $binary_remote_addr zone=z:10m rate=100000000r/s; " if limit else ""
    limit_req = "limit_req zone=z burst=100000000 nodelay; " if limit else ""
    return nginx_conf(dir_, port,
                      f"upstream api {{ server 127.0.0.1:{up}; keepalive {MAX_CONNS}; "
                      f"keepalive_requests 1000000; keepalive_timeout 300s; }} {zone}"
                      f"server {{ listen 127.0.0.1:{port} reuseport; location / {{ {limit_req}"
                      f'proxy_pass http://api; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}')


def haproxy_conf(dir_, port, up, limit=False):
    """haproxy as a reverse proxy to `up`, as its operators configure it for
    keep-alive load: one process with one thread, HTTP mode, keep-alive on
    both sides, idle server connections shared by every client
    (`http-reuse always`) and kept while idle (`pool-purge-delay`). With
    `limit`, a stick-table tracks each client address's request rate and a
    rule denies above a rate the bench never reaches."""
    conf = os.path.join(dir_, f"haproxy-{port}.cfg")
    limit_rules = ("  stick-table type ip size 100k expire 60s store http_req_rate(1s)\n"
                   "  http-request track-sc0 src\n"
                   "  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }\n"
                   if limit else "")
    with open(conf, "w") as f:
        f.write(f"""global
  nbthread 1
  maxconn 8000

defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 300s
  timeout server 300s
  timeout http-keep-alive 300s
  timeout http-request 10s

frontend fe
  bind 127.0.0.1:{port}
{limit_rules}  default_backend api

backend api
  server up 127.0.0.1:{up} pool-purge-delay 300s
""")
    return conf


def stub_accepts(port):
    """The upstream nginx's `accepts`: the connections it accepted so far,
    this reading's own included."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
        text = r.read().decode()
    return int(text.split("\n")[2].split()[0])


def redis_args(port):
    """A redis-server on `port` that keeps nothing on disk."""
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def redis_store(port):
    """sluice's `[store]` section for the redis-server on `port`."""
    return f'[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:{port}/0"\ntimeout = "200ms"'


def many_lua(dir_, path="/"):
    """A wrk script: each request to `path` from a random client address
    (`X-Forwarded-For`, which sluice believes from 127.0.0.1)."""
    script = os.path.join(dir_, "many.lua")
    with open(script, "w") as f:
        f.write('math.randomseed(os.time())\nrequest = function()\n'
                '  local ip = "10." .. math.random(0,255) .. "." .. math.random(0,255) .. "." .. math.random(1,254)\n'
                f'  return wrk.format("GET", "{path}", {{ ["X-Forwarded-For"] = ip }})\nend\n')
    return script


def fields_lua(dir_):
    """A wrk script: every request carries REAL_FIELDS."""
    script = os.path.join(dir_, "fields.lua")
    with open(script, "w") as f:
        f.write("".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in REAL_FIELDS))
    return script


def null_build(binary, dir_):
    """A copy of `binary` with the text of lua/acquire.lua it embeds replaced
    by bench/redis_null.lua, padded with a comment to the same length. sluice
    hashes its script's text when it starts, so the copy loads and calls the
    stand-in; nothing else in it differs. None when the text is not in the
    binary exactly once (a build from other sources)."""
    with open(binary, "rb") as f:
        data = f.read()
    with open(os.path.join(ROOT, "lua", "acquire.lua"), "rb") as f:
        acquire = f.read()
    with open(os.path.join(ROOT, "bench", "redis_null.lua"), "rb") as f:
        null = f.read()
    if data.count(acquire) != 1 or len(null) + 2 > len(acquire):
        return None
    null += b"--" + b" " * (len(acquire) - len(null) - 2)
    path = os.path.join(dir_, "sluice-redis-null")
    with open(path, "wb") as f:
        f.write(data.replace(acquire, null))
    os.chmod(path, 0o755)
    return path


def cpu_model():
    """The processor's name as the kernel gives it (machines of one kind
    differ: a slower one moves every absolute figure, not the ratios)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def redis_info(port, section):
    out = subprocess.run(["redis-cli", "-p", str(port), "info", section], capture_output=True, text=True).stdout
    return out


def evalsha_calls(port):
    m = re.search(r"cmdstat_evalsha:calls=(\d+)", redis_info(port, "commandstats"))
    return int(m.group(1)) if m else 0


def parse_wrk(out):
    def ms(text):
        v, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()
        return float(v) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"requests": reqs, "rps": rps, "p50": p50, "p99": p99,
            "non2xx": int(non2xx.group(1)) if non2xx else 0, "errors": errors.group(1) if errors else ""}


def run_wrk(url, conns, duration, proxy_pids, redis_pid, redis_port, script=None, status_port=None):
    """One wrk run; with `status_port` (the upstream's stub_status), also the
    new connections the upstream accepted during it (`new_up`)."""
    args = ["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--latency"]
    if script:
        args += ["-s", script]
    # One reading of each process's (user, system) before and after.
    def proxies_cpu():
        splits = [cpu_split(p) for p in proxy_pids]
        return sum(u for u, _ in splits), sum(s for _, s in splits)

    user_before, sys_before = proxies_cpu()
    rbefore = cpu_seconds(redis_pid) if redis_pid else 0
    calls_before = evalsha_calls(redis_port) if redis_port else 0
    accepts_before = stub_accepts(status_port) if status_port else 0
    out = subprocess.run(args + [url], capture_output=True, text=True, check=True).stdout
    r = parse_wrk(out)
    n = max(r["requests"], 1)
    user_after, sys_after = proxies_cpu()
    r["user_us"] = (user_after - user_before) * 1e6 / n
    r["sys_us"] = (sys_after - sys_before) * 1e6 / n
    r["cpu_us"] = r["user_us"] + r["sys_us"]
    r["redis_us"] = ((cpu_seconds(redis_pid) - rbefore) * 1e6 / n) if redis_pid else 0.0
    r["redis_calls"] = ((evalsha_calls(redis_port) - calls_before) / n) if redis_port else 0.0
    # Less the reading's own connection to the status port.
    r["new_up"] = (stub_accepts(status_port) - accepts_before - 1) if status_port else 0
    return r


def svg_plot(rows, path):
    """A bar chart of req/s and p99 per setup, -c50 (no plotting library needed)."""
    rows = [r for r in rows if r["conns"] == 50]
    w, h, pad, bar = max(860, 120 + 100 * len(rows)), 360, 60, 22
    max_rps = max(r["rps"] for r in rows) or 1
    max_p99 = max(r["p99"] for r in rows) or 1
    step = (w - 2 * pad) / len(rows)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{w/2}" y="18" text-anchor="middle" font-size="14">wrk -t1 -c50, 1 proxy worker: req/s (blue) and p99 latency (orange)</text>']
    base = h - pad
    for i, r in enumerate(rows):
        x = pad + i * step + step / 2
        hr = (r["rps"] / max_rps) * (h - 2 * pad - 20)
        hp = (r["p99"] / max_p99) * (h - 2 * pad - 20)
        out.append(f'<rect x="{x - bar}" y="{base - hr}" width="{bar}" height="{hr}" fill="#4477aa"/>')
        out.append(f'<text x="{x - bar/2}" y="{base - hr - 4}" text-anchor="middle">{r["rps"]/1000:.1f}k</text>')
        out.append(f'<rect x="{x}" y="{base - hp}" width="{bar}" height="{hp}" fill="#ee7733"/>')
        out.append(f'<text x="{x + bar/2}" y="{base - hp - 4}" text-anchor="middle">{r["p99"]:.2f}ms</text>')
        label = r["setup"] + ("!" if r.get("flagged") else "")
        out.append(f'<text x="{x}" y="{base + 16}" text-anchor="middle">{label}</text>')
    out.append(f'<line x1="{pad}" y1="{base}" x2="{w - pad}" y2="{base}" stroke="black"/>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def targets(rows, extra, cost):
    """The performance targets, each with its figure from this run: met or not."""
    row = {(r["setup"], r["conns"]): r for r in rows}
    out = ["targets (ratios are medians of each round's ratio; against a peer: the best peer for that figure):"]

    def check(ok, text):
        out.append(f"  [{'met' if ok else 'NOT met'}] {text}")

    def against(r, peers):
        return "; ".join(f"against {p}{' (misconfigured)' if row[(p, r['conns'])]['flagged'] else ''}: "
                         f"req/s {r['vs'][p]['rps']:.2f}x, p99 {r['vs'][p]['p99']:.2f}x, "
                         f"CPU {r['vs'][p]['cpu_us']:.2f}x" for p in peers)

    for c in sorted({r["conns"] for r in rows}):
        s, mem, red = row[("sluice", c)], row[("sluice-mem", c)], row[("sluice-redis", c)]
        b = s["best"]
        check(s["cpu_x"] <= 0.85, f"-c{c} no policy: CPU per request {s['cpu_x']:.2f}x {b['cpu_us']}'s (<= 0.85)")
        check(s["rps_x"] >= 1.0, f"-c{c} no policy: req/s {s['rps_x']:.2f}x {b['rps']}'s (>= 1)")
        check(s["p99_x"] <= 1.0, f"-c{c} no policy: p99 {s['p99_x']:.2f}x {b['p99']}'s (<= 1)")
        out.append(f"    (no policy {against(s, PEERS)})")
        out.append(f"    (memory store {against(mem, LIMIT_PEERS)})")
        out.append(f"    (Redis store {against(red, LIMIT_PEERS)})")
        x = red["cpu_vs_none"]
        check(x <= 1.2, f"-c{c} Redis policy: CPU per request {x:.2f}x no policy (<= 1.2)")
        null = row.get(("sluice-redis-null", c))
        if null:
            # Redis shares the cores, and the proxy waits for it: the slower
            # Redis runs here, the more the ratio above holds of Redis's cost.
            out.append(f"    (the same binary against a Redis script that only answers: {null['cpu_vs_none']:.2f}x "
                       f"no policy, Redis {null['redis_us']:.1f} us a request against {red['redis_us']:.1f}: "
                       f"the proxy's own part)")
        check(abs(red["redis_calls"] - 1) < 0.01, f"-c{c} Redis policy: {red['redis_calls']:.2f} Redis calls per request (1)")
        x = mem["cpu_vs_none"]
        check(x <= 1.05, f"-c{c} memory store: CPU per request {x:.2f}x no policy (<= 1.05)")
    rej, allowed = extra["mostly rejected"], row[("sluice-redis", min(r["conns"] for r in rows))]
    check(rej["cpu_us"] < allowed["cpu_us"] and rej["redis_calls"] == 0,
          f"rejected: {rej['cpu_us']:.1f} us per request vs {allowed['cpu_us']:.1f} allowed, "
          f"{rej['redis_calls']:.2f} Redis calls (cheaper, 0)")
    m = re.search(r"per decision .*?: ([\d.]+) us = ([\d.]+)x", cost)
    if m:
        us, x = float(m.group(1)), float(m.group(2))
        check(us <= 10, f"Redis CPU per decision: {us:.2f} us (<= 10)")
        check(x <= 1 / 3, f"Redis CPU per decision: {x:.2f}x the seed reference (<= a third)")
        # The 10 us is the third of the seed script's ~30 us on its
        # machine; a slower machine runs both slower (the seed took 40 us on
        # quiet days here, 78 on a slow one), so say what it comes to there.
        seed = re.search(r"the seed reference \(([\d.]+) us\)", cost)
        seed = float(seed.group(1)) if seed else 0
        if seed > 30:
            out.append(f"    (the seed reference took {seed:.1f} us here, against the issue's ~30: "
                       f"at the issue's speed that is {x * 30:.1f} us a decision)")
        # What Redis itself costs here, with no counting (bench/redis_floor.lua):
        # when that alone nears 10 us, no script could show the figure here.
        floor = re.search(r"floor per decision: ([\d.]+) us", cost)
        if floor:
            out.append(f"    (a script that only reads and rewrites the identity's string took "
                       f"{float(floor.group(1)):.1f} us here: the floor of any script on this machine)")
    m = re.search(r"per identity .*?: (\d+) bytes", cost)
    if m:
        check(int(m.group(1)) <= 600, f"Redis memory per identity: {m.group(1)} bytes (<= 600)")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="1 round of 4 s, -c50 only")
    ap.add_argument("--no-pgo", action="store_true",
                    help="measure `cargo build --release` as sluice, not the PGO build (saves its 8 minutes)")
    args = ap.parse_args()
    exit_on_signals()
    if args.quick:
        args.rounds, args.duration = 1, 4
    conns_list = [50] if args.quick else [50, 200]

    need("wrk", "wrk")
    need("nginx", "nginx-light", "nginx")
    need("haproxy", "haproxy")
    need("redis-server", "redis-server")
    need_redis_module()
    print("--- building sluice and the floor (release)", flush=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "sluice", "--example", "floor"],
                   cwd=ROOT, check=True)
    plain = os.path.join(ROOT, "target", "release", "sluice")
    floor = os.path.join(ROOT, "target", "release", "examples", "floor")
    # The release build measured: profile-guided (see bench/pgo.py), with the
    # plain build beside it as `sluice-plain` (no policy).
    if args.no_pgo:
        sluice = plain
    else:
        import pgo
        sluice = pgo.build()

    tmp = tempfile.mkdtemp(prefix="sluice-bench-")
    procs = Procs()
    haproxy_pids = {}
    try:
        null_bin = null_build(sluice, tmp)
        if not null_bin:
            print("--- sluice-redis-null skipped: lua/acquire.lua's text is not in the binary once", flush=True)
        ports = {k: free_port() for k in ["upstream", "upstream-status", "nginx", "nginx-limit", "haproxy",
                                           "haproxy-limit", "sluice", "sluice-mem",
                                           "sluice-redis", "redis", "sluice-many", "sluice-reject", "floor",
                                           "http-floor"] + ([] if args.no_pgo else ["sluice-plain"])
                 + (["sluice-redis-null"] if null_bin else [])}
        up = ports["upstream"]
        status = ports["upstream-status"]
        procs.start(["nginx", "-c", upstream_conf(tmp, up, status_port=status)])
        procs.start(["nginx", "-c", proxy_nginx_conf(tmp, ports["nginx"], up)])
        procs.start(["nginx", "-c", proxy_nginx_conf(tmp, ports["nginx-limit"], up, limit=True)])
        # -db: in the foreground, one process (no master), which does the work.
        haproxy_log = open(os.path.join(tmp, "haproxy.log"), "w")
        for name, limit in [("haproxy", False), ("haproxy-limit", True)]:
            conf = haproxy_conf(tmp, ports[name], up, limit)
            subprocess.run(["haproxy", "-c", "-q", "-f", conf], check=True)
            pids_haproxy = procs.start(["haproxy", "-db", "-f", conf], stdout=haproxy_log,
                                       stderr=subprocess.STDOUT).pid
            haproxy_pids[name] = pids_haproxy
        redis = procs.start(redis_args(ports["redis"]))

        def sluice_conf(name, store, policy, extra=""):
            path = os.path.join(tmp, f"{name}.toml")
            pol = f"[policies.p]\n{policy}\n" if policy else ""
            with open(path, "w") as f:
                f.write(f"""[server]
listen = "127.0.0.1:{ports[name]}"
workers = 1
trusted_proxies = ["127.0.0.1"]
# wrk is one client address: no per-client cap on its connections.
max_upstream_per_client = 1000000
{store}
{extra}
[upstreams.api]
url = "http://127.0.0.1:{up}"
{pol}
[[routes]]
path = "/"
upstream = "api"
{'policy = "p"' if policy else ''}
""")
            return path

        redis_section = redis_store(ports["redis"])
        confs = {
            "sluice": sluice_conf("sluice", "", None),
            "sluice-mem": sluice_conf("sluice-mem", "", POLICY),
            "sluice-redis": sluice_conf("sluice-redis", redis_section, POLICY),
            "sluice-many": sluice_conf("sluice-many", redis_section, POLICY),
            "sluice-reject": sluice_conf("sluice-reject", redis_section, 'limits = [{ limit = 10, window = "1h" }]'),
        }
        env = dict(os.environ, RUST_LOG="warn")
        pids = dict(haproxy_pids)
        for name, conf in confs.items():
            pids[name] = procs.start([sluice, "--config", conf], env=env).pid
        if not args.no_pgo:
            pids["sluice-plain"] = procs.start([plain, "--config", sluice_conf("sluice-plain", "", None)],
                                               env=env).pid
        if null_bin:
            pids["sluice-redis-null"] = procs.start(
                [null_bin, "--config", sluice_conf("sluice-redis-null", redis_section, POLICY)], env=env).pid
        pids["floor"] = procs.start([floor, f"127.0.0.1:{ports['floor']}", f"127.0.0.1:{up}"]).pid
        pids["http-floor"] = procs.start([floor, "--http", f"127.0.0.1:{ports['http-floor']}", f"127.0.0.1:{up}"]).pid
        for p in ports.values():
            if p != ports["redis"]:
                wait_port(p)
        wait_port(ports["redis"])
        # nginx's work is done by its worker process, the master's only child.
        for name in ["nginx", "nginx-limit"]:
            master = next(p for p in procs.procs if p.args[-1].endswith(f"nginx-{ports[name]}.conf"))
            pids[name] = children(master.pid)[0]

        setups = ["nginx", "nginx-limit", "haproxy", "haproxy-limit", "sluice", "sluice-mem", "sluice-redis",
                  "floor", "http-floor"]
        if not args.no_pgo:
            setups.insert(setups.index("sluice") + 1, "sluice-plain")
        if null_bin:
            setups.insert(setups.index("sluice-redis") + 1, "sluice-redis-null")
        results = {(s, c): [] for s in setups for c in conns_list}
        # Warm up every proxy (pools, scripts) at the largest concurrency:
        # a pool that keeps its connections opens none during the runs.
        for s in setups:
            run_wrk(f"http://127.0.0.1:{ports[s]}/", max(conns_list), 1, [pids[s]], None, None)
        for rnd in range(args.rounds):
            # Each round starts one setup later: the lab saw the same build
            # measure up to 15 % apart by its place in a round (what ran
            # just before it), so over the rounds every setup takes every
            # place about as often.
            shift = rnd % len(setups)
            order = setups[shift:] + setups[:shift]
            for c in conns_list:
                for s in order:
                    redis_pid = redis.pid if s.startswith("sluice-redis") else None
                    r = run_wrk(f"http://127.0.0.1:{ports[s]}/", c, args.duration, [pids[s]], redis_pid,
                                ports["redis"] if redis_pid else None, status_port=status)
                    results[(s, c)].append(r)
                    print(f"round {rnd + 1} -c{c} {s:17} {r['rps']:9.0f} req/s  p99 {r['p99']:6.2f} ms  "
                          f"cpu {r['cpu_us']:5.1f} us/req  new upstream conns {r['new_up']}", flush=True)

        # Many identities: a wrk script sends a random X-Forwarded-For (sluice trusts 127.0.0.1).
        extra = {}
        extra["many identities"] = run_wrk(f"http://127.0.0.1:{ports['sluice-many']}/", 50, args.duration,
                                           [pids["sluice-many"]], redis.pid, ports["redis"], script=many_lua(tmp))
        # Mostly rejected: one client over a 10/h limit; warm the deny cache first.
        run_wrk(f"http://127.0.0.1:{ports['sluice-reject']}/", 50, 1, [pids["sluice-reject"]], None, None)
        extra["mostly rejected"] = run_wrk(f"http://127.0.0.1:{ports['sluice-reject']}/", 50, args.duration,
                                           [pids["sluice-reject"]], redis.pid, ports["redis"])

        # Requests as browsers and API clients send them: eight more fields
        # (about 330 bytes), where wrk sends only Host. A proxy's cost grows
        # with each field it reads and passes on, so this shows how the
        # figures above carry over. Runs of the peers and sluice back to
        # back, each time starting one later.
        fields = fields_lua(tmp)
        trio = PEERS + ["sluice"]
        fielded = {s: [] for s in trio}
        for i in range(max(2, args.rounds // 2)):
            for s in trio[i % 3:] + trio[:i % 3]:
                fielded[s].append(run_wrk(f"http://127.0.0.1:{ports[s]}/", 50, args.duration,
                                          [pids[s]], None, None, script=fields))

        def med(rs, key):
            return statistics.median(r[key] for r in rs)

        def paired(rs, ref, key):
            # The median of each round's ratio: a round runs the setups back to
            # back, so a ratio within it is spared most of the neighbours' drift.
            return statistics.median(a[key] / b[key] for a, b in zip(rs, ref))

        # A proxy that keeps its upstream connections opens none once warm,
        # and never more than one per client connection: more in a run is
        # a pool too small or connections closed after a few requests.
        # (The floor has no pool by design: a connection of its own per client.)
        flagged = {(s, c): s != "floor" and max(r["new_up"] for r in results[(s, c)]) > c
                   for s in setups for c in conns_list}
        # The best peer per figure: the most req/s, the lowest p99, the least
        # CPU, among the peers that keep their upstream connections.
        best = {}
        for c in conns_list:
            honest = [p for p in PEERS if not flagged[(p, c)]] or PEERS
            for key, pick in FIGURES.items():
                best[(key, c)] = pick(honest, key=lambda p: med(results[(p, c)], key))

        rows = []
        for c in conns_list:
            for s in setups:
                rs = results[(s, c)]
                row = {"setup": s, "conns": c, **{k: med(rs, k) for k in
                       ["rps", "p50", "p99", "cpu_us", "user_us", "sys_us", "redis_us", "redis_calls", "new_up"]},
                       "flagged": flagged[(s, c)],
                       "best": {key: best[(key, c)] for key in FIGURES},
                       # Against each peer, for the targets' comparisons.
                       "vs": {p: {key: paired(rs, results[(p, c)], key) for key in FIGURES}
                              for p in PEERS + LIMIT_PEERS},
                       # Against sluice without a policy, for the targets.
                       "cpu_vs_none": paired(rs, results[("sluice", c)], "cpu_us")}
                for key, name in [("rps", "rps_x"), ("p99", "p99_x"), ("cpu_us", "cpu_x")]:
                    row[name] = row["vs"][best[(key, c)]][key]
                rows.append(row)
        lines = []
        head = (f"{'setup':17} {'conns':>5} {'req/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'cpu us/req':>10} "
                f"{'redis us/req':>12} {'redis calls':>11} {'req/s x':>8} {'p99 x':>6} {'cpu x':>6} "
                f"{'new upstream':>13}")
        lines.append(head)
        lines.append("-" * len(head))
        for r in rows:
            lines.append(f"{r['setup']:17} {r['conns']:>5} {r['rps']:>9.0f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
                         f"{r['cpu_us']:>10.1f} {r['redis_us']:>12.1f} {r['redis_calls']:>11.2f} "
                         f"{r['rps_x']:>8.2f} {r['p99_x']:>6.2f} {r['cpu_x']:>6.2f} "
                         f"{r['new_up']:>12.0f}{'!' if r['flagged'] else ' '}")
        for name, r in extra.items():
            lines.append(f"{'sluice-redis':17} {'50':>5} {r['rps']:>9.0f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
                         f"{r['cpu_us']:>10.1f} {r['redis_us']:>12.1f} {r['redis_calls']:>11.2f}   ({name}; non-2xx {r['non2xx']})")
        machine = f"{os.cpu_count()} cores; " + subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
        machine += "; " + subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split(" - ")[0]
        machine += "; " + subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split(" sha")[0]
        machine += "; " + subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0].split(" [")[0]
        machine += "; " + cpu_model() + ", Linux " + platform.release()
        lines.append("")
        lines.append(f"medians of {args.rounds} round(s) of {args.duration} s; ratios: the median of each round's "
                     f"ratio to the best peer (nginx or haproxy) for that figure; {machine}")
        for c in conns_list:
            lines.append(f"-c{c} best peer: req/s {best[('rps', c)]}, p99 {best[('p99', c)]}, "
                         f"CPU per request {best[('cpu_us', c)]}")
        lines.append("new upstream: the connections the upstream accepted during the run (median of the rounds)"
                     + ("; ! opens new upstream connections under keep-alive load (more than its client "
                        "connections in a run): misconfigured" if any(flagged.values()) else
                        "; no proxy opened more than its client connections in a run")
                     + " (the floor opens one per client connection by design)")
        lines.append("sluice: " + ("`cargo build --release`" if args.no_pgo else
                                   "the PGO build (bench/pgo.py); sluice-plain: `cargo build --release`, no policy"))
        # How quiet the machine was: a peer's own cost should not move between
        # rounds, so its spread is what the neighbours added. A ratio within
        # that much of its target is not decided by this run.
        for c in conns_list:
            for peer in PEERS:
                cpus = [r["cpu_us"] for r in results[(peer, c)]]
                spread = max(cpus) / min(cpus) - 1
                verdict = ("one round: run several to see the noise" if len(cpus) < 2 else
                           "quiet" if spread <= 0.05 else
                           "noisy: rerun when the machine is quieter before reading a ratio near its target")
                lines.append(f"{peer} -c{c}: {min(cpus):.1f}-{max(cpus):.1f} us CPU per request over the rounds "
                             f"(spread {spread * 100:.0f} %, {verdict})")
        # The kernel's part (the TCP work of four segments a request) is much
        # the same for every proxy; the user part is the proxy's own code.
        for c in conns_list:
            split = ", ".join(f"{s} {row['user_us']:.1f} + {row['sys_us']:.1f}"
                              for s in PEERS + ["sluice", "sluice-mem", "sluice-redis", "sluice-redis-null"]
                              for row in rows if row["setup"] == s and row["conns"] == c)
            peer = best[("cpu_us", c)]
            ux = paired(results[("sluice", c)], results[(peer, c)], "user_us")
            lines.append(f"-c{c} CPU us per request, user + system (medians): {split}; "
                         f"sluice's user CPU {ux:.2f}x {peer}'s")
        # The floor: the CPU a request costs a proxy on sluice's runtime that
        # does no HTTP at all. What sluice spends above it is its own work.
        for c in conns_list:
            fl = next(r for r in rows if r["setup"] == "floor" and r["conns"] == c)
            sl = next(r for r in rows if r["setup"] == "sluice" and r["conns"] == c)
            over = paired(results[("sluice", c)], results[("floor", c)], "cpu_us")
            lines.append(f"-c{c} floor (a TCP relay, no HTTP): {fl['cpu_us']:.1f} us CPU per request "
                         f"({fl['user_us']:.1f} + {fl['sys_us']:.1f}) = {fl['cpu_x']:.2f}x "
                         f"{best[('cpu_us', c)]}'s; "
                         f"sluice without a policy {over:.2f}x the floor, its own work about "
                         f"{sl['cpu_us'] - fl['cpu_us']:.1f} us a request")
        # The HTTP floor: the least an HTTP/1.1 proxy does, on the same
        # runtime. What sluice spends above it is its features.
        for c in conns_list:
            hf = next(r for r in rows if r["setup"] == "http-floor" and r["conns"] == c)
            over = paired(results[("sluice", c)], results[("http-floor", c)], "cpu_us")
            lines.append(f"-c{c} http-floor (bare HTTP/1.1 proxy): {hf['cpu_us']:.1f} us CPU per request "
                         f"({hf['user_us']:.1f} + {hf['sys_us']:.1f}) = {hf['cpu_x']:.2f}x "
                         f"{best[('cpu_us', c)]}'s; "
                         f"sluice without a policy {over:.2f}x it")
        # The quietest round of each setup: on a shared machine the neighbours
        # only ever add CPU time, so each setup's lowest figure is the nearest
        # to its own cost. Not the targets' figure (those are the medians
        # above), but a check on them that a busy minute cannot move much.
        for c in conns_list:
            low = {s: min(r["cpu_us"] for r in results[(s, c)]) for s in setups}
            peer = min(PEERS, key=lambda p: low[p])
            lines.append(f"-c{c} quietest round of each, CPU us per request: "
                         + "".join(f"{p} {low[p]:.1f}, " for p in PEERS)
                         + f"sluice {low['sluice']:.1f} ({low['sluice'] / low[peer]:.2f}x {peer}'s), "
                         f"sluice-mem {low['sluice-mem']:.1f} ({low['sluice-mem'] / low['sluice']:.2f}x no policy), "
                         f"sluice-redis {low['sluice-redis']:.1f} ({low['sluice-redis'] / low['sluice']:.2f}x no policy)"
                         + (f", sluice-redis-null {low['sluice-redis-null']:.1f} "
                            f"({low['sluice-redis-null'] / low['sluice']:.2f}x no policy)"
                            if "sluice-redis-null" in low else ""))
        fpeer = min(PEERS, key=lambda p: med(fielded[p], "cpu_us"))
        fx = paired(fielded["sluice"], fielded[fpeer], "cpu_us")
        lines.append(f"-c50 requests with eight more fields (as browsers and API clients send), the median of "
                     f"{len(fielded['sluice'])} runs each: CPU us per request "
                     + ", ".join(f"{s} {med(fielded[s], 'cpu_us'):.1f}" for s in trio)
                     + f" (sluice {fx:.2f}x {fpeer}'s); req/s "
                     + ", ".join(f"{s} {med(fielded[s], 'rps'):.0f}" for s in trio) + "; p99 "
                     + ", ".join(f"{s} {med(fielded[s], 'p99'):.2f}" for s in trio) + " ms")
        table = "\n".join(lines)
        print("\n" + table)
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "table.txt"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(RESULTS, "results.json"), "w") as f:
            json.dump({"rows": rows, "extra": extra, "fielded": fielded}, f, indent=1)
        svg_plot(rows, os.path.join(RESULTS, "plot.svg"))
        # Redis memory and CPU per identity for the policy, hour window full.
        identities = "10000" if args.quick else "100000"
        print(f"\n--- Redis cost per identity ({identities} identities; takes a few minutes)", flush=True)
        # Stopped with SIGTERM, not killed, if this run is: it has Redis servers to stop.
        cost = procs.start([sys.executable, os.path.join(ROOT, "bench", "redis_cost.py"), identities],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        cost_out = cost.communicate()[0]
        print(cost_out)
        summary = targets(rows, extra, cost_out)
        print(summary)
        with open(os.path.join(RESULTS, "table.txt"), "a") as f:
            f.write("\n" + cost_out + "\n" + summary + "\n")
        print(f"\nwrote bench/results/table.txt, results.json and plot.svg")
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
