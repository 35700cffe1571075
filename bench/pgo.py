#!/usr/bin/env python3
"""sluice built with profile-guided optimisation (PGO), the release build
the bench measures.

    python3 bench/pgo.py [--out PATH]

Three steps, each a full release build's time or less (about 8 minutes in all
on 2 cores):

  1. an instrumented build (`-Cprofile-generate`), in target/pgo/gen;
  2. training: that build proxies load to nginx upstreams for about 40 s,
     with the memory store and with Redis: under wrk, no policy, eight
     realistic request fields, a policy that allows, many client identities,
     a policy that rejects (what bench.py measures), and request bodies;
     under h2load, HTTP/2 (h2c); then, with TLS termination, HTTP/1.1 and
     HTTP/2 (ALPN) again, and an https:// upstream;
  3. the optimised build (`-Cprofile-use`), in target/pgo/use, copied to
     target/pgo/sluice (or PATH).

Why: the compiler then lays out the request path's code by what runs, and
inlines by what is hot. Measured (callgrind, wrk -c10, no policy): 11,349
-> 9,035 instructions a proxied GET (8,938 when only plain HTTP/1.1
was trained); lab, -c50, alternating: about 0.95x the CPU of `cargo build
--release` (user time 0.74x). The code is the same; only its layout and
inlining differ.

A path the training leaves out (today: upgrades) is laid out as cold code
and may run worse than in the plain build, as TLS and HTTP/2 did before
they were trained. Callgrind, instructions a request (wrk -c10 over TLS;
h2load -c10 -m10, h2c; wrk -c10 to an https:// upstream), plain / PGO
trained on plain HTTP/1.1 only / PGO trained as now: TLS 24,228 / 25,843 /
19,809; h2c 35,348 / 39,879 / 29,929; https:// upstream 33,268 / 30,222
(trained on all but it) / 26,936. Training them cost the plain HTTP/1.1
paths about 1 % (no policy 8,950 -> 9,035).

Needs what bench.py needs (wrk, nginx, redis-server), h2load
(nghttp2-client) and openssl, all installed when missing, and llvm-profdata
matching rustc's LLVM: `rustup component add llvm-tools` is run when it is
missing.
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from bench import (POLICY, ROOT, Procs, certificates, exit_on_signals, fields_lua, free_port, many_lua, need,
                   redis_args, redis_store, upstream_conf, wait_port)

PGO_DIR = os.path.join(ROOT, "target", "pgo")


def profdata_tool():
    """llvm-profdata from rustc's own toolchain (its LLVM reads the
    instrumented build's profiles), added by rustup when missing."""
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True,
                             check=True).stdout.strip()
    host = next(line.split()[1] for line in
                subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout.splitlines()
                if line.startswith("host:"))
    tool = os.path.join(sysroot, "lib", "rustlib", host, "bin", "llvm-profdata")
    if not os.path.exists(tool) and shutil.which("rustup"):
        print("--- adding rustup's llvm-tools (llvm-profdata)", flush=True)
        subprocess.run(["rustup", "component", "add", "llvm-tools"], check=True)
    if not os.path.exists(tool):
        sys.exit("pgo: llvm-profdata not found; with rustup: rustup component add llvm-tools")
    return tool


def cargo_build(target_dir, rustflags):
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir,
               RUSTFLAGS=(os.environ.get("RUSTFLAGS", "") + " " + rustflags).strip())
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "sluice"], cwd=ROOT, env=env,
                   check=True)
    return os.path.join(target_dir, "release", "sluice")


def wrk(url, seconds, script=None, refused=False):
    """wrk's load; every answer must be 2xx unless `refused` (then most are 429s)."""
    args = ["wrk", "-t1", "-c50", f"-d{seconds}s"] + (["-s", script] if script else []) + [url]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    if "requests in" not in out:
        raise RuntimeError(f"wrk against {url} gave no requests:\n{out}")
    if not refused and "Non-2xx" in out:
        raise RuntimeError(f"wrk against {url} had answers that were not 2xx:\n{out}")


def h2load(url, seconds):
    """HTTP/2 load: h2c with prior knowledge for http://, ALPN h2 for
    https://; as with wrk, every answer must be 2xx."""
    args = ["h2load", "-c10", "-m10", "-D", str(seconds), url]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    # Its status counts also hold answers that arrived after the timed
    # window closed, so they can exceed `done`: count what is not 2xx.
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, \d+ succeeded, (\d+) failed", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if (not done or not codes or int(done.group(1)) == 0 or int(done.group(2)) != 0
            or any(int(n) for n in codes.groups()[1:])):
        raise RuntimeError(f"h2load against {url} had answers that were not 2xx, or none:\n{out}")


def post_lua(dir_):
    """A wrk script: POSTs with a 1 KiB JSON body."""
    script = os.path.join(dir_, "post.lua")
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                'wrk.body = \'{"data":"\' .. string.rep("x", 1010) .. \'"}\'\n')
    return script


def train(binary, profiles):
    """Runs the instrumented `binary` under load; its profiles go to `profiles`."""
    tmp = tempfile.mkdtemp(prefix="sluice-pgo-")
    procs = Procs()
    try:
        up, up_tls, redis_port = free_port(), free_port(), free_port()
        ca, cert, key = certificates(tmp)
        procs.start(["nginx", "-c", upstream_conf(tmp, up)])
        # The API over TLS too, for the https:// upstream's path.
        procs.start(["nginx", "-c", upstream_conf(tmp, up_tls, (cert, key))])
        procs.start(redis_args(redis_port))
        for port in (up, up_tls, redis_port):
            wait_port(port)
        many, fields, post = many_lua(tmp, "/allow"), fields_lua(tmp), post_lua(tmp)
        # Each instance: (what its config adds, the scheme it serves).
        instances = {
            "memory": ("", "http"),
            "redis": (redis_store(redis_port), "http"),
            "tls": (f'[server.tls]\ncert = "{cert}"\nkey = "{key}"', "https"),
        }
        for name, (extra, scheme) in instances.items():
            port = free_port()
            conf = os.path.join(tmp, f"{name}.toml")
            with open(conf, "w") as f:
                f.write(f"""[server]
listen = "127.0.0.1:{port}"
workers = 1
trusted_proxies = ["127.0.0.1"]
# wrk is one client address: no per-client cap on its connections.
max_upstream_per_client = 1000000
{extra}
[upstreams.api]
url = "http://127.0.0.1:{up}"
[upstreams.secure]
url = "https://127.0.0.1:{up_tls}"
ca = "{ca}"
[policies.allow]
{POLICY}
[policies.deny]
limits = [{{ limit = 10, window = "1h" }}]
[[routes]]
path = "/allow"
upstream = "api"
policy = "allow"
[[routes]]
path = "/deny"
upstream = "api"
policy = "deny"
[[routes]]
path = "/secure"
upstream = "secure"
[[routes]]
path = "/"
upstream = "api"
""")
            env = dict(os.environ, RUST_LOG="warn",
                       LLVM_PROFILE_FILE=os.path.join(profiles, f"{name}-%p-%m.profraw"))
            proc = procs.start([binary, "--config", conf], env=env)
            wait_port(port)
            base = f"{scheme}://127.0.0.1:{port}"
            if scheme == "http":
                wrk(f"{base}/", 3)
                wrk(f"{base}/", 2, fields)
                wrk(f"{base}/allow", 3)
                wrk(f"{base}/allow", 2, many)
                wrk(f"{base}/deny", 2, refused=True)
                wrk(f"{base}/allow", 1, post)
                h2load(f"{base}/allow", 2)
            else:
                wrk(f"{base}/", 2)
                wrk(f"{base}/allow", 1, post)
                h2load(f"{base}/", 2)
                wrk(f"{base}/secure", 2)
            # The profile is written as the process exits: a clean stop.
            proc.send_signal(signal.SIGTERM)
            if proc.wait(timeout=30) != 0:
                raise RuntimeError(f"the instrumented sluice ({name}) exited with {proc.returncode}")
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    written = glob.glob(os.path.join(profiles, "*.profraw"))
    if len(written) != len(instances) or not all(os.path.getsize(p) > 0 for p in written):
        raise RuntimeError(f"expected {len(instances)} profiles, found {written}")
    return written


def build(out=None):
    """The PGO build of sluice; returns its path."""
    need("wrk", "wrk")
    need("nginx", "nginx-light", "nginx")
    need("redis-server", "redis-server")
    need("h2load", "nghttp2-client")
    need("openssl", "openssl")
    tool = profdata_tool()
    os.makedirs(PGO_DIR, exist_ok=True)
    profiles = os.path.join(PGO_DIR, "profiles")
    shutil.rmtree(profiles, ignore_errors=True)
    os.makedirs(profiles)
    print("--- PGO 1/3: instrumented build", flush=True)
    # Build scripts run during this build write their own profiles: they go
    # to a directory of their own, not among the training's.
    gen = cargo_build(os.path.join(PGO_DIR, "gen"),
                      f"-Cprofile-generate={os.path.join(PGO_DIR, 'build-scripts')}")
    print("--- PGO 2/3: training under load", flush=True)
    merged = os.path.join(PGO_DIR, "sluice.profdata")
    subprocess.run([tool, "merge", "-o", merged] + train(gen, profiles), check=True)
    print("--- PGO 3/3: optimised build", flush=True)
    built = cargo_build(os.path.join(PGO_DIR, "use"), f"-Cprofile-use={merged}")
    out = out or os.path.join(PGO_DIR, "sluice")
    shutil.copy2(built, out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="where to put the binary (default target/pgo/sluice)")
    args = ap.parse_args()
    exit_on_signals()
    print(build(args.out))


if __name__ == "__main__":
    main()
