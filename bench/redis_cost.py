#!/usr/bin/env python3
"""Redis cost of sluice's decision script, measured on a private redis-server.

For the policy 10/1s + 120/1m + 240/1h (precision 1m), it reports:
  - Redis CPU microseconds per decision (INFO commandstats, evalsha usec_per_call),
    with every identity's hour window full (60 live buckets);
  - bytes of Redis memory per identity once its hour window is full
    (INFO memory used_memory, over IDENTITIES identities, minus the empty baseline).

It drives lua/acquire.lua exactly as sluice does (same keys, same arguments, the
local clock mode so that an hour of traffic can be replayed in seconds), and
the same for bench/seed_reference.lua, the seed articles' hash layout, so that both
figures are also given as a ratio to it, measured in the same run.

    python3 bench/redis_cost.py [IDENTITIES]      # needs redis-server and `pip install redis`
"""
import base64
import hashlib
import os
import socket
import struct
import subprocess
import sys
import time

import redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDENTITIES = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
# (limit, window ms, algorithm code, param, limit id): as src/store/redis.rs sends them.
LIMITS = [(10, 1000, 1, 1000, "1s:fixed"), (120, 60000, 1, 60000, "1m:fixed"),
          (240, 3600000, 1, 60000, "1h:sliding:1m")]


def tag(limit_id):
    """The record tag: 64-bit FNV-1a of the limit id."""
    h = 0xcbf29ce484222325
    for b in limit_id.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


# The counters argument: the same for every identity (one key).
SPEC = b"".join(struct.pack(">BBdddQ", 1, alg, limit, window, param, tag(lid))
                for (limit, window, alg, param, lid) in LIMITS)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def key_for(ip):
    """The identity's packed string, named as src/limiter.rs names it."""
    tag = base64.urlsafe_b64encode(hashlib.sha256(b"ip\0" + ip.encode()).digest()[:16]).rstrip(b"=").decode()
    return "sluice:{%s}:standard" % tag


def start_redis():
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    return server, r


def measure(script_file, identities, call):
    """Replays an hour, one request per identity per minute, on a fresh
    redis-server; returns (usec_per_call over the last minute, bytes per
    identity). `call(script, pipe, i, ip, now_ms)` queues one decision."""
    server, r = start_redis()
    try:
        script = r.register_script(open(script_file).read())
        base = r.info("memory")["used_memory"]
        start = 1_800_000_000_000
        pipe_size = 500
        for minute in range(60):
            now = start + minute * 60000
            pipe = r.pipeline(transaction=False)
            for i in range(identities):
                ip = "10.%d.%d.%d" % (i >> 16 & 255, i >> 8 & 255, i & 255)
                call(script, pipe, i, ip, now)
                if (i + 1) % pipe_size == 0:
                    # Refusals would make the reference cheaper than it is.
                    assert all(x in (0, None) or isinstance(x, bytes) and x[:1] == b"\x01"
                               for x in pipe.execute()), "a decision was refused"
            pipe.execute()
            if minute == 58:
                r.config_resetstat()
        usec = r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
        used = r.info("memory")["used_memory"] - base
        return usec, used // identities
    finally:
        server.terminate()
        server.wait()


def sluice_call(script, pipe, i, ip, now):
    script(keys=[key_for(ip)], args=[struct.pack(">Bddd", 1, now, 1, i), SPEC], client=pipe)


# The same policy for bench/seed_reference.lua: [window s, limit, precision s].
SEED_LIMITS = "[[1,10],[60,120],[3600,240,60]]"


def seed_call(script, pipe, i, ip, now):
    script(keys=["seed:" + ip], args=[SEED_LIMITS, now / 1000, 1], client=pipe)


def main():
    usec, size = measure(os.path.join(ROOT, "lua", "acquire.lua"), IDENTITIES, sluice_call)
    # The reference's cost per call and per identity does not grow with their
    # number (each hash is small), so fewer identities keep the run short.
    ref_ids = min(IDENTITIES, 10000)
    ref_usec, ref_size = measure(os.path.join(ROOT, "bench", "seed_reference.lua"), ref_ids, seed_call)
    print("identities: %d (seed reference: %d)" % (IDENTITIES, ref_ids))
    print("redis CPU per decision (hour window full): %.2f us = %.2fx the seed reference (%.2f us)"
          % (usec, usec / ref_usec, ref_usec))
    print("redis memory per identity (hour window full): %d bytes = %.2fx the seed reference (%d bytes)"
          % (size, size / ref_size, ref_size))


if __name__ == "__main__":
    main()
