#!/usr/bin/env python3
"""sluice against nginx, measured with wrk on this machine.

    python3 bench/bench.py [--rounds N] [--duration S] [--quick] [--no-pgo]

Installs what it needs when missing (wrk, nginx, redis-server: Debian packages,
needs root), builds sluice in release mode and with profile-guided
optimisation (bench/pgo.py, about 8 minutes; `--no-pgo` skips it and measures
the plain build as sluice), then starts:

  upstream      nginx, 1 worker, `return 200`                  (the API)
  nginx         nginx, 1 worker, reverse proxy with a keep-alive pool
  nginx-limit   the same with `limit_req` (local memory, never rejecting)
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
policy) in pairs with requests that carry eight more fields, as browsers and API
clients send (wrk sends only Host). Reported per setup, as the
median over rounds: req/s, p50, p99, proxy CPU µs per request (utime+stime of
the proxy process over the run / requests), Redis CPU µs per request
(redis-server's own CPU), Redis calls per request (INFO commandstats), and each
figure as a ratio to nginx: the median of the ratios within each round (a round
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


def nginx_conf(dir_, port, body):
    conf = os.path.join(dir_, f"nginx-{port}.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1;
daemon off;
pid {dir_}/nginx-{port}.pid;
error_log {dir_}/nginx-{port}.log error;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {body}
}}
""")
    return conf


def upstream_conf(dir_, port, tls=None):
    """nginx as the API: one worker answering `200 ok`; over TLS when `tls`
    is (certificate, key)."""
    ssl = f" ssl; ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]}" if tls else ""
    return nginx_conf(dir_, port, f'server {{ listen 127.0.0.1:{port}{ssl}; location / {{ return 200 "ok"; }} }}')


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


def run_wrk(url, conns, duration, proxy_pids, redis_pid, redis_port, script=None):
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
    out = subprocess.run(args + [url], capture_output=True, text=True, check=True).stdout
    r = parse_wrk(out)
    n = max(r["requests"], 1)
    user_after, sys_after = proxies_cpu()
    r["user_us"] = (user_after - user_before) * 1e6 / n
    r["sys_us"] = (sys_after - sys_before) * 1e6 / n
    r["cpu_us"] = r["user_us"] + r["sys_us"]
    r["redis_us"] = ((cpu_seconds(redis_pid) - rbefore) * 1e6 / n) if redis_pid else 0.0
    r["redis_calls"] = ((evalsha_calls(redis_port) - calls_before) / n) if redis_port else 0.0
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
        out.append(f'<text x="{x}" y="{base + 16}" text-anchor="middle">{r["setup"]}</text>')
    out.append(f'<line x1="{pad}" y1="{base}" x2="{w - pad}" y2="{base}" stroke="black"/>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def targets(rows, extra, cost):
    """The performance targets, each with its figure from this run: met or not."""
    row = {(r["setup"], r["conns"]): r for r in rows}
    out = ["targets (ratios are medians of each round's ratio):"]

    def check(ok, text):
        out.append(f"  [{'met' if ok else 'NOT met'}] {text}")

    for c in sorted({r["conns"] for r in rows}):
        s, mem, red = row[("sluice", c)], row[("sluice-mem", c)], row[("sluice-redis", c)]
        check(s["cpu_x"] <= 0.85, f"-c{c} no policy: CPU per request {s['cpu_x']:.2f}x nginx's (<= 0.85)")
        check(s["rps_x"] >= 1.0, f"-c{c} no policy: req/s {s['rps_x']:.2f}x nginx's (>= 1)")
        check(s["p99_x"] <= 1.0, f"-c{c} no policy: p99 {s['p99_x']:.2f}x nginx's (<= 1)")
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
    try:
        null_bin = null_build(sluice, tmp)
        if not null_bin:
            print("--- sluice-redis-null skipped: lua/acquire.lua's text is not in the binary once", flush=True)
        ports = {k: free_port() for k in ["upstream", "nginx", "nginx-limit", "sluice", "sluice-mem",
                                           "sluice-redis", "redis", "sluice-many", "sluice-reject", "floor",
                                           "http-floor"] + ([] if args.no_pgo else ["sluice-plain"])
                 + (["sluice-redis-null"] if null_bin else [])}
        up = ports["upstream"]
        procs.start(["nginx", "-c", upstream_conf(tmp, up)])
        proxy_block = f"upstream api {{ server 127.0.0.1:{up}; keepalive 64; }}"
        loc = 'proxy_pass http://api; proxy_http_version 1.1; proxy_set_header Connection "";'
        procs.start(["nginx", "-c", nginx_conf(tmp, ports["nginx"],
                     f'{proxy_block} server {{ listen 127.0.0.1:{ports["nginx"]}; location / {{ {loc} }} }}')])
        procs.start(["nginx", "-c", nginx_conf(tmp, ports["nginx-limit"],
                     f'{proxy_block} limit_req_zone $binary_remote_addr zone=z:10m rate=100000000r/s; '
                     f'server {{ listen 127.0.0.1:{ports["nginx-limit"]}; location / {{ limit_req zone=z burst=100000000 nodelay; {loc} }} }}')])
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
        pids = {}
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

        setups = ["nginx", "nginx-limit", "sluice", "sluice-mem", "sluice-redis", "floor", "http-floor"]
        if not args.no_pgo:
            setups.insert(3, "sluice-plain")
        if null_bin:
            setups.insert(setups.index("sluice-redis") + 1, "sluice-redis-null")
        results = {(s, c): [] for s in setups for c in conns_list}
        # Warm up every proxy (pools, scripts).
        for s in setups:
            run_wrk(f"http://127.0.0.1:{ports[s]}/", 50, 1, [pids[s]], None, None)
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
                                ports["redis"] if redis_pid else None)
                    results[(s, c)].append(r)
                    print(f"round {rnd + 1} -c{c} {s:17} {r['rps']:9.0f} req/s  p99 {r['p99']:6.2f} ms  "
                          f"cpu {r['cpu_us']:5.1f} us/req", flush=True)

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
        # figures above carry over. Runs of nginx and sluice in pairs, each
        # pair in the other order.
        fields = fields_lua(tmp)
        fielded = {"nginx": [], "sluice": []}
        for i in range(max(2, args.rounds // 2)):
            for s in (["nginx", "sluice"] if i % 2 == 0 else ["sluice", "nginx"]):
                fielded[s].append(run_wrk(f"http://127.0.0.1:{ports[s]}/", 50, args.duration,
                                          [pids[s]], None, None, script=fields))

        def med(rs, key):
            return statistics.median(r[key] for r in rs)

        def paired(rs, ref, key):
            # The median of each round's ratio: a round runs the setups back to
            # back, so a ratio within it is spared most of the neighbours' drift.
            return statistics.median(a[key] / b[key] for a, b in zip(rs, ref))

        rows = []
        for c in conns_list:
            ref = results[("nginx", c)]
            for s in setups:
                rs = results[(s, c)]
                rows.append({"setup": s, "conns": c, **{k: med(rs, k) for k in
                             ["rps", "p50", "p99", "cpu_us", "user_us", "sys_us", "redis_us", "redis_calls"]},
                             "rps_x": paired(rs, ref, "rps"),
                             "p99_x": paired(rs, ref, "p99"),
                             "cpu_x": paired(rs, ref, "cpu_us"),
                             # Against sluice without a policy, for the targets.
                             "cpu_vs_none": paired(rs, results[("sluice", c)], "cpu_us")})
        lines = []
        head = (f"{'setup':17} {'conns':>5} {'req/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'cpu us/req':>10} "
                f"{'redis us/req':>12} {'redis calls':>11} {'req/s x':>8} {'p99 x':>6} {'cpu x':>6}")
        lines.append(head)
        lines.append("-" * len(head))
        for r in rows:
            lines.append(f"{r['setup']:17} {r['conns']:>5} {r['rps']:>9.0f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
                         f"{r['cpu_us']:>10.1f} {r['redis_us']:>12.1f} {r['redis_calls']:>11.2f} "
                         f"{r['rps_x']:>8.2f} {r['p99_x']:>6.2f} {r['cpu_x']:>6.2f}")
        for name, r in extra.items():
            lines.append(f"{'sluice-redis':17} {'50':>5} {r['rps']:>9.0f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
                         f"{r['cpu_us']:>10.1f} {r['redis_us']:>12.1f} {r['redis_calls']:>11.2f}   ({name}; non-2xx {r['non2xx']})")
        machine = f"{os.cpu_count()} cores; " + subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
        machine += "; " + subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split(" sha")[0]
        machine += "; " + subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0].split(" [")[0]
        machine += "; " + cpu_model() + ", Linux " + platform.release()
        lines.append("")
        lines.append(f"medians of {args.rounds} round(s) of {args.duration} s; ratios: the median of each round's ratio to nginx; {machine}")
        lines.append("sluice: " + ("`cargo build --release`" if args.no_pgo else
                                   "the PGO build (bench/pgo.py); sluice-plain: `cargo build --release`, no policy"))
        # How quiet the machine was: nginx's own cost should not move between
        # rounds, so its spread is what the neighbours added. A ratio within
        # that much of its target is not decided by this run.
        for c in conns_list:
            cpus = [r["cpu_us"] for r in results[("nginx", c)]]
            spread = max(cpus) / min(cpus) - 1
            verdict = ("one round: run several to see the noise" if len(cpus) < 2 else
                       "quiet" if spread <= 0.05 else
                       "noisy: rerun when the machine is quieter before reading a ratio near its target")
            lines.append(f"nginx -c{c}: {min(cpus):.1f}-{max(cpus):.1f} us CPU per request over the rounds "
                         f"(spread {spread * 100:.0f} %, {verdict})")
        # The kernel's part (the TCP work of four segments a request) is much
        # the same for every proxy; the user part is the proxy's own code.
        for c in conns_list:
            split = ", ".join(f"{s} {row['user_us']:.1f} + {row['sys_us']:.1f}"
                              for s in ["nginx", "sluice", "sluice-mem", "sluice-redis", "sluice-redis-null"]
                              for row in rows if row["setup"] == s and row["conns"] == c)
            ux = paired(results[("sluice", c)], results[("nginx", c)], "user_us")
            lines.append(f"-c{c} CPU us per request, user + system (medians): {split}; "
                         f"sluice's user CPU {ux:.2f}x nginx's")
        # The floor: the CPU a request costs a proxy on sluice's runtime that
        # does no HTTP at all. What sluice spends above it is its own work.
        for c in conns_list:
            fl = next(r for r in rows if r["setup"] == "floor" and r["conns"] == c)
            sl = next(r for r in rows if r["setup"] == "sluice" and r["conns"] == c)
            over = paired(results[("sluice", c)], results[("floor", c)], "cpu_us")
            lines.append(f"-c{c} floor (a TCP relay, no HTTP): {fl['cpu_us']:.1f} us CPU per request "
                         f"({fl['user_us']:.1f} + {fl['sys_us']:.1f}) = {fl['cpu_x']:.2f}x nginx's; "
                         f"sluice without a policy {over:.2f}x the floor, its own work about "
                         f"{sl['cpu_us'] - fl['cpu_us']:.1f} us a request")
        # The HTTP floor: the least an HTTP/1.1 proxy does, on the same
        # runtime. What sluice spends above it is its features.
        for c in conns_list:
            hf = next(r for r in rows if r["setup"] == "http-floor" and r["conns"] == c)
            over = paired(results[("sluice", c)], results[("http-floor", c)], "cpu_us")
            lines.append(f"-c{c} http-floor (bare HTTP/1.1 proxy): {hf['cpu_us']:.1f} us CPU per request "
                         f"({hf['user_us']:.1f} + {hf['sys_us']:.1f}) = {hf['cpu_x']:.2f}x nginx's; "
                         f"sluice without a policy {over:.2f}x it")
        # The quietest round of each setup: on a shared machine the neighbours
        # only ever add CPU time, so each setup's lowest figure is the nearest
        # to its own cost. Not the targets' figure (those are the medians
        # above), but a check on them that a busy minute cannot move much.
        for c in conns_list:
            low = {s: min(r["cpu_us"] for r in results[(s, c)]) for s in setups}
            lines.append(f"-c{c} quietest round of each, CPU us per request: nginx {low['nginx']:.1f}, "
                         f"sluice {low['sluice']:.1f} ({low['sluice'] / low['nginx']:.2f}x nginx's), "
                         f"sluice-mem {low['sluice-mem']:.1f} ({low['sluice-mem'] / low['sluice']:.2f}x no policy), "
                         f"sluice-redis {low['sluice-redis']:.1f} ({low['sluice-redis'] / low['sluice']:.2f}x no policy)"
                         + (f", sluice-redis-null {low['sluice-redis-null']:.1f} "
                            f"({low['sluice-redis-null'] / low['sluice']:.2f}x no policy)"
                            if "sluice-redis-null" in low else ""))
        fx = paired(fielded["sluice"], fielded["nginx"], "cpu_us")
        lines.append(f"-c50 requests with eight more fields (as browsers and API clients send): "
                     f"CPU us per request nginx {med(fielded['nginx'], 'cpu_us'):.1f}, "
                     f"sluice {med(fielded['sluice'], 'cpu_us'):.1f} ({fx:.2f}x nginx's, the median of "
                     f"{len(fielded['nginx'])} pairs); req/s {med(fielded['nginx'], 'rps'):.0f} and "
                     f"{med(fielded['sluice'], 'rps'):.0f}, p99 {med(fielded['nginx'], 'p99'):.2f} and "
                     f"{med(fielded['sluice'], 'p99'):.2f} ms")
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
