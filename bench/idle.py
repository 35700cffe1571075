#!/usr/bin/env python3
"""Memory per idle keep-alive client connection: sluice against nginx.

    python3 bench/idle.py [--conns N] [--rounds R] [--protocols h1,h1-tls,h2c,h2-tls]
                          [--requests N] [--sluice NAME=BINARY ...]

Each proxy runs one worker in front of the same upstream (nginx, `return 200
"ok"`). For each round, protocol and proxy, a fresh proxy process is started
and warmed (a few hundred connections, each one request, then closed); its
resident memory (VmRSS) is read; then N client connections (default 10,000)
each send one GET (`--requests N`: N, back to back), read the whole answer,
and stay open, idle; after a second to settle (three with `--requests`),
VmRSS is read again. Reported: the growth divided by N, per
proxy and protocol, the median over the rounds, and sluice's ratio to nginx's
(the median of each round's ratio: the setups of a round run back to back).

nginx also makes and touches a slot (its connection and event structures)
for each of its `worker_connections` when it starts, used or not: memory its
growth does not show. Printed last: that per slot, from an idle worker's
VmRSS with many slots against 1024.

Protocols: `h1` (HTTP/1.1 on plain TCP), `h1-tls` (ALPN http/1.1), `h2c`
(HTTP/2 with prior knowledge), `h2-tls` (ALPN h2), and `h1-post` (HTTP/1.1
on plain TCP, a POST with a one-byte body: sluice hands such a connection to
hyper's server). The HTTP/2 client is a few hand-made frames: one stream,
then the connection idles.

sluice is `target/release/sluice` unless `--sluice` names binaries (several
may be compared, e.g. a build of main against a branch's). The open files
limit is raised to its hard limit; it must exceed N plus a few hundred.
Needs nginx and openssl (for the TLS protocols' self-signed certificate).
"""

import argparse
import os
import resource
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

from bench import children, free_port, nginx_conf, rss_kb, wait_port  # the bench's own helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOLS = ["h1", "h1-tls", "h2c", "h2-tls", "h1-post"]
WARM = 300


def proxy_nginx_body(port, up, proto, cert):
    listen = {
        "h1": "",
        "h1-post": "",
        "h1-tls": " ssl",
        "h2c": " http2",
        "h2-tls": " ssl http2",
    }[proto]
    tls = f"ssl_certificate {cert[0]}; ssl_certificate_key {cert[1]}; " if "tls" in proto else ""
    return (f"upstream api {{ server 127.0.0.1:{up}; keepalive 1024; keepalive_requests 1000000; "
            f"keepalive_timeout 300s; }} "
            f"server {{ listen 127.0.0.1:{port}{listen}; {tls}http2_idle_timeout 300s; "
            f'location / {{ proxy_pass http://api; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}')


def sluice_conf(dir_, name, port, up, proto, cert):
    tls = f'[server.tls]\ncert = "{cert[0]}"\nkey = "{cert[1]}"\n' if "tls" in proto else ""
    path = os.path.join(dir_, f"{name}-{proto}.toml")
    with open(path, "w") as f:
        f.write(f"""[server]
listen = "127.0.0.1:{port}"
workers = 1
header_timeout = "300s"
max_connections = 65536
max_upstream_per_client = 1000000
{tls}
[upstreams.api]
url = "http://127.0.0.1:{up}"

[[routes]]
path = "/"
upstream = "api"
""")
    return path


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


# GET http://x/ on a stream, ended: :method GET, :scheme http or https, :path
# / (static table entries), :authority "x" (a literal with an indexed name).
def h2_request(https, stream=1):
    """A GET on `stream`; the first (stream 1) opens the connection."""
    block = bytes([0x82, 0x87 if https else 0x86, 0x84, 0x41, 1]) + b"x"
    opening = H2_PREFACE + frame(4, 0, 0) if stream == 1 else b""
    return opening + frame(1, 0x5, stream, block)


def read_exact(s, n):
    data = b""
    while len(data) < n:
        got = s.recv(n - len(data))
        if not got:
            raise RuntimeError("the connection closed before the answer ended")
        data += got
    return data


def h1_exchange(s, post=False):
    s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx" if post
              else b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(4096)
        if not got:
            raise RuntimeError("the connection closed before the answer's head")
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {head[:80]!r}")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    if len(body) < length:
        read_exact(s, length - len(body))


def h2_exchange(s, https, wanted=1):
    s.sendall(h2_request(https, wanted))
    while True:
        header = read_exact(s, 9)
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        read_exact(s, length)
        if kind == 4 and not flags & 1:
            s.sendall(frame(4, 1, 0))
        elif kind == 7:
            raise RuntimeError("GOAWAY")
        elif stream == wanted and kind in (0, 1) and flags & 1:
            return


def open_conns(port, proto, n, requests=1):
    ctx = None
    if "tls" in proto:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"] if proto == "h2-tls" else ["http/1.1"])
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx:
            s = ctx.wrap_socket(s, server_hostname="localhost")
        for i in range(requests):
            if proto.startswith("h2"):
                h2_exchange(s, ctx is not None, 2 * i + 1)
            else:
                h1_exchange(s, post=proto == "h1-post")
        conns.append(s)
    return conns


def nginx_worker_rss(tmp, name, connections):
    """VmRSS (KiB) of an idle nginx worker started with `connections` slots."""
    port = free_port()
    conf = nginx_conf(tmp, name, f'server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ok"; }} }}',
                      connections)
    master = subprocess.Popen(["nginx", "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # The master listens before its worker has made its slots: an
        # answer is the worker's.
        wait_port(port)
        with socket.create_connection(("127.0.0.1", port)) as s:
            h1_exchange(s)
        return rss_kb(children(master.pid)[0])
    finally:
        master.send_signal(signal.SIGTERM)
        master.wait(timeout=15)


def measure(start, port, proto, n, requests=1):
    """Starts a proxy (`start` returns its process and the pid whose memory
    counts), warms it, and returns its VmRSS growth per idle connection in
    bytes."""
    proc, pid = start()
    try:
        wait_port(port)
        for s in open_conns(port, proto, WARM):
            s.close()
        time.sleep(1)
        before = rss_kb(pid)
        conns = open_conns(port, proto, n, requests)
        # A connection that was busy is parked a second or two after its
        # last answer (see docs/design.md).
        time.sleep(1 if requests == 1 else 3)
        after = rss_kb(pid)
        if proc.poll() is not None:
            raise RuntimeError("the proxy exited")
        for s in conns:
            s.close()
        return (after - before) * 1024 / n
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conns", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--protocols", default="h1", help=f"comma-separated, of {','.join(PROTOCOLS)}")
    ap.add_argument("--sluice", action="append", default=[], metavar="NAME=BINARY")
    ap.add_argument("--requests", type=int, default=1,
                    help="requests each connection sends, back to back, before it idles")
    args = ap.parse_args()
    protocols = args.protocols.split(",")
    for p in protocols:
        if p not in PROTOCOLS:
            sys.exit(f"unknown protocol {p!r}: one of {', '.join(PROTOCOLS)}")
    sluices = [tuple(s.split("=", 1)) for s in args.sluice] or [
        ("sluice", os.path.join(ROOT, "target", "release", "sluice"))]
    for name, binary in sluices:
        if not os.access(binary, os.X_OK):
            sys.exit(f"{name}: {binary} is not an executable (cargo build --release?)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = hard if hard != resource.RLIM_INFINITY else 1 << 20
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    if nofile < args.conns + 1024:
        sys.exit(f"the open files limit ({nofile}) must be at least {args.conns + 1024}")

    tmp = tempfile.mkdtemp(prefix="sluice-idle-")
    upstream = None
    try:
        cert = (os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem"))
        if any("tls" in p for p in protocols):
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                            "/CN=localhost", "-keyout", cert[1], "-out", cert[0]],
                           check=True, capture_output=True)
        up = free_port()
        upstream = subprocess.Popen(
            ["nginx", "-c", nginx_conf(tmp, "upstream",
                                       f'server {{ listen 127.0.0.1:{up}; location / {{ return 200 "ok"; }} }}',
                                       nofile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(up)
        setups = ["nginx"] + [name for name, _ in sluices]
        results = {(s, p): [] for s in setups for p in protocols}
        for rnd in range(args.rounds):
            # Each round starts one setup later (see bench/bench.py).
            shift = rnd % len(setups)
            order = setups[shift:] + setups[:shift]
            for proto in protocols:
                for s in order:
                    port = free_port()
                    if s == "nginx":
                        conf = nginx_conf(tmp, f"proxy-{proto}", proxy_nginx_body(port, up, proto, cert), nofile)

                        def start(conf=conf):
                            master = subprocess.Popen(["nginx", "-c", conf], stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.DEVNULL)
                            deadline = time.time() + 10
                            while not children(master.pid):
                                if time.time() > deadline:
                                    raise RuntimeError("nginx started no worker")
                                time.sleep(0.05)
                            return master, children(master.pid)[0]
                    else:
                        binary = dict(sluices)[s]
                        conf = sluice_conf(tmp, s, port, up, proto, cert)

                        def start(binary=binary, conf=conf):
                            p = subprocess.Popen([binary, "--config", conf], stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
                            return p, p.pid
                    per_conn = measure(start, port, proto, args.conns, args.requests)
                    results[(s, proto)].append(per_conn)
                    print(f"round {rnd + 1} {proto:7} {s:14} {per_conn:8.0f} bytes per idle connection",
                          flush=True)
        print()
        print(f"{'protocol':9}{'setup':15}{'bytes/conn':>11}{'x nginx':>9}")
        for proto in protocols:
            for s in setups:
                rs = results[(s, proto)]
                ratio = statistics.median(r / n for r, n in zip(rs, results[("nginx", proto)]))
                print(f"{proto:9}{s:15}{statistics.median(rs):11.0f}{ratio:9.2f}")
        each = "one request" if args.requests == 1 else f"{args.requests} requests back to back"
        print(f"\nmedians of {args.rounds} round(s); {args.conns} connections, each {each}, then idle; "
              f"growth of VmRSS after {WARM} warm-up connections; ratio: the median of each round's ratio")
        # nginx makes and touches a slot for each of its worker_connections at
        # start: memory its growth does not show.
        small, large = 1024, nofile
        slot = ((nginx_worker_rss(tmp, "slots-large", large) - nginx_worker_rss(tmp, "slots-small", small))
                * 1024 / (large - small))
        print(f"nginx also holds {slot:.0f} bytes per worker_connections slot from its start, used or not "
              f"(idle worker's VmRSS with {large} slots against {small})")
    finally:
        if upstream:
            upstream.send_signal(signal.SIGTERM)
            upstream.wait(timeout=15)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
