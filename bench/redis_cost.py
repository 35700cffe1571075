#!/usr/bin/env python3
"""Redis cost of sluice's decision script, measured on a private redis-server.

For the policy 10/1s + 120/1m + 240/1h (precision 1m), it reports:
  - Redis CPU microseconds per decision (INFO commandstats, evalsha usec_per_call),
    with every identity's hour window full (60 live buckets);
  - bytes of Redis memory per identity once its hour window is full
    (INFO memory used_memory, over IDENTITIES identities, minus the empty baseline).

It drives lua/acquire.lua exactly as sluice does (same keys, same arguments, the
local clock mode so that an hour of traffic can be replayed in seconds), and
the same for bench/seed_reference.lua, the seed articles' hash layout, each on
its own redis-server, their timed minutes interleaved: both figures are also
given as a ratio to the reference, which holds still when the machine's load
moves the microseconds. Three spells of four minutes are timed, each on its own:
the CPU per decision reported is the quietest spell's (a neighbour on a shared
machine only ever adds time), the ratio the median of the spells' ratios, and
every spell's figures follow on a line of their own. A third server replays the
same minutes through bench/redis_floor.lua, which reads and rewrites a string of
acquire.lua's size and answers as it does, with no counting: the floor that any
script keeping an identity in one key pays on this machine. Four minutes, because the
script moves an identity's expiry every fourth call at this traffic (see
lua/acquire.lua): each spell has the long run's mix, one such call in four.
A fourth server replays the same minutes as sluice sends decisions that queue
together on its connection: BATCH decisions a call of lua/batch.lua (with
acquire.lua's text in it, as src/store/redis.rs makes it), its CPU per decision
the call's divided by BATCH; each decision is a distinct identity here, so no
key is shared within a call. For it and for one decision a call, the
redis-server process's own CPU (utime + stime) per decision is given too:
what batching saves is mostly outside the script (reading and parsing
commands, setting a call up, answering it), which `usec_per_call` leaves out.
Last, one busy identity (as one client sending many requests at once, or a
`global` limit): its decisions one a call, and BATCH a call, on two more
servers, with Redis TIME as the clock (sluice's default) and limits high
enough never to refuse; redis-server's process CPU per decision for each.

    python3 bench/redis_cost.py [IDENTITIES [BATCH]]   # needs redis-server and `pip install redis`
"""
import base64
import hashlib
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time

import redis

from bench import free_port  # the bench's own helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDENTITIES = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
# Decisions a batched call holds: about what sluice's connection gathers at
# wrk -c50 (bench.py's `redis calls` per request, 0.04 to 0.07).
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 20
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


def ip_of(i):
    """Identity number `i`'s client address."""
    return "10.%d.%d.%d" % (i >> 16 & 255, i >> 8 & 255, i & 255)


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


class Replay:
    """One script's hour of traffic on its own fresh redis-server: one request
    per identity per minute. `call(script, pipe, i, ip, now_ms)` queues one
    decision; with `batch`, `call(script, pipe, [(i, ip), ...], now_ms)`
    queues `batch` decisions as one call."""

    def __init__(self, script_file, identities, call, batch=None):
        self.server, self.r = start_redis()
        text = script_file if batch else open(script_file).read()
        self.script = self.r.register_script(text)
        self.identities, self.call, self.batch = identities, call, batch
        self.base = self.r.info("memory")["used_memory"]

    def chunks(self, minute, size):
        """The minute's decisions, `size` identities at a time (a generator)."""
        now = 1_800_000_000_000 + minute * 60000
        for first in range(0, self.identities, size):
            pipe = self.r.pipeline(transaction=False)
            ids = range(first, min(first + size, self.identities))
            if self.batch:
                for at in range(0, len(ids), self.batch):
                    self.call(self.script, pipe, [(i, ip_of(i)) for i in ids[at:at + self.batch]], now)
            else:
                for i in ids:
                    self.call(self.script, pipe, i, ip_of(i), now)
            answers = pipe.execute()
            if self.batch:
                answers = [x for call in answers for x in call]
            # A refusal would make either script look cheaper than it is.
            assert all(x == 0 or isinstance(x, bytes) and x[:1] == b"\x01"
                       for x in answers), "a decision was refused"
            yield

    def fill(self, size):
        """Gives each identity a string of `size` bytes that lives an hour
        (for bench/redis_floor.lua, which only reads and rewrites it)."""
        for first in range(0, self.identities, 500):
            pipe = self.r.pipeline(transaction=False)
            for i in range(first, min(first + 500, self.identities)):
                pipe.set(key_for(ip_of(i)), b"\1" + bytes(size - 1), px=3_600_000)
            pipe.execute()

    def cpu(self):
        return cpu_of(self.server)

    def usec_per_call(self):
        """Per decision: a batched call's divided by the decisions it holds
        (the last call of a chunk may hold fewer: 500 is a multiple of the
        usual sizes)."""
        return self.r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"] / (self.batch or 1)

    def bytes_per_identity(self):
        return (self.r.info("memory")["used_memory"] - self.base) // self.identities

    def stop(self):
        self.server.terminate()
        self.server.wait()


SPELLS, SPELL_MINUTES = 3, 4


def measure(ours, ref, floor, batched):
    """Fills the hours (60 live buckets per identity) and the floor's strings,
    then times more minutes of each in spells, the scripts' chunks
    interleaved so that all meet the same machine (the usual neighbours move
    a lone figure by a third or more). Returns each spell's (ours, reference,
    floor, batched) CPU microseconds per decision, and its (ours, batched)
    redis-server process CPU microseconds per decision."""
    for minute in range(59):
        for replay in (ours, ref, batched):
            for _ in replay.chunks(minute, 500):
                pass
    floor.fill(len(ours.r.get(key_for(ip_of(0)))))
    # Chunk sizes in proportion, so all end each minute together.
    others = [(replay, max(1, 500 * replay.identities // ours.identities)) for replay in (ref, floor, batched)]
    timed, process = [], []
    for spell in range(SPELLS):
        for replay in (ours, ref, floor, batched):
            replay.r.config_resetstat()
        cpu = [ours.cpu(), batched.cpu()]
        for minute in range(59 + spell * SPELL_MINUTES, 59 + (spell + 1) * SPELL_MINUTES):
            theirs = [replay.chunks(minute, size) for replay, size in others]
            for _ in ours.chunks(minute, 500):
                for chunks in theirs:
                    next(chunks, None)
            for chunks in theirs:
                for _ in chunks:
                    pass
        timed.append((ours.usec_per_call(), ref.usec_per_call(), floor.usec_per_call(),
                      batched.usec_per_call()))
        decisions = SPELL_MINUTES * ours.identities
        process.append(((ours.cpu() - cpu[0]) * 1e6 / decisions,
                        (batched.cpu() - cpu[1]) * 1e6 / (SPELL_MINUTES * batched.identities)))
    return timed, process


def sluice_call(script, pipe, i, ip, now):
    script(keys=[key_for(ip)], args=[struct.pack(">Bddd", 1, now, 1, i) + SPEC], client=pipe)


def batched_call(script, pipe, decisions, now):
    """lua/batch.lua's call: every decision's keys; whether a key is more than
    one decision's (no: each is an identity of its own), and how many keys are
    each one's (a byte each); then each one's argument."""
    script(keys=[key_for(ip) for _, ip in decisions],
           args=[bytes([0] + [1] * len(decisions))] + [struct.pack(">Bddd", 1, now, 1, i) + SPEC for i, _ in decisions],
           client=pipe)


def batch_text():
    """lua/batch.lua with acquire.lua's text in place of its marker line, as
    src/store/redis.rs makes it."""
    with open(os.path.join(ROOT, "lua", "batch.lua")) as f:
        batch = f.read()
    with open(os.path.join(ROOT, "lua", "acquire.lua")) as f:
        acquire = f.read()
    return batch.replace("--@acquire.lua\n", acquire + "\n", 1)


# The same policy for bench/seed_reference.lua: [window s, limit, precision s].
SEED_LIMITS = "[[1,10],[60,120],[3600,240,60]]"


def seed_call(script, pipe, i, ip, now):
    script(keys=["seed:" + ip], args=[SEED_LIMITS, now / 1000, 1], client=pipe)


# The policy's limits, high enough that one identity's decisions all pass.
BUSY_SPEC = b"".join(struct.pack(">BBdddQ", 1, alg, 1e9, window, param, tag(lid))
                     for (_, window, alg, param, lid) in LIMITS)


def busy_identity(decisions=100000, spells=3):
    """One identity's decisions on two fresh servers, one a call and BATCH a
    call, 500 a pipeline, the two interleaved; each spell's process CPU
    microseconds per decision (one a call, batched)."""
    single, batched = start_redis(), start_redis()
    try:
        key = key_for(ip_of(0))
        one = single[1].register_script(open(os.path.join(ROOT, "lua", "acquire.lua")).read())
        many = batched[1].register_script(batch_text())
        arg = lambda n: struct.pack(">Bddd", 1, -1, 1, n) + BUSY_SPEC
        out = []
        for spell in range(spells + 1):
            cpu = [cpu_of(single[0]), cpu_of(batched[0])]
            for first in range(0, decisions, 500):
                p = single[1].pipeline(transaction=False)
                for n in range(first, first + 500):
                    one(keys=[key], args=[arg(n)], client=p)
                p.execute()
                p = batched[1].pipeline(transaction=False)
                for n in range(first, first + 500, BATCH):
                    # Every decision's key is the same one: the first byte says so.
                    many(keys=[key] * BATCH, args=[bytes([1] + [1] * BATCH)] + [arg(n + j) for j in range(BATCH)],
                         client=p)
                p.execute()
            # (The first spell only fills the key.)
            if spell:
                out.append(tuple((cpu_of(srv[0]) - c) * 1e6 / decisions for srv, c in zip((single, batched), cpu)))
        return out
    finally:
        for server, _ in (single, batched):
            server.terminate()
            server.wait()


def cpu_of(server):
    """A server process's CPU seconds so far (utime + stime)."""
    with open("/proc/%d/stat" % server.pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    # Stopped by bench.py (or a user) with SIGTERM: through the `finally`
    # below, which stops the Redis servers.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    # The reference's cost per call and per identity does not grow with the
    # number of identities (each hash is small), so fewer keep the run short.
    ref_ids = min(IDENTITIES, 10000)
    started = []
    try:
        ours = Replay(os.path.join(ROOT, "lua", "acquire.lua"), IDENTITIES, sluice_call)
        started.append(ours)
        ref = Replay(os.path.join(ROOT, "bench", "seed_reference.lua"), ref_ids, seed_call)
        started.append(ref)
        floor = Replay(os.path.join(ROOT, "bench", "redis_floor.lua"), ref_ids, sluice_call)
        started.append(floor)
        batched = Replay(batch_text(), IDENTITIES, batched_call, BATCH)
        started.append(batched)
        timed, process = measure(ours, ref, floor, batched)
        size, ref_size = ours.bytes_per_identity(), ref.bytes_per_identity()
    finally:
        for replay in started:
            replay.stop()
    print("identities: %d (seed reference: %d)" % (IDENTITIES, ref_ids))
    usec, ref_usec, floor_usec, batched_usec = min(timed)
    ratio = statistics.median(u / r for u, r, _, _ in timed)
    print("redis CPU per decision (hour window full): %.2f us = %.2fx the seed reference (%.2f us)"
          % (usec, ratio, ref_usec))
    print("  the quietest of %d timed spells of %d minutes, with the seed reference's in that spell;"
          " the ratio is the median of the spells' ratios. Each spell, us per decision (seed"
          " reference; floor): %s" % (len(timed), SPELL_MINUTES,
                                      ", ".join("%.2f (%.2f; %.2f)" % t[:3] for t in timed)))
    print("redis CPU floor per decision: %.2f us = %.2fx the seed reference; sluice's script is %.2fx it"
          % (floor_usec, statistics.median(f / r for _, r, f, _ in timed),
             statistics.median(u / f for u, _, f, _ in timed)))
    print("  (bench/redis_floor.lua: the GET, the SET and the answer of a script that keeps an"
          " identity in one string, with no counting; what Redis itself costs on this machine)")
    print("redis CPU batched, %d decisions a call (lua/batch.lua): %.2f us a decision, %.2fx one a call"
          " (the median of the spells' ratios; each spell: %s)"
          % (BATCH, batched_usec, statistics.median(b / u for u, _, _, b in timed),
             ", ".join("%.2f" % t[3] for t in timed)))
    one, many = min(process)
    print("redis process CPU per decision (utime + stime, networking included): %.2f us one a call, %.2f us"
          " batched by %d = %.2fx (the quietest spell; the ratio the median of the spells'; each spell: %s)"
          % (one, many, BATCH, statistics.median(b / u for u, b in process),
             ", ".join("%.2f; %.2f" % p for p in process)))
    busy = busy_identity()
    one, many = min(busy)
    print("redis process CPU per decision, one busy identity: %.2f us one a call, %.2f us batched by %d = %.2fx"
          " (the quietest spell; the ratio the median of the spells'; each spell: %s)"
          % (one, many, BATCH, statistics.median(b / u for u, b in busy), ", ".join("%.2f; %.2f" % p for p in busy)))
    print("redis memory per identity (hour window full): %d bytes = %.2fx the seed reference (%d bytes)"
          % (size, size / ref_size, ref_size))


if __name__ == "__main__":
    main()
