#!/usr/bin/env python3
"""HTTP/2 alone: each proxy answers h2c requests itself, with no upstream.

    python3 bench/h2_alone.py [--rounds R] [--duration S] [--sluice BINARY]

What the HTTP/2 server of each costs, apart from proxying: sluice with a
`respond` route, haproxy with `http-request return`, nginx with `return
200`, each one worker, each answering `ok` over HTTP/2 with prior knowledge.
For each round, each setup in turn gets `h2load -t1 -c50 -m10 -D S`, run
and measured by bench.py's own `run_h2load`: CPU is the proxy process's
(utime + stime, from /proc) per answer h2load received. Reported: the
median over the rounds of user and system CPU per request, and sluice's
ratio to haproxy's (the median of each round's ratio).

h2load may be the bottleneck here (one thread, and these answers are
cheap): its CPU (`client %`, of one core) is printed too; the CPU per
request is still the proxy's own.
sluice is `target/release/sluice` unless `--sluice` names a binary.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configs(dir_, ports):
    """The three setups' configurations: (name, command) each."""
    sluice_conf = os.path.join(dir_, "sluice.toml")
    with open(sluice_conf, "w") as f:
        f.write(f'[server]\nlisten = "127.0.0.1:{ports["sluice"]}"\nworkers = 1\n\n'
                '[[routes]]\npath = "/"\nrespond = { status = 200, body = "ok" }\n')
    haproxy_conf = os.path.join(dir_, "haproxy.cfg")
    with open(haproxy_conf, "w") as f:
        f.write(f"""global
  nbthread 1
  maxconn 8000

defaults
  mode http
  timeout connect 5s
  timeout client 300s
  timeout server 300s

frontend fe_h2c
  bind 127.0.0.1:{ports["haproxy"]} proto h2
  http-request return status 200 content-type text/plain string "ok"
""")
    listen_h2, h2_on = ("", "http2 on; ") if bench.nginx_version() >= (1, 25, 1) else (" http2", "")
    nginx_conf = bench.nginx_conf(
        dir_, "h2-alone",
        f'server {{ listen 127.0.0.1:{ports["nginx"]}{listen_h2}; '
        f'{h2_on}location / {{ return 200 "ok"; }} }}')
    return [("haproxy", ["haproxy", "-f", haproxy_conf]),
            ("nginx", ["nginx", "-c", nginx_conf]),
            ("sluice", [None, "--config", sluice_conf])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=4)
    ap.add_argument("--sluice", default=os.path.join(ROOT, "target", "release", "sluice"))
    args = ap.parse_args()
    bench.need("h2load", "nghttp2-client")
    bench.need("nginx", "nginx")
    bench.need("haproxy", "haproxy")
    if not os.path.exists(args.sluice):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    bench.raise_nofile()
    with tempfile.TemporaryDirectory() as tmp:
        ports = {name: bench.free_port() for name in ["sluice", "haproxy", "nginx"]}
        procs, pids = [], {}
        try:
            for name, cmd in configs(tmp, ports):
                cmd = [args.sluice if c is None else c for c in cmd]
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, RUST_LOG="warn"))
                procs.append(p)
                bench.wait_port(ports[name])
                # nginx's work is done by its worker, the master's only child.
                pids[name] = (bench.children(p.pid) or [p.pid])[0] if name == "nginx" else p.pid
            rows = {name: [] for name in ports}
            for r in range(1, args.rounds + 1):
                for name in ["haproxy", "nginx", "sluice"]:
                    url = f"http://127.0.0.1:{ports[name]}/"
                    # bench.py's own h2load run: the proxy's CPU per answer, h2load's.
                    log = os.path.join(tmp, "h2load.log")
                    m = bench.run_h2load(url, 50, args.duration, [pids[name]], None, log)
                    rows[name].append((m["user_us"], m["sys_us"]))
                    print(f"round {r} {name:8} {m['rps']:10.0f} req/s  CPU {m['user_us']:.2f} + "
                          f"{m['sys_us']:.2f} us/req  client {m['client_pct']:.0f} %", flush=True)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    print(f"\nh2c answered by the proxy itself, h2load -t1 -c50 -m10, medians of {args.rounds} rounds "
          f"of {args.duration} s, CPU us per request, user + system:")
    for name, rs in rows.items():
        print(f"  {name:8} {statistics.median(u for u, _ in rs):.2f} + "
              f"{statistics.median(s for _, s in rs):.2f} = {statistics.median(u + s for u, s in rs):.2f}")
    ratio = statistics.median((su + ss) / (hu + hs) for (su, ss), (hu, hs) in zip(rows["sluice"], rows["haproxy"]))
    print(f"  sluice {ratio:.2f}x haproxy's")


if __name__ == "__main__":
    main()
