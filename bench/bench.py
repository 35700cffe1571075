#!/usr/bin/env python3
"""sluice against nginx and haproxy, measured on this machine the way users
run them: HTTP/1.1 with wrk, HTTP/2 with h2load, in cleartext and over TLS.

    python3 bench/bench.py [--rounds N] [--duration S] [--quick] [--no-pgo] [--idle N]

Installs what it needs when missing (wrk, h2load, nginx, haproxy,
redis-server, openssl: Debian packages, needs root), builds sluice in release
mode and with profile-guided optimisation (bench/pgo.py, about 8 minutes;
`--no-pgo` skips it and measures the plain build as sluice), makes a
throwaway certificate for 127.0.0.1, then starts:

  upstream      nginx, 1 worker, `return 200` over HTTP/1.1 keep-alive (the
                API; its stub_status, on a port of its own, counts the
                connections each setup opens to it; a third port adds
                `X-Tokens-Used: 3` to its answers, for sluice-metered)
  nginx         nginx, 1 worker, reverse proxy as its operators configure
                it: an upstream keep-alive pool of 1024 (at least the
                client concurrency), keepalive_requests 1000000 on both
                sides, multi_accept, reuseport, `deferred` (a connection
                handed over once its client has sent, as sluice's
                listener is); with an h2c listener and a
                TLS listener (HTTP/2 by ALPN) beside its HTTP/1.1 one, as
                its manual says (`listen ... http2` before 1.25.1,
                `http2 on` after)
  nginx-limit   the same with `limit_req` (local memory, never rejecting)
  haproxy       haproxy, 1 process, 1 thread, `http-reuse always`,
                `defer-accept` on every bind; with an h2c bind (`proto h2`)
                and a TLS bind (`alpn h2,http/1.1`)
  haproxy-limit the same with a stick-table counting each client address's
                request rate and a deny rule it never reaches
  sluice        sluice, 1 worker, no policy (the PGO build, as every sluice
                below but sluice-plain); it serves h2c on the same port;
                over TLS, a second sluice with `[server.tls]`
  sluice-plain  the same, built by `cargo build --release` alone
  sluice-mem    sluice, memory store, policy 10/1s + 120/1m + 240/1h (1m precision)
  sluice-redis  sluice, Redis store, the same policy
  sluice-redis-null
                the same binary and policy, with bench/redis_null.lua in
                place of lua/acquire.lua (a copy, patched): Redis answers at
                once, so this is the proxy's own part of a Redis policy,
                whatever Redis costs on the machine (not a target)
  sluice-metered
                sluice, Redis store, the same policy with
                `meter = "header:X-Tokens-Used"` (the upstream answers 3)
  sluice-concurrency
                sluice, Redis store, `{ limit = 100000, algorithm = "concurrency" }`
                (either is skipped, with a line saying so, when sluice
                refuses its config: a build without metering or leases)
  envoy-redis   not a proxy: what Envoy's rate limit service sends Redis for
                the same policy (per limit INCRBY + EXPIRE, one pipeline per
                decision, not atomic; bench/clients.py), at the same
                redis-server, on 10 connections, at the rate sluice-redis
                reached just before it: the baseline for Redis's CPU per
                decision
  floor         a TCP relay with no HTTP (bench/floor.rs): tokio, 1 worker,
                mimalloc, like sluice; what any proxy built so pays before its
                own work (not a target: a scale for the others)
  http-floor    the same program with --http: the least an HTTP/1.1 reverse
                proxy does (parse both heads, drop hop-by-hop fields, add
                X-Forwarded-For, a shared keep-alive pool); sluice's features
                are what it spends above this (also not a target)

(limits high enough never to reject) and runs each load against its setups,
interleaved, for several rounds:

  http/1.1 -c50      wrk -t1 -c50, every setup
  http/1.1 -c200     wrk -t1 -c200, every setup but sluice-metered,
                     sluice-concurrency and envoy-redis
  http/1.1 -c1000    wrk -t1 -c1000: nginx, haproxy, sluice, sluice-redis
  h2c -c50 -m10      h2load -c50 -m10 (prior knowledge): nginx, haproxy, sluice
  h2 tls -c50 -m10   h2load -c50 -m10 over TLS (ALPN h2): the same three
  http/1.1 tls -c50  wrk -t1 -c50 over TLS: the same three

h2load and wrk each run one thread: their own CPU is reported (`client %`,
100 = a whole core); a load generator that used a whole core measured
itself as much as the proxy, and the table says so.

Then two runs of sluice with Redis: many distinct client identities (random
X-Forwarded-For from a trusted peer), and most requests rejected (deny cache
warm); nginx, haproxy and sluice (no policy) with requests that carry eight
more fields, as browsers and API clients send (wrk sends only Host), with
`POST`s of a small JSON body, and driven by ApacheBench (HTTP/1.0: `ab -k
-c50`, and `ab -c50`, a new connection per request); and the
memory per idle keep-alive connection: fresh nginx, haproxy and sluice
processes each take 10,000 client connections (`--idle`) that make one
request and stay open, idle; the growth of the proxy process's resident
memory, divided by the connections.

Reported per setup and load, as the median over rounds: req/s, p50, p99,
proxy CPU µs per request (utime+stime of the proxy process over the run /
requests), Redis CPU µs per request (redis-server's own CPU), Redis calls
per request (INFO commandstats: script calls, EVALSHA and the like, a batch
of decisions in one call counting one; for envoy-redis its commands), the
new connections the upstream accepted during the run (a setup that opens
more than its requests in flight in a run is flagged `!`: under keep-alive
load a well configured proxy opens none), the load generator's CPU, and each
figure as a ratio to the best peer for that figure (nginx or haproxy,
whichever has the most req/s, the lowest p99, the least CPU; a flagged peer
is not a reference): the median of the ratios within each round (a round
runs the setups back to back, so its ratios are spared most of the drift a
busy machine adds between rounds; each round starts one setup later than the
one before, so no setup always runs first or after the same one), and the
proxies' CPU split into user and system. Also each setup's quietest round
(its lowest CPU per request): a neighbour on a shared machine only adds
time, so that figure moves least between runs.

Writes bench/results/table.txt (everything printed), table.md (the summary
docs/performance.md carries), results.json and plot.svg, and ends with the
targets, met or not. Everything it started is stopped at the end.
"""
import argparse
import json
import os
import platform
import re
import resource
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
CLIENTS = os.path.join(ROOT, "bench", "clients.py")
# The setups whose runs also read Redis's CPU and calls.
REDIS_SETUPS = {"sluice-redis", "sluice-redis-null", "sluice-metered", "sluice-concurrency", "sluice-many",
                "sluice-reject", "envoy-redis"}
# The setups of issue 42's features: skipped when sluice refuses their config.
METERED = 'meter = "header:X-Tokens-Used"\n' + POLICY
CONCURRENCY = 'limits = [{ limit = 100000, algorithm = "concurrency" }]'
# The Envoy-style baseline's connections: the service's pool (REDIS_POOL_SIZE's
# default), one decision in flight on each.
ENVOY_CONNS = 10
# The calls that make a decision (or a batch of them): script calls. Redis
# counts the commands a script runs as calls of their own too.
SCRIPT_CALLS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")
# A load generator's CPU (per cent of one core) from which it is taken to
# have been the bottleneck.
SATURATED = 95


class Load:
    """How setups are driven: `tool` (wrk or h2load, one thread) with `conns`
    client connections, over `via`: "http" (HTTP/1.1), "h2c" (HTTP/2 with
    prior knowledge) or "tls" (HTTP/2 by ALPN for h2load, HTTP/1.1 for wrk)."""

    def __init__(self, label, tool, conns, via):
        self.label, self.tool, self.conns, self.via = label, tool, conns, via
        # Requests in flight at once: h2load sends 10 on each connection.
        self.inflight = conns * (10 if tool == "h2load" else 1)

    def url(self, port, path="/"):
        return f"{'https' if self.via == 'tls' else 'http'}://127.0.0.1:{port}{path}"


LOADS = [Load("http/1.1 -c50", "wrk", 50, "http"), Load("http/1.1 -c200", "wrk", 200, "http"),
         Load("http/1.1 -c1000", "wrk", 1000, "http"), Load("h2c -c50 -m10", "h2load", 50, "h2c"),
         Load("h2 tls -c50 -m10", "h2load", 50, "tls"), Load("http/1.1 tls -c50", "wrk", 50, "tls")]
C50 = LOADS[0]


def raise_nofile():
    """wrk -c1000, the proxies and the idle connections' client each need a
    descriptor per connection: the soft limit up to the hard one (children
    inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def nginx_version():
    out = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr
    m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else (0, 0, 0)


def nginx_conf(dir_, name, body, connections=8192):
    """One nginx worker as its operators tune it for keep-alive load: every
    connection ready is accepted at once (`multi_accept`), a client
    connection serves up to a million requests (the default, 1000, closes
    wrk's connections every second or so) and may idle for five minutes.
    Its open-files limit is the one it inherits (see raise_nofile). Its
    files are named by `name` (its port, or what it is for)."""
    conf = os.path.join(dir_, f"nginx-{name}.conf")
    with open(conf, "w") as f:
        f.write(f"""worker_processes 1;
daemon off;
pid {dir_}/nginx-{name}.pid;
error_log {dir_}/nginx-{name}.log error;
events {{ worker_connections {connections}; multi_accept on; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 300s;
  {body}
}}
""")
    return conf


def upstream_conf(dir_, port, tls=None, status_port=None, metered_port=None):
    """nginx as the API: one worker answering `200 ok`; over TLS when `tls`
    is (certificate, key). With `status_port`, its stub_status answers there
    (its `accepts` counts the connections the proxies open to it); with
    `metered_port`, the same answer there carries `X-Tokens-Used: 3` (what
    the request cost, for sluice-metered)."""
    ssl = f" ssl; ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]}" if tls else ""
    status = (f" server {{ listen 127.0.0.1:{status_port}; location / {{ stub_status; }} }}"
              if status_port else "")
    metered = (f" server {{ listen 127.0.0.1:{metered_port} reuseport; "
               f'location / {{ add_header X-Tokens-Used 3; return 200 "ok"; }} }}' if metered_port else "")
    # Room for every proxy's pool at once (the API is not measured).
    return nginx_conf(dir_, port, f'server {{ listen 127.0.0.1:{port} reuseport{ssl}; '
                                  f'location / {{ return 200 "ok"; }} }}{status}{metered}', connections=16384)


def proxy_nginx_conf(dir_, port, up, limit=False, h2c=None, tls=None, connections=8192):
    """nginx as a reverse proxy to `up`, configured as its operators do: an
    upstream keep-alive pool at least the client concurrency, a million
    requests per upstream connection, HTTP/1.1 to the upstream with the
    client's `Connection` field cleared (else the upstream connection is not
    kept). With `limit`, `limit_req` by client address, never rejecting at
    the bench's rates. With `h2c` (a port), a listener there speaks HTTP/2
    with prior knowledge; with `tls` (port, certificate, key), one there
    terminates TLS and offers HTTP/2 by ALPN: `listen ... http2` before
    nginx 1.25.1, `http2 on` since (its manual)."""
    zone = "limit_req_zone $binary_remote_addr zone=z:10m rate=100000000r/s; " if limit else ""
    limit_req = "limit_req zone=z burst=100000000 nodelay; " if limit else ""
    location = (f'location / {{ {limit_req}proxy_pass http://api; proxy_http_version 1.1; '
                f'proxy_set_header Connection ""; }}')
    new_h2 = nginx_version() >= (1, 25, 1)
    listen_h2, h2_on = ("", "http2 on; ") if new_h2 else (" http2", "")
    # `deferred`: a connection is handed over once its client has sent, as
    # sluice's listener does.
    servers = f"server {{ listen 127.0.0.1:{port} reuseport deferred; {location} }}"
    if h2c:
        servers += f" server {{ listen 127.0.0.1:{h2c} reuseport deferred{listen_h2}; {h2_on}{location} }}"
    if tls:
        tls_port, cert, key = tls
        servers += (f" server {{ listen 127.0.0.1:{tls_port} reuseport deferred ssl{listen_h2}; {h2_on}"
                    f"ssl_certificate {cert}; ssl_certificate_key {key}; {location} }}")
    return nginx_conf(dir_, port,
                      f"upstream api {{ server 127.0.0.1:{up}; keepalive {MAX_CONNS}; "
                      f"keepalive_requests 1000000; keepalive_timeout 300s; }} {zone}{servers}",
                      connections)


def haproxy_conf(dir_, port, up, limit=False, h2c=None, tls=None, maxconn=8000):
    """haproxy as a reverse proxy to `up`, as its operators configure it for
    keep-alive load: one process with one thread, HTTP mode, keep-alive on
    both sides, idle server connections shared by every client
    (`http-reuse always`) and kept while idle (`pool-purge-delay`). With
    `limit`, a stick-table tracks each client address's request rate and a
    rule denies above a rate the bench never reaches. With `h2c` (a port), a
    bind there speaks HTTP/2 with prior knowledge (`proto h2`); with `tls`
    (port, PEM of certificate and key), one there terminates TLS with
    `alpn h2,http/1.1` (its manual); the same backend behind each."""
    conf = os.path.join(dir_, f"haproxy-{port}.cfg")
    limit_rules = ("  stick-table type ip size 100k expire 60s store http_req_rate(1s)\n"
                   "  http-request track-sc0 src\n"
                   "  http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }\n"
                   if limit else "")
    more = ""
    if h2c:
        more += f"\nfrontend fe_h2c\n  bind 127.0.0.1:{h2c} proto h2 defer-accept\n  default_backend api\n"
    if tls:
        more += (f"\nfrontend fe_tls\n  bind 127.0.0.1:{tls[0]} ssl crt {tls[1]} alpn h2,http/1.1 defer-accept\n"
                 "  default_backend api\n")
    with open(conf, "w") as f:
        f.write(f"""global
  nbthread 1
  maxconn {maxconn}

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
  bind 127.0.0.1:{port} defer-accept
{limit_rules}  default_backend api
{more}
backend api
  server up 127.0.0.1:{up} pool-purge-delay 300s
""")
    return conf


def certificates(dir_):
    """A throwaway CA and a certificate it signed for 127.0.0.1 (rustls
    refuses a self-signed CA certificate as a server's); returns (ca, cert, key)."""
    ca, ca_key = os.path.join(dir_, "ca.pem"), os.path.join(dir_, "ca-key.pem")
    cert, key, csr = (os.path.join(dir_, n) for n in ("cert.pem", "key.pem", "cert.csr"))
    ext = os.path.join(dir_, "cert.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName = IP:127.0.0.1\nbasicConstraints = CA:FALSE\n")
    p256 = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for args in (["req", "-x509", *p256, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=sluice-bench-ca"],
                 ["req", *p256, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                  "-days", "2", "-extfile", ext]):
        subprocess.run(["openssl", *args], capture_output=True, check=True)
    return ca, cert, key


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


def post_lua(dir_):
    """A wrk script: every request is a `POST` with a small JSON body, as an
    API client sends."""
    script = os.path.join(dir_, "post.lua")
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\n'
                'wrk.headers["Content-Type"] = "application/json"\n'
                'wrk.body = \'{"user":"alice","items":[1,2,3],"note":"a small JSON body of a hundred bytes"}\'\n')
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


def redis_commands(port, names=SCRIPT_CALLS):
    """The calls of the commands `names` Redis has run so far (INFO
    commandstats)."""
    return sum(int(calls) for name, calls in re.findall(r"cmdstat_([^:]+):calls=(\d+)",
                                                         redis_info(port, "commandstats"))
               if name in names)


def ms(text):
    v, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()
    return float(v) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def parse_wrk(out):
    reqs = re.search(r"(\d+) requests in ([\d.]+\w+),", out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"requests": int(reqs.group(1)), "seconds": ms(reqs.group(2)) / 1000, "rps": rps, "p50": p50,
            "p99": p99, "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "errors": errors.group(1) if errors else ""}


def parse_h2load(out, log):
    """h2load's figures: req/s from its summary; p50 and p99 from its log of
    every request (its summary has no percentiles); `requests` is every
    answer it received (the proxy's work: they may outnumber `done`, which
    counts those within the timed window only)."""
    fin = re.search(r"finished in ([\d.]+\w+), ([\d.]+) req/s", out)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, \d+ succeeded, (\d+) failed, "
                     r"(\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if not fin or not done or not codes or int(done.group(1)) == 0:
        raise RuntimeError(f"h2load finished no request:\n{out}")
    with open(log) as f:
        times = sorted(int(line.split("\t")[2]) for line in f if line.count("\t") == 2)
    os.remove(log)
    if not times:
        raise RuntimeError(f"h2load's log holds no request:\n{out}")
    answers = [int(n) for n in codes.groups()]
    failed = int(done.group(2)) + int(done.group(3)) + int(done.group(4))
    return {"requests": sum(answers), "seconds": ms(fin.group(1)) / 1000, "rps": float(fin.group(2)),
            "p50": times[(len(times) - 1) // 2] / 1000, "p99": times[int((len(times) - 1) * 0.99)] / 1000,
            "non2xx": sum(answers[1:]), "errors": f"{failed} failed, errored or timed out" if failed else ""}


def parse_envoy(out):
    r = json.loads(out)
    return {"requests": r["decisions"], "seconds": r["seconds"], "rps": r["decisions"] / r["seconds"],
            "p50": None, "p99": None, "non2xx": 0, "errors": ""}


def measure(cmd, parse, proxy_pids, redis_pid=None, redis_port=None, status_port=None, calls=SCRIPT_CALLS):
    """Runs the load generator `cmd` and reads its output with `parse` (which
    gives at least `requests` and `seconds`). Adds the proxies' CPU per
    request (user, system), Redis's CPU and calls per request (of the
    commands `calls`), the load generator's own CPU (per cent of one core:
    `client_pct`) and, with `status_port` (the upstream's stub_status), the
    new connections the upstream accepted during it (`new_up`)."""
    def proxies_cpu():
        splits = [cpu_split(p) for p in proxy_pids]
        return sum(u for u, _ in splits), sum(s for _, s in splits)

    def client_cpu():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    user_before, sys_before = proxies_cpu()
    rbefore = cpu_seconds(redis_pid) if redis_pid else 0
    calls_before = redis_commands(redis_port, calls) if redis_port else 0
    accepts_before = stub_accepts(status_port) if status_port else 0
    client_before = client_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True)
    client = client_cpu() - client_before
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout}{done.stderr}")
    r = parse(done.stdout)
    n = max(r["requests"], 1)
    user_after, sys_after = proxies_cpu()
    r["user_us"] = (user_after - user_before) * 1e6 / n
    r["sys_us"] = (sys_after - sys_before) * 1e6 / n
    r["cpu_us"] = r["user_us"] + r["sys_us"]
    r["redis_us"] = ((cpu_seconds(redis_pid) - rbefore) * 1e6 / n) if redis_pid else 0.0
    r["redis_calls"] = ((redis_commands(redis_port, calls) - calls_before) / n) if redis_port else 0.0
    r["client_pct"] = 100 * client / max(r["seconds"], 1e-9)
    # Less the reading's own connection to the status port.
    r["new_up"] = (stub_accepts(status_port) - accepts_before - 1) if status_port else 0
    return r


def run_wrk(url, conns, duration, proxy_pids, redis_pid, redis_port, script=None, status_port=None):
    """One wrk run (one thread, `conns` connections), measured."""
    args = ["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--latency"] + (["-s", script] if script else [])
    return measure(args + [url], parse_wrk, proxy_pids, redis_pid, redis_port, status_port)


def parse_ab(out):
    """ApacheBench's figures (its percentiles are whole milliseconds)."""
    done = re.search(r"Complete requests:\s+(\d+)", out)
    taken = re.search(r"Time taken for tests:\s+([\d.]+) seconds", out)
    rps = re.search(r"Requests per second:\s+([\d.]+)", out)
    if not done or not taken or not rps or int(done.group(1)) == 0:
        raise RuntimeError(f"ab finished no request:\n{out}")
    failed = re.search(r"Failed requests:\s+(\d+)", out)
    non2xx = re.search(r"Non-2xx responses:\s+(\d+)", out)
    p50 = re.search(r"^\s+50%\s+(\d+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\d+)", out, re.M)
    return {"requests": int(done.group(1)), "seconds": float(taken.group(1)), "rps": float(rps.group(1)),
            "p50": float(p50.group(1)) if p50 else None, "p99": float(p99.group(1)) if p99 else None,
            "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "errors": f"{failed.group(1)} failed" if failed and int(failed.group(1)) else ""}


def run_ab(url, conns, duration, proxy_pids, keepalive):
    """One ApacheBench run (HTTP/1.0, `conns` requests at once, for `duration`
    seconds), with keep-alive (`-k`) or a new connection per request (ab's
    default), measured."""
    # ab keeps a record per request, sized by -n up front: room for 250k a
    # second, more than any proxy here serves.
    args = ["ab", "-q", "-c", str(conns), "-t", str(duration), "-n", str(250_000 * duration)]
    return measure(args + (["-k"] if keepalive else []) + [url], parse_ab, proxy_pids)


def run_h2load(url, conns, duration, proxy_pids, status_port, log):
    """One h2load run (one thread, `conns` connections of 10 streams each,
    h2c with prior knowledge for http://, ALPN h2 for https://), measured."""
    args = ["h2load", "-t1", f"-c{conns}", "-m10", "-D", str(duration), f"--log-file={log}", url]
    return measure(args, lambda out: parse_h2load(out, log), proxy_pids, status_port=status_port)


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def idle_growth(port, pid, conns):
    """The resident memory the proxy on `port` (process `pid`, started
    fresh) grows by while `conns` client connections that each made one
    request stay open, idle (bench/clients.py): (KB before, KB after, KB per
    connection). Read a second after the last answer: what an idle
    connection keeps, not what its request held."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
        r.read()
    before = rss_kb(pid)
    client = subprocess.Popen([sys.executable, CLIENTS, "idle", str(port), str(conns)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = client.stdout.readline()
        if line.split() != ["ready", str(conns)]:
            raise RuntimeError(f"the idle connections' client did not get its {conns} answers from port {port}")
        time.sleep(1)
        after = rss_kb(pid)
    finally:
        client.stdin.close()
        client.wait(timeout=120)
    return before, after, (after - before) / conns


def med(rs, key):
    values = [r[key] for r in rs]
    return None if None in values else statistics.median(values)


def paired(rs, ref, key):
    """The median of each round's ratio: a round runs the setups back to
    back, so a ratio within it is spared most of the neighbours' drift."""
    return statistics.median(a[key] / b[key] for a, b in zip(rs, ref))


def fmt(value, spec, width):
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def svg_plot(rows, path):
    """A bar chart of req/s and p99 per setup, HTTP/1.1 -c50 (no plotting library needed)."""
    rows = [r for r in rows if r["load"] == C50.label and r["p99"] is not None]
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


def targets(rows, extra, idle, cost):
    """The performance targets, each with its figure from this run: met or
    not. Returns (lines, [(met, text)]) for the table and the summary; a
    `met` of None is a heading."""
    row = {(r["setup"], r["load"]): r for r in rows}
    loads = list(dict.fromkeys(r["load"] for r in rows))
    out = ["targets (ratios are medians of each round's ratio; against a peer: the best peer for that figure):"]
    verdicts = []

    def check(ok, text):
        out.append(f"  [{'met' if ok else 'NOT met'}] {text}")
        verdicts.append((ok, text))

    def against(r, peers):
        return "; ".join(f"against {p}{' (misconfigured)' if row[(p, r['load'])]['flagged'] else ''}: "
                         f"req/s {r['vs'][p]['rps']:.2f}x, p99 {r['vs'][p]['p99']:.2f}x, "
                         f"CPU {r['vs'][p]['cpu_us']:.2f}x" for p in peers if p in r["vs"])

    for load in loads:
        s = row[("sluice", load)]
        b = s["best"]
        check(s["cpu_x"] <= 0.85, f"{load} no policy: CPU per request {s['cpu_x']:.2f}x {b['cpu_us']}'s (<= 0.85)")
        check(s["rps_x"] >= 1.0, f"{load} no policy: req/s {s['rps_x']:.2f}x {b['rps']}'s (>= 1)")
        check(s["p99_x"] <= 1.0, f"{load} no policy: p99 {s['p99_x']:.2f}x {b['p99']}'s (<= 1)")
        out.append(f"    (no policy {against(s, PEERS)})")
    if idle and "nginx" in idle and "sluice" in idle:
        x = idle["sluice"]["kb"] / idle["nginx"]["kb"] if idle["nginx"]["kb"] > 0 else float("inf")
        check(idle["sluice"]["kb"] <= idle["nginx"]["kb"],
              f"memory per idle connection: sluice {idle['sluice']['kb']:.2f} KB = {x:.2f}x nginx's "
              f"({idle['nginx']['kb']:.2f} KB) (<= 1)")
    red, env = row.get(("sluice-redis", C50.label)), row.get(("envoy-redis", C50.label))
    if red and env:
        check(red["redis_vs_envoy"] <= 1.0,
              f"{C50.label} Redis CPU per decision: {red['redis_us']:.1f} us = {red['redis_vs_envoy']:.2f}x the "
              f"Envoy-style baseline's ({env['redis_us']:.1f} us) (<= 1)")
    if red:
        check(red["rps_vs_none"] >= 0.8,
              f"{C50.label} Redis policy: req/s {red['rps_vs_none']:.2f}x no policy (>= 0.8)")
    for load in loads:
        r = row.get(("sluice-redis", load))
        if r:
            # The requests in flight when the load generator stopped were
            # decided but not counted as requests.
            most = 1 + r["inflight"] / r["requests"]
            check(r["redis_calls"] <= most,
                  f"{load} Redis policy: {r['redis_calls']:.3f} Redis calls per request (<= 1; up to "
                  f"{most:.3f} with the {r['inflight']} requests in flight when {r['tool']} stopped)")

    out.append("earlier targets (issue 40, HTTP/1.1 at -c50 and -c200), kept as checks:")
    verdicts.append((None, "Kept from issue 40 (HTTP/1.1 at -c50 and -c200):"))
    for load in [load.label for load in LOADS if load.via == "http" and load.conns <= 200 and load.label in loads]:
        mem, red = row.get(("sluice-mem", load)), row.get(("sluice-redis", load))
        if mem:
            out.append(f"    ({load} memory store {against(mem, LIMIT_PEERS)})")
        if red:
            out.append(f"    ({load} Redis store {against(red, LIMIT_PEERS)})")
            x = red["cpu_vs_none"]
            check(x <= 1.2, f"{load} Redis policy: CPU per request {x:.2f}x no policy (<= 1.2)")
            null = row.get(("sluice-redis-null", load))
            if null:
                # Redis shares the cores, and the proxy waits for it: the slower
                # Redis runs here, the more the ratio above holds of Redis's cost.
                out.append(f"    (the same binary against a Redis script that only answers: {null['cpu_vs_none']:.2f}x "
                           f"no policy, Redis {null['redis_us']:.1f} us a request against {red['redis_us']:.1f}: "
                           f"the proxy's own part)")
        if mem:
            x = mem["cpu_vs_none"]
            check(x <= 1.05, f"{load} memory store: CPU per request {x:.2f}x no policy (<= 1.05)")
    rej, allowed = extra["mostly rejected"], row[("sluice-redis", C50.label)]
    check(rej["cpu_us"] < allowed["cpu_us"] and rej["redis_calls"] < 0.005,
          f"rejected: {rej['cpu_us']:.1f} us per request vs {allowed['cpu_us']:.1f} allowed, "
          f"{rej['redis_calls']:.2f} Redis calls (cheaper, 0)")
    m = re.search(r"per decision .*?: ([\d.]+) us = ([\d.]+)x", cost)
    if m:
        us, x = float(m.group(1)), float(m.group(2))
        check(us <= 10, f"Redis CPU per decision, the script alone: {us:.2f} us (<= 10)")
        check(x <= 1 / 3, f"Redis CPU per decision, the script alone: {x:.2f}x the seed reference (<= a third)")
        # The 10 us is the issue's third of the seed script's ~30 us on its
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
    return out, verdicts


def markdown(rows, idle, verdicts, footer):
    """The summary docs/performance.md carries: the peers and sluice on
    every load, the policies beside them, idle memory, the targets."""
    shown = PEERS + LIMIT_PEERS + ["sluice", "sluice-mem", "sluice-redis", "sluice-metered", "sluice-concurrency",
                                   "envoy-redis"]
    out = ["| load | setup | req/s | p99 ms | CPU µs/req | Redis CPU µs/req | Redis calls/req | "
           "req/s x | p99 x | CPU x |", "|---|---|---|---|---|---|---|---|---|---|"]

    def num(v, spec):
        return "" if v is None else format(v, spec)

    for r in rows:
        if r["setup"] not in shown:
            continue
        redis = r["setup"] in REDIS_SETUPS
        cells = [r["load"], r["setup"] + (" !" if r["flagged"] else ""), num(r["rps"], ",.0f"), num(r["p99"], ".2f"),
                 "" if r["setup"] == "envoy-redis" else num(r["cpu_us"], ".1f"),
                 num(r["redis_us"], ".1f") if redis else "", num(r["redis_calls"], ".2f") if redis else "",
                 num(r["rps_x"], ".2f"), num(r["p99_x"], ".2f"), num(r["cpu_x"], ".2f")]
        out.append("| " + " | ".join(cells) + " |")
    if idle:
        out += ["", "| memory per idle keep-alive connection | " + " | ".join(idle) + " |",
                "|---|" + "---|" * len(idle),
                "| KB (RSS growth / connections) | " + " | ".join(f"{v['kb']:.2f}" for v in idle.values()) + " |",
                "| connections | " + " | ".join(f"{v['connections']:,}" for v in idle.values()) + " |"]
    out += ["", "Targets:", ""]
    for ok, text in verdicts:
        out.append(f"\n{text}\n" if ok is None else f"- {'met' if ok else '**not met**'}: {text}")
    out += ["", footer]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--quick", action="store_true",
                    help="1 round of 4 s; HTTP/1.1 at -c50 only, the HTTP/2 and TLS loads; 2,000 idle connections")
    ap.add_argument("--no-pgo", action="store_true",
                    help="measure `cargo build --release` as sluice, not the PGO build (saves its 8 minutes)")
    ap.add_argument("--idle", type=int, help="idle connections for the memory figure (default 10000)")
    args = ap.parse_args()
    exit_on_signals()
    raise_nofile()
    if args.quick:
        args.rounds, args.duration = 1, 4
    idle_conns = args.idle or (2000 if args.quick else 10000)
    loads = [load for load in LOADS if not (args.quick and load.via == "http" and load.conns != 50)]

    need("wrk", "wrk")
    need("h2load", "nghttp2-client")
    need("ab", "apache2-utils")
    need("nginx", "nginx-light", "nginx")
    need("haproxy", "haproxy")
    need("redis-server", "redis-server")
    need("openssl", "openssl")
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
        _, cert, key = certificates(tmp)
        # haproxy reads the certificate and its key from one file.
        pem = os.path.join(tmp, "haproxy.pem")
        with open(pem, "w") as f:
            f.write(open(cert).read() + open(key).read())
        ports = {k: free_port() for k in [
            "upstream", "upstream-status", "upstream-metered", "nginx", "nginx-h2c", "nginx-tls", "nginx-limit",
            "haproxy", "haproxy-h2c", "haproxy-tls", "haproxy-limit", "sluice", "sluice-tls", "sluice-plain",
            "sluice-mem", "sluice-redis", "sluice-redis-null", "sluice-metered", "sluice-concurrency", "redis",
            "sluice-many", "sluice-reject", "floor", "http-floor", "nginx-idle", "haproxy-idle", "sluice-idle"]}
        up = ports["upstream"]
        status = ports["upstream-status"]
        procs.start(["nginx", "-c", upstream_conf(tmp, up, status_port=status,
                                                  metered_port=ports["upstream-metered"])])
        procs.start(["nginx", "-c", proxy_nginx_conf(tmp, ports["nginx"], up, h2c=ports["nginx-h2c"],
                                                     tls=(ports["nginx-tls"], cert, key))])
        procs.start(["nginx", "-c", proxy_nginx_conf(tmp, ports["nginx-limit"], up, limit=True)])
        # -db: in the foreground, one process (no master), which does the work.
        haproxy_log = open(os.path.join(tmp, "haproxy.log"), "w")
        pids = {}
        for name, conf in [("haproxy", haproxy_conf(tmp, ports["haproxy"], up, h2c=ports["haproxy-h2c"],
                                                     tls=(ports["haproxy-tls"], pem))),
                           ("haproxy-limit", haproxy_conf(tmp, ports["haproxy-limit"], up, limit=True))]:
            subprocess.run(["haproxy", "-c", "-q", "-f", conf], check=True)
            pids[name] = procs.start(["haproxy", "-db", "-f", conf], stdout=haproxy_log,
                                     stderr=subprocess.STDOUT).pid
        redis = procs.start(redis_args(ports["redis"]))

        def sluice_conf(name, store, policy, extra="", upstream=up, server=""):
            path = os.path.join(tmp, f"{name}.toml")
            pol = f"[policies.p]\n{policy}\n" if policy else ""
            with open(path, "w") as f:
                f.write(f"""[server]
listen = "127.0.0.1:{ports[name]}"
workers = 1
trusted_proxies = ["127.0.0.1"]
# wrk is one client address: no per-client cap on its connections.
max_upstream_per_client = 1000000
{server}
{store}
{extra}
[upstreams.api]
url = "http://127.0.0.1:{upstream}"
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
            "sluice-tls": sluice_conf("sluice-tls", "", None, f'[server.tls]\ncert = "{cert}"\nkey = "{key}"'),
            "sluice-mem": sluice_conf("sluice-mem", "", POLICY),
            "sluice-redis": sluice_conf("sluice-redis", redis_section, POLICY),
            "sluice-many": sluice_conf("sluice-many", redis_section, POLICY),
            "sluice-reject": sluice_conf("sluice-reject", redis_section, 'limits = [{ limit = 10, window = "1h" }]'),
        }
        # Issue 42's features: a build that does not have them refuses the
        # config, and the rest runs without these setups.
        for name, policy, upstream in [("sluice-metered", METERED, ports["upstream-metered"]),
                                       ("sluice-concurrency", CONCURRENCY, up)]:
            conf = sluice_conf(name, redis_section, policy, upstream=upstream)
            checked = subprocess.run([sluice, "check", "--config", conf], capture_output=True, text=True)
            if checked.returncode == 0:
                confs[name] = conf
            else:
                why = (checked.stderr.strip() or checked.stdout.strip()).splitlines()
                print(f"--- {name} skipped: sluice refuses its config ({why[-1] if why else checked.returncode})",
                      flush=True)
        env = dict(os.environ, RUST_LOG="warn")
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
        # Every port but the idle test's (later) and those of sluices not started.
        for name, port in ports.items():
            if not name.endswith("-idle") and (name in pids or not name.startswith(("sluice", "floor", "http-floor"))):
                wait_port(port)
        # nginx's work is done by its worker process, the master's only child.
        for name in ["nginx", "nginx-limit"]:
            master = next(p for p in procs.procs if p.args[-1].endswith(f"nginx-{ports[name]}.conf"))
            pids[name] = children(master.pid)[0]

        # Where each setup is reached, per way of speaking: (port, the
        # processes whose CPU is its). nginx and haproxy serve h2c and TLS
        # from the same process on ports of their own; sluice serves h2c on
        # its HTTP/1.1 port, and TLS from a second sluice.
        ends = {name: {"http": (ports[name], [pid])} for name, pid in pids.items()}
        for peer in PEERS:
            ends[peer]["h2c"] = (ports[f"{peer}-h2c"], [pids[peer]])
            ends[peer]["tls"] = (ports[f"{peer}-tls"], [pids[peer]])
        ends["sluice"]["h2c"] = ends["sluice"]["http"]
        ends["sluice"]["tls"] = ends["sluice-tls"]["http"]

        # Which setups each load runs.
        http11 = (["nginx", "nginx-limit", "haproxy", "haproxy-limit", "sluice"]
                  + ([] if args.no_pgo else ["sluice-plain"]) + ["sluice-mem", "sluice-redis"]
                  + (["sluice-redis-null"] if null_bin else []) + ["floor", "http-floor"])
        issue42 = [name for name in ("sluice-metered", "sluice-concurrency") if name in pids]
        plan = {}
        for load in loads:
            if load.via != "http":
                plan[load.label] = PEERS + ["sluice"]
            elif load.conns >= 1000:
                plan[load.label] = PEERS + ["sluice", "sluice-redis"]
            elif load is C50:
                plan[load.label] = http11[:http11.index("sluice-redis") + 1] + issue42 \
                    + http11[http11.index("sluice-redis") + 1:] + ["envoy-redis"]
            else:
                plan[load.label] = http11
        results = {(s, load.label): [] for load in loads for s in plan[load.label]}
        h2log = os.path.join(tmp, "h2load.log")

        # The Envoy-style baseline runs at the rate sluice-redis last reached
        # at -c50 (it runs right after it in each round).
        pace = {}

        def run(setup, load, duration, script=None):
            if setup == "envoy-redis":
                cmd = [sys.executable, CLIENTS, "envoy", str(ports["redis"]), str(duration), str(ENVOY_CONNS),
                       f"{pace.get('rate', 0):.0f}"]
                return measure(cmd, parse_envoy, [], redis.pid, ports["redis"], calls=("incrby", "expire"))
            port, proxy_pids = ends[setup][load.via]
            if load.tool == "h2load":
                return run_h2load(load.url(port), load.conns, duration, proxy_pids, status, h2log)
            redis_pid = redis.pid if setup in REDIS_SETUPS else None
            return run_wrk(load.url(port), load.conns, duration, proxy_pids, redis_pid,
                           ports["redis"] if redis_pid else None, script=script, status_port=status)

        # Warm up every proxy (pools, scripts) on each way it is spoken to,
        # at the largest concurrency: a pool that keeps its connections
        # opens none during the runs.
        warm = {}
        for load in loads:
            for s in plan[load.label]:
                if s != "envoy-redis" and load.conns > warm.get((s, load.via), (0, None))[0]:
                    warm[(s, load.via)] = (load.conns, load)
        for (s, _), (_, load) in warm.items():
            run(s, load, 1)
        for rnd in range(args.rounds):
            for load in loads:
                # Each round starts one setup later: the lab saw the same build
                # measure up to 15 % apart by its place in a round (what ran
                # just before it), so over the rounds every setup takes every
                # place about as often.
                setups = [s for s in plan[load.label] if s != "envoy-redis"]
                shift = rnd % len(setups)
                order = setups[shift:] + setups[:shift]
                if "envoy-redis" in plan[load.label]:
                    order.insert(order.index("sluice-redis") + 1, "envoy-redis")
                for s in order:
                    r = run(s, load, args.duration)
                    results[(s, load.label)].append(r)
                    if s == "sluice-redis" and load is C50:
                        pace["rate"] = r["rps"]
                    print(f"round {rnd + 1} {load.label:17} {s:18} {r['rps']:9.0f} req/s  p99 "
                          f"{fmt(r['p99'], '.2f', 6)} ms  cpu {r['cpu_us']:5.1f} us/req  redis "
                          f"{r['redis_us']:4.1f} us, {r['redis_calls']:.2f} calls  new upstream conns "
                          f"{r['new_up']}  client {r['client_pct']:.0f} %"
                          + (f"  non-2xx {r['non2xx']}" if r["non2xx"] else "")
                          + (f"  errors: {r['errors']}" if r["errors"] else ""), flush=True)

        # Many identities: a wrk script sends a random X-Forwarded-For (sluice trusts 127.0.0.1).
        extra = {}
        extra["many identities"] = run("sluice-many", C50, args.duration, script=many_lua(tmp))
        # Mostly rejected: one client over a 10/h limit; warm the deny cache first.
        run("sluice-reject", C50, 1)
        extra["mostly rejected"] = run("sluice-reject", C50, args.duration)

        # Requests as browsers and API clients send them: eight more fields
        # (about 330 bytes), where wrk sends only Host; and as API clients
        # write, a POST with a small JSON body. A proxy's cost grows with
        # each field it reads and passes on, so this shows how the figures
        # above carry over.
        trio = PEERS + ["sluice"]

        def trio_runs(one):
            """Runs (`one(setup)`) of the peers and sluice, back to back, each
            time starting one later."""
            runs = {s: [] for s in trio}
            for i in range(max(2, args.rounds // 2)):
                for s in trio[i % 3:] + trio[:i % 3]:
                    runs[s].append(one(s))
            return runs

        def wrk_with(script):
            return lambda s: run(s, C50, args.duration, script=script)

        fielded = trio_runs(wrk_with(fields_lua(tmp)))
        posted = trio_runs(wrk_with(post_lua(tmp)))

        # ApacheBench, which speaks HTTP/1.0: with keep-alive, and with a new
        # connection per request (its default, as many clients do).
        def ab(keepalive):
            return lambda s: run_ab(C50.url(ends[s]["http"][0]), C50.conns, args.duration,
                                    ends[s]["http"][1], keepalive)

        ab_kept = trio_runs(ab(True))
        ab_new = trio_runs(ab(False))

        # Memory per idle keep-alive connection, on fresh processes (a
        # process that served the runs above holds memory its allocator
        # keeps, which new connections would reuse unseen).
        print(f"--- memory per idle connection ({idle_conns} connections each)", flush=True)
        room = idle_conns + 4096
        # haproxy counts two descriptors a connection (client and server
        # side) and refuses to start when its maxconn needs more than the
        # open-files limit allows: under a low limit it holds fewer.
        haproxy_room = min(room, (resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 64) // 2)
        idle_counts = {"nginx": idle_conns, "haproxy": min(idle_conns, haproxy_room - 128), "sluice": idle_conns}
        idle_pids = {}
        master = procs.start(["nginx", "-c", proxy_nginx_conf(tmp, ports["nginx-idle"], up, connections=room)])
        conf = haproxy_conf(tmp, ports["haproxy-idle"], up, maxconn=haproxy_room)
        idle_pids["haproxy"] = procs.start(["haproxy", "-db", "-f", conf], stdout=haproxy_log,
                                           stderr=subprocess.STDOUT).pid
        # Idle connections are kept as long as the peers keep theirs (300 s):
        # the figure is what each holds for one, not when it lets go.
        conf = sluice_conf("sluice-idle", "", None,
                           server=f'header_timeout = "300s"\nmax_connections = {room}')
        idle_pids["sluice"] = procs.start([sluice, "--config", conf], env=env).pid
        for name in ["nginx", "haproxy", "sluice"]:
            wait_port(ports[f"{name}-idle"])
        idle_pids = {"nginx": children(master.pid)[0], **idle_pids}
        idle = {}
        for name, pid in idle_pids.items():
            before, after, kb = idle_growth(ports[f"{name}-idle"], pid, idle_counts[name])
            idle[name] = {"before_kb": before, "after_kb": after, "kb": kb, "connections": idle_counts[name]}
            print(f"{name:8} RSS {before} KB -> {after} KB with {idle_counts[name]} idle connections: "
                  f"{kb:.2f} KB a connection", flush=True)

        flagged = {}
        for load in loads:
            for s in plan[load.label]:
                # A proxy that keeps its upstream connections opens none once
                # warm, and never more than one per request in flight: more in
                # a run is a pool too small or connections closed after a few
                # requests. (The floor has no pool by design: a connection of
                # its own per client.)
                flagged[(s, load.label)] = s not in ("floor", "envoy-redis") and \
                    max(r["new_up"] for r in results[(s, load.label)]) > load.inflight
        # The best peer per figure: the most req/s, the lowest p99, the least
        # CPU, among the peers that keep their upstream connections.
        best = {}
        for load in loads:
            honest = [p for p in PEERS if not flagged[(p, load.label)]] or PEERS
            for key, pick in FIGURES.items():
                best[(key, load.label)] = pick(honest, key=lambda p: med(results[(p, load.label)], key))

        rows = []
        for load in loads:
            L = load.label
            for s in plan[L]:
                rs = results[(s, L)]
                row = {"setup": s, "load": L, "conns": load.conns, "via": load.via, "tool": load.tool,
                       "inflight": load.inflight,
                       **{k: med(rs, k) for k in ["rps", "p50", "p99", "cpu_us", "user_us", "sys_us", "redis_us",
                                                  "redis_calls", "new_up", "client_pct", "requests"]},
                       "flagged": flagged[(s, L)], "best": {key: best[(key, L)] for key in FIGURES},
                       "vs": {}, "rps_x": None, "p99_x": None, "cpu_x": None, "cpu_vs_none": None,
                       "rps_vs_none": None}
                if s != "envoy-redis":
                    # Against each peer, for the targets' comparisons, and
                    # against sluice without a policy.
                    row["vs"] = {p: {key: paired(rs, results[(p, L)], key) for key in FIGURES}
                                 for p in PEERS + LIMIT_PEERS if (p, L) in results}
                    for key, name in [("rps", "rps_x"), ("p99", "p99_x"), ("cpu_us", "cpu_x")]:
                        row[name] = row["vs"][best[(key, L)]][key]
                    row["cpu_vs_none"] = paired(rs, results[("sluice", L)], "cpu_us")
                    row["rps_vs_none"] = paired(rs, results[("sluice", L)], "rps")
                if s in REDIS_SETUPS and (("envoy-redis", L) in results):
                    row["redis_vs_envoy"] = paired(rs, results[("envoy-redis", L)], "redis_us")
                rows.append(row)
        lines = []
        head = (f"{'setup':18} {'load':17} {'req/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'cpu us/req':>10} "
                f"{'redis us/req':>12} {'redis calls':>11} {'req/s x':>8} {'p99 x':>6} {'cpu x':>6} "
                f"{'new upstream':>13} {'client %':>8}")
        lines.append(head)
        lines.append("-" * len(head))
        for r in rows:
            lines.append(f"{r['setup']:18} {r['load']:17} {r['rps']:>9.0f} {fmt(r['p50'], '.2f', 7)} "
                         f"{fmt(r['p99'], '.2f', 7)} {r['cpu_us']:>10.1f} {r['redis_us']:>12.1f} "
                         f"{r['redis_calls']:>11.2f} {fmt(r['rps_x'], '.2f', 8)} {fmt(r['p99_x'], '.2f', 6)} "
                         f"{fmt(r['cpu_x'], '.2f', 6)} {r['new_up']:>12.0f}{'!' if r['flagged'] else ' '} "
                         f"{r['client_pct']:>8.0f}")
        for name, r in extra.items():
            lines.append(f"{'sluice-redis':18} {C50.label:17} {r['rps']:>9.0f} {r['p50']:>7.2f} {r['p99']:>7.2f} "
                         f"{r['cpu_us']:>10.1f} {r['redis_us']:>12.1f} {r['redis_calls']:>11.2f}   "
                         f"({name}; non-2xx {r['non2xx']})")
        machine = f"{os.cpu_count()} cores; " + subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
        machine += "; " + subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split(" - ")[0]
        machine += "; " + subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split(" sha")[0]
        machine += "; " + subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0].split(" [")[0]
        machine += "; " + subprocess.run(["h2load", "--version"], capture_output=True, text=True).stdout.strip()
        machine += "; " + cpu_model() + ", Linux " + platform.release()
        lines.append("")
        footer = (f"medians of {args.rounds} round(s) of {args.duration} s; ratios: the median of each round's "
                  f"ratio to the best peer (nginx or haproxy) for that figure; {machine}")
        lines.append(footer)
        for load in loads:
            L = load.label
            lines.append(f"{L} best peer: req/s {best[('rps', L)]}, p99 {best[('p99', L)]}, "
                         f"CPU per request {best[('cpu_us', L)]}")
        lines.append("new upstream: the connections the upstream accepted during the run (median of the rounds)"
                     + ("; ! opens new upstream connections under keep-alive load (more than its requests in "
                        "flight in a run): its pool closes connections it will need again" if any(flagged.values())
                        else "; no proxy opened more than its requests in flight in a run")
                     + " (the floor opens one per client connection by design)")
        lines.append("sluice: " + ("`cargo build --release`" if args.no_pgo else
                                   "the PGO build (bench/pgo.py); sluice-plain: `cargo build --release`, no policy"))
        # A load generator with a whole core of its own busy was the
        # bottleneck: its req/s is its own most, not the proxy's.
        for load in loads:
            L = load.label
            busy = [s for s in plan[L] if s != "envoy-redis"
                    and max(r["client_pct"] for r in results[(s, L)]) >= SATURATED]
            top = max(r["client_pct"] for s in plan[L] if s != "envoy-redis" for r in results[(s, L)])
            lines.append(f"{L}: {load.tool} used up to {top:.0f} % of a core"
                         + (f"; it saturated its core against {', '.join(busy)}: req/s and p99 there are "
                            f"{load.tool}'s limit as much as the proxy's (CPU per request still holds)"
                            if busy else ", below saturation"))
        # How quiet the machine was: a peer's own cost should not move between
        # rounds, so its spread is what the neighbours added. A ratio within
        # that much of its target is not decided by this run.
        for load in loads:
            for peer in PEERS:
                cpus = [r["cpu_us"] for r in results[(peer, load.label)]]
                spread = max(cpus) / min(cpus) - 1
                verdict = ("one round: run several to see the noise" if len(cpus) < 2 else
                           "quiet" if spread <= 0.05 else
                           "noisy: rerun when the machine is quieter before reading a ratio near its target")
                lines.append(f"{peer} {load.label}: {min(cpus):.1f}-{max(cpus):.1f} us CPU per request over the "
                             f"rounds (spread {spread * 100:.0f} %, {verdict})")
        # The kernel's part (the TCP work of four segments a request) is much
        # the same for every proxy; the user part is the proxy's own code.
        for load in loads:
            L = load.label
            split = ", ".join(f"{row['setup']} {row['user_us']:.1f} + {row['sys_us']:.1f}" for row in rows
                              if row["load"] == L and row["setup"] in PEERS + ["sluice", "sluice-mem", "sluice-redis",
                                                                               "sluice-redis-null"])
            peer = best[("cpu_us", L)]
            ux = paired(results[("sluice", L)], results[(peer, L)], "user_us")
            lines.append(f"{L} CPU us per request, user + system (medians): {split}; "
                         f"sluice's user CPU {ux:.2f}x {peer}'s")
        # The floor: the CPU a request costs a proxy on sluice's runtime that
        # does no HTTP at all; the HTTP floor: the least an HTTP/1.1 proxy
        # does on it. What sluice spends above them is its own work.
        for load in loads:
            L = load.label
            for name, what in [("floor", "a TCP relay, no HTTP"), ("http-floor", "bare HTTP/1.1 proxy")]:
                fl = next((r for r in rows if r["setup"] == name and r["load"] == L), None)
                sl = next(r for r in rows if r["setup"] == "sluice" and r["load"] == L)
                if fl:
                    over = paired(results[("sluice", L)], results[(name, L)], "cpu_us")
                    lines.append(f"{L} {name} ({what}): {fl['cpu_us']:.1f} us CPU per request "
                                 f"({fl['user_us']:.1f} + {fl['sys_us']:.1f}) = {fl['cpu_x']:.2f}x "
                                 f"{best[('cpu_us', L)]}'s; sluice without a policy {over:.2f}x it, "
                                 f"about {sl['cpu_us'] - fl['cpu_us']:.1f} us a request above it")
        # The quietest round of each setup: on a shared machine the neighbours
        # only ever add CPU time, so each setup's lowest figure is the nearest
        # to its own cost. Not the targets' figure (those are the medians
        # above), but a check on them that a busy minute cannot move much.
        for load in loads:
            L = load.label
            low = {s: min(r["cpu_us"] for r in results[(s, L)]) for s in plan[L] if s != "envoy-redis"}
            peer = min(PEERS, key=lambda p: low[p])
            lines.append(f"{L} quietest round of each, CPU us per request: "
                         + "".join(f"{p} {low[p]:.1f}, " for p in PEERS)
                         + f"sluice {low['sluice']:.1f} ({low['sluice'] / low[peer]:.2f}x {peer}'s)"
                         + "".join(f", {s} {low[s]:.1f} ({low[s] / low['sluice']:.2f}x no policy)"
                                   for s in low if s.startswith("sluice-") and s != "sluice-plain"))
        # The Envoy-style baseline: Redis's CPU for the same policy's
        # decisions sent as Envoy's rate limit service sends them.
        env = next((r for r in rows if r["setup"] == "envoy-redis"), None)
        if env:
            red = next(r for r in rows if r["setup"] == "sluice-redis" and r["load"] == C50.label)
            lines.append(f"{C50.label} Envoy-style baseline (INCRBY + EXPIRE per limit, one pipeline a decision, "
                         f"{ENVOY_CONNS} connections, paced at sluice-redis's rate): Redis {env['redis_us']:.1f} us "
                         f"CPU a decision, {env['redis_calls']:.2f} commands in one round trip, {env['rps']:.0f} "
                         f"decisions/s (its client used {env['client_pct']:.0f} % of a core); sluice-redis: Redis "
                         f"{red['redis_us']:.1f} us a request, {red['redis_calls']:.2f} script calls, "
                         f"{red['rps']:.0f} req/s: {red['redis_vs_envoy']:.2f}x the baseline's Redis CPU")
        # Issue 42's setups against sluice without a policy (no targets).
        for name in ["sluice-metered", "sluice-concurrency"]:
            r = next((r for r in rows if r["setup"] == name), None)
            lines.append(f"{C50.label} {name}: " + (
                "skipped (sluice refused its config)" if not r else
                f"CPU {r['cpu_us']:.1f} us per request = {r['cpu_vs_none']:.2f}x no policy, req/s "
                f"{r['rps_vs_none']:.2f}x no policy, Redis {r['redis_us']:.1f} us and {r['redis_calls']:.2f} "
                f"calls per request"))
        def trio_line(what, runs, label=C50.label):
            peer = min(PEERS, key=lambda p: med(runs[p], "cpu_us"))
            x = paired(runs["sluice"], runs[peer], "cpu_us")
            return (f"{label} {what}, the median of {len(runs['sluice'])} runs each: CPU us per request "
                    + ", ".join(f"{s} {med(runs[s], 'cpu_us'):.1f}" for s in trio)
                    + f" (sluice {x:.2f}x {peer}'s); req/s "
                    + ", ".join(f"{s} {med(runs[s], 'rps'):.0f}" for s in trio) + "; p99 "
                    + ", ".join(f"{s} {med(runs[s], 'p99'):.2f}" for s in trio) + " ms")

        lines.append(trio_line("requests with eight more fields (as browsers and API clients send)", fielded))
        lines.append(trio_line("POST with a 78-byte JSON body", posted))
        lines.append(trio_line("with keep-alive (ab -k -c50)", ab_kept, label="ApacheBench, HTTP/1.0,"))
        lines.append(trio_line("a new connection per request (ab -c50)", ab_new, label="ApacheBench, HTTP/1.0,"))
        lines.append(f"memory per idle keep-alive connection (connections that made one request each, fresh "
                     f"processes, RSS growth read 1 s after the last answer): "
                     + ", ".join(f"{name} {v['kb']:.2f} KB ({v['before_kb']} -> {v['after_kb']} KB, "
                                 f"{v['connections']} connections)" for name, v in idle.items())
                     + ("" if idle["haproxy"]["connections"] == idle_conns else
                        "; haproxy holds fewer: its maxconn needs two descriptors a connection, and the "
                        f"open-files limit here is {resource.getrlimit(resource.RLIMIT_NOFILE)[1]}"))
        table = "\n".join(lines)
        print("\n" + table)
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "table.txt"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(RESULTS, "results.json"), "w") as f:
            json.dump({"rows": rows, "extra": extra, "fielded": fielded, "posted": posted, "idle": idle}, f, indent=1)
        svg_plot(rows, os.path.join(RESULTS, "plot.svg"))
        # Redis memory and CPU per identity for the policy, hour window full.
        identities = "10000" if args.quick else "100000"
        print(f"\n--- Redis cost per identity ({identities} identities; takes a few minutes)", flush=True)
        # Stopped with SIGTERM, not killed, if this run is: it has Redis servers to stop.
        cost = procs.start([sys.executable, os.path.join(ROOT, "bench", "redis_cost.py"), identities],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        cost_out = cost.communicate()[0]
        print(cost_out)
        summary, verdicts = targets(rows, extra, idle, cost_out)
        summary = "\n".join(summary)
        print(summary)
        with open(os.path.join(RESULTS, "table.txt"), "a") as f:
            f.write("\n" + cost_out + "\n" + summary + "\n")
        with open(os.path.join(RESULTS, "table.md"), "w") as f:
            f.write(markdown(rows, idle, verdicts, footer) + "\n")
        print("\nwrote bench/results/table.txt, table.md, results.json and plot.svg")
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
