#!/usr/bin/env python3
"""The bench's two clients that wrk and h2load cannot be: the Envoy-style
Redis baseline, and idle keep-alive connections.

    python3 bench/clients.py envoy REDIS_PORT SECONDS CONNECTIONS RATE
    python3 bench/clients.py idle PROXY_PORT CONNECTIONS

`envoy`: what Envoy's rate limit service (envoyproxy/ratelimit, Redis
backend, fixed windows) sends Redis for the bench's policy of three limits
(per second, minute and hour) and one client: for each decision, per limit
`INCRBY key 1` and `EXPIRE key <window>` on a key named by the window's
start, the six commands in one pipeline (one write, one round trip), not
atomic. Each of CONNECTIONS connections holds one decision's pipeline at a
time (the service's REDIS_PIPELINE_WINDOW 0: no batching across decisions),
and decisions start no faster than RATE a second (0: as fast as Redis
answers), so that Redis meets it at the rate it met sluice: Redis's CPU per
command falls as its load rises (more commands a wake-up). Prints one JSON
line: decisions, seconds, the client's own CPU seconds.

`idle`: opens CONNECTIONS connections to the proxy, each sends one
`GET /` and reads its answer (100 at a time, so the upstream sees at most
that many at once), then all stay open and idle. Prints `ready N` once every
answer is in, then holds them until stdin ends, and closes them.
"""
import asyncio
import json
import resource
import selectors
import socket
import sys
import time

# (window seconds, its name in the key), as the service's units.
UNITS = [(1, "second"), (60, "minute"), (3600, "hour")]


def raise_nofile():
    """Every connection is a descriptor: the soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def resp(*args):
    """One command in RESP, as every client library writes it."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def pipeline(now):
    """One decision's six commands at unix second `now`, keys named as the
    service names them (domain, descriptor key and value, the window's start)."""
    out = []
    for secs, unit in UNITS:
        key = f"bench_remote_address_127.0.0.1_{unit}_{now // secs * secs}"
        out += [resp("INCRBY", key, 1), resp("EXPIRE", key, secs)]
    return b"".join(out)


def envoy(port, seconds, conns, rate):
    """Decision i is not sent before i / `rate` seconds into the run, and
    each connection has one decision in flight at most."""
    sel = selectors.DefaultSelector()
    idle = []
    for _ in range(conns):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        # The answer lines received so far for its decision in flight.
        sel.register(s, selectors.EVENT_READ, [0])
        idle.append(s)
    replies = 2 * len(UNITS)
    second = int(time.time())
    data = pipeline(second)
    cpu0, t0 = time.process_time(), time.monotonic()
    end = t0 + seconds
    sent = done = 0
    while True:
        now = time.monotonic()
        if now >= end:
            break
        while idle and (not rate or sent < (now - t0) * rate):
            if int(time.time()) != second:
                second = int(time.time())
                data = pipeline(second)
            idle.pop().send(data)
            sent += 1
        timeout = end - now
        if idle and rate:
            timeout = max(0.0, min(timeout, t0 + sent / rate - now))
        for key, _ in sel.select(timeout):
            chunk = key.fileobj.recv(65536)
            if not chunk or b"-" in chunk:
                # Integer answers are never negative: a `-` is an error reply.
                sys.exit(f"clients envoy: Redis answered {chunk[:200]!r}")
            key.data[0] += chunk.count(b"\r\n")
            if key.data[0] >= replies:
                key.data[0] -= replies
                done += 1
                idle.append(key.fileobj)
    print(json.dumps({"decisions": done, "seconds": time.monotonic() - t0, "cpu": time.process_time() - cpu0}))


async def one_request(port, sem, held):
    async with sem:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        if status != b"200" or length is None:
            raise RuntimeError(f"unexpected answer: {head[:200]!r}")
        await reader.readexactly(length)
        held.append(writer)


async def idle(port, conns):
    held = []
    sem = asyncio.Semaphore(100)
    await asyncio.gather(*(one_request(port, sem, held) for _ in range(conns)))
    print(f"ready {len(held)}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for w in held:
        w.close()


def main():
    raise_nofile()
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "envoy" and len(sys.argv) == 6:
        envoy(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    elif what == "idle" and len(sys.argv) == 4:
        asyncio.run(idle(int(sys.argv[2]), int(sys.argv[3])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
