#!/usr/bin/env python3
"""Where Redis's CPU goes in a batched decision of bench.py's `sluice-redis`.

It replays on a private redis-server what sluice sends at wrk -c50 there: one
identity (wrk is one client address), the bench's policy (three limits of a
billion: 1s and 1m fixed, 1h sliding by the minute), Redis TIME as the clock,
BATCH decisions a call of lua/batch.lua with acquire.lua's text in it (as
src/store/redis.rs makes it) and the key marked as shared (the script keeps it
between decisions). For acquire.lua and for cut-down copies of it, it gives
redis-server's own CPU (utime + stime) per decision, each the median of
ROUNDS interleaved rounds:

  acquire.lua       the script as it is
  no writes         acquire.lua answering once its counters are worked out:
                    what is left is reading and rebuilding the packed string
  header only       acquire.lua answering once it has read its header and
                    the time: the per-decision cost of being a decision
  batch only        an answer given at once (a constant string): the batch
                    call, its arguments and its answer, no script work
  redis_null.lua    the stand-in of bench.py's `sluice-redis-null`

Then acquire.lua again at other batch sizes (what a call costs beyond its
decisions), and what a few of the script's own steps cost in Redis's Lua (a
million of each in one EVAL, redis-server's CPU per step): reading a counter
of the call's argument, packing a fixed record, and making a string of a
packed string's size, whose every byte Redis's Lua hashes. Every variant's
answers are checked to be allowed ones.

    python3 bench/redis_parts.py [ROUNDS [BATCH]]   # needs redis-server and `pip install redis`
"""
import os
import statistics
import struct
import subprocess
import sys

import redis

from bench import cpu_seconds, free_port, redis_args, wait_port  # the bench's own helpers
from redis_cost import tag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 25
DECISIONS = 100_000
# (limit, window ms, algorithm code, param, limit id): bench.py's POLICY as
# src/store/redis.rs sends it.
LIMITS = [(1e9, 1000, 1, 1000, "1s:fixed"), (1e9, 60000, 1, 60000, "1m:fixed"),
          (1e9, 3600000, 1, 60000, "1h:sliding:1m")]
KEY = b"sluice:{AAAAAAAAAAAAAAAAAAAAAA}:p"


SPEC = b"".join(struct.pack(">BBdddQ", 1, alg, limit, window, param, tag(lid))
                for (limit, window, alg, param, lid) in LIMITS)
# An allowed answer for three counters, as acquire.lua packs it.
ANSWER = "do return struct.pack('>Bdddddddddd', 1, now, 0, 0, 0, 0, 0, 0, 0, 0, 0) end\n"


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def cut(text, before):
    """acquire.lua answering just before its first line starting with `before`."""
    at = text.index("\n" + before) + 1
    return text[:at] + ANSWER + text[at:]


def variants():
    acquire = read("lua/acquire.lua")
    constant = struct.pack(">Bdddddddddd", 1, *range(10))
    return {
        "acquire.lua": acquire,
        "no writes": cut(acquire, "local charged = "),
        "header only": cut(acquire, "-- The answer per counter"),
        "batch only": "return '" + "".join("\\%d" % b for b in constant) + "'\n",
        "redis_null.lua": read("bench/redis_null.lua"),
    }


def run(acquire, batch):
    """redis-server's CPU µs per decision for `acquire` in batches of `batch`."""
    port = free_port()
    server = subprocess.Popen(redis_args(port), stdout=subprocess.DEVNULL)
    try:
        wait_port(port)
        r = redis.Redis(port=port)
        sha = r.script_load(read("lua/batch.lua").replace("--@acquire.lua\n", acquire + "\n", 1))
        nonce = 0

        def call():
            nonlocal nonce
            args = []
            for _ in range(batch):
                nonce += 1
                args.append(struct.pack(">Bddd", 1, -1.0, 1.0, float(nonce)) + SPEC)
            return ["EVALSHA", sha, batch] + [KEY] * batch + [bytes([1] * (batch + 1))] + args

        first = r.execute_command(*call())
        if len(first) != batch or not all(isinstance(a, bytes) and a[:1] == b"\x01" for a in first):
            sys.exit(f"redis_parts: not an allowed answer: {first[:2]}")
        calls = [call() for _ in range(DECISIONS // batch)]
        before = cpu_seconds(server.pid)
        for i in range(0, len(calls), 50):
            pipe = r.pipeline(transaction=False)
            for c in calls[i:i + 50]:
                pipe.execute_command(*c)
            pipe.execute()
        return (cpu_seconds(server.pid) - before) * 1e6 / (len(calls) * batch)
    finally:
        server.terminate()
        server.wait()


# (name, loop body): each runs a million times in one EVAL, after STEP_SETUP.
STEP_SETUP = ("local unpack_, pack_ = struct.unpack, struct.pack "
              "local spec = string.rep('\\0', 25) .. pack_('>BBdddc8', 1, 1, 1e9, 1000, 1000, 'abcdefgh') "
              "local raw = string.rep('x', 400) ")
STEPS = [("struct.unpack of a counter ('>BBdddc8')", "local k, a, l, w, p, t = unpack_('>BBdddc8', spec, 26)"),
         ("struct.pack of a fixed record ('>c8I2dd')", "local r = pack_('>c8I2dd', 'abcdefgh', 16, i, i)"),
         ("a 335-byte string (string.sub)", "local s = raw:sub(i % 40 + 1, i % 40 + 335)"),
         ("a 9-byte string (string.sub)", "local s = raw:sub(i % 40 + 1, i % 40 + 9)")]


def step_costs():
    """redis-server's CPU ns per step of STEPS."""
    port = free_port()
    server = subprocess.Popen(redis_args(port), stdout=subprocess.DEVNULL)
    try:
        wait_port(port)
        r = redis.Redis(port=port)
        costs = {}
        for name, body in [("empty loop", "")] + STEPS:
            before = cpu_seconds(server.pid)
            r.eval(f"{STEP_SETUP} for i = 1, 1000000 do {body} end return 1", 0)
            costs[name] = (cpu_seconds(server.pid) - before) * 1e3
        return {name: ns - costs["empty loop"] for name, ns in costs.items() if name != "empty loop"}
    finally:
        server.terminate()
        server.wait()


def main():
    runs = [(name, text, BATCH) for name, text in variants().items()]
    runs += [(f"acquire.lua, {b} a call", variants()["acquire.lua"], b) for b in (5, 100) if b != BATCH]
    figures = {name: [] for name, _, _ in runs}
    for _ in range(ROUNDS):
        for name, text, batch in runs:
            figures[name].append(run(text, batch))
    print(f"redis-server CPU per decision, one identity, {BATCH} decisions a call unless said, "
          f"median of {ROUNDS} rounds of {DECISIONS} decisions:")
    for name, us in figures.items():
        print(f"  {name:24} {statistics.median(us):5.2f} us  ({' '.join(f'{u:.2f}' for u in us)})")
    steps = [step_costs() for _ in range(ROUNDS)]
    print(f"a step of the script, redis-server CPU, median of {ROUNDS}:")
    for name, _ in STEPS:
        print(f"  {name:44} {statistics.median(s[name] for s in steps):5.0f} ns")


if __name__ == "__main__":
    main()
