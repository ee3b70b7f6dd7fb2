"""Cross-process latency and throughput of the frame transports: the shared-memory ring
vs the gRPC fallback on loopback, in one run, for 64 B and 4 KiB records.

    .venv/bin/python -m bench.transport.ring_latency [--quick]

Producer and consumer are separate processes started with subprocess; the producer
stamps CLOCK_MONOTONIC ns into the first 8 bytes of each record just before ``put``,
the consumer reads the clock as ``get`` returns. Cases, per transport and size:

- idle:        records ~1 ms apart (the producer sleeps), so the consumer's 50 us spin
               has ended and it sleeps on the semaphore: latency of a woken consumer,
               processes placed by the scheduler;
- idle_split:  (ring) as idle, producer and consumer pinned to different CPUs: the
               woken consumer's CPU is idle and must be woken too;
- busy:        the consumer spins (never sleeps); records are paced just far enough
               apart not to queue: 10 us for the ring (busy-waiting), 300 us for gRPC
               (sleeping, so its server thread in the producer process gets the GIL);
- busy_sparse: (ring) as busy but 100 us apart: on a shared VM, code that has not run
               for ~30 us runs several times slower, and this shows that cost;
- throughput:  records back to back, the consumer reading batches of up to 256:
               records/s and MB/s of codes on the consumer's clock.

Every case but idle pins the producer to CPU 0 and the consumer to CPU 1.

Reference rows measure a bare posix_ipc semaphore wake-up (same 50 us spin before
sleeping, no ring), placed and pinned: the floor under the ring's idle cases here.

Writes bench/results/transport/ring_latency.json and prints a table. Targets (issue 5): idle p50
<= 25 us, busy p50 <= 5 us, ring busy p50 >= 10x lower than gRPC busy p50.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE = "bench.transport.ring_latency"  # the producer and consumer processes run this module too

SIZES = (64, 4096)  # bytes of codes per record
NUM_CODEBOOKS = 32  # 64 B = one CSM frame of 32 codebooks
PATTERNS = {"shm": ("idle", "idle_split", "busy", "busy_sparse", "throughput"),
            "grpc": ("idle", "busy", "throughput")}
GAP_S = {("shm", "idle"): 1e-3, ("shm", "idle_split"): 1e-3, ("shm", "busy"): 10e-6,
         ("shm", "busy_sparse"): 100e-6, ("grpc", "idle"): 1e-3, ("grpc", "busy"): 300e-6,
         ("sem", "idle"): 1e-3, ("sem", "idle_split"): 1e-3}
COUNTS = {("shm", "idle"): 2000, ("shm", "idle_split"): 2000, ("shm", "busy"): 20_000,
          ("shm", "busy_sparse"): 5000, ("shm", "throughput"): 200_000, ("grpc", "idle"): 2000,
          ("grpc", "busy"): 3000, ("grpc", "throughput"): 50_000, ("sem", "idle"): 2000,
          ("sem", "idle_split"): 2000}
WARMUP = 200  # records left out of the latency statistics
CAPACITY = 4 << 20
SPIN_US = 50


def pin(role: str, pattern: str) -> None:
    """Every case but "idle" runs producer and consumer on CPUs 0 and 1: two spinning
    processes must not share one CPU. "idle" leaves placement to the scheduler."""
    if pattern != "idle" and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0 if role == "producer" else 1})


def count_for(kind: str, pattern: str, quick: bool) -> int:
    count = COUNTS[(kind, pattern)]
    return max(WARMUP * 2, count // 10) if quick else count


# --- producer process ----------------------------------------------------------------


def open_bench_producer(kind: str):
    """(producer, endpoint dict, server or None): the talker's side of one edge."""
    from services.transport.grpc_producer import FrameStreamServer, FrameStreamServicer, GrpcProducer
    from services.transport.shm_producer import RingProducer

    if kind == "shm":
        ring = RingProducer.create(secrets.randbits(64), "bench", 0, CAPACITY, liveness_timeout=30.0)
        return ring, {"ring_name": ring.name}, None
    servicer = FrameStreamServicer()
    server = FrameStreamServer(servicer, "127.0.0.1:0")
    address = server.start()
    producer = GrpcProducer("bench", CAPACITY, liveness_timeout=30.0)
    servicer.register(producer)
    return producer, {"address": address}, server


def pace(gap_s: float, kind: str, pattern: str) -> None:
    """Waits between records. The ring's busy cases busy-wait (a sleep cannot wait 10 us);
    gRPC always sleeps, so that its server thread in this process gets the GIL."""
    if pattern.startswith("busy") and kind == "shm":
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass
    elif gap_s:
        time.sleep(gap_s)


def run_producer(args) -> None:
    import numpy as np

    pin("producer", args.pattern)
    producer, endpoint, server = open_bench_producer(args.kind)
    try:
        Path(args.ready).write_text(json.dumps(endpoint))
        deadline = time.monotonic() + 60
        while not producer.consumer_attached and time.monotonic() < deadline:
            producer.tick()
            time.sleep(0.005)
        time.sleep(0.2)  # the consumer is in its loop
        codes = np.zeros((args.size // (2 * NUM_CODEBOOKS), NUM_CODEBOOKS), dtype=np.int16)
        stamp = codes.reshape(-1).view("<u8")  # the first 8 bytes of the codes
        gap = GAP_S.get((args.kind, args.pattern), 0.0)
        last_tick = time.monotonic()
        for seq in range(args.count):
            pace(gap, args.kind, args.pattern)
            if time.monotonic() - last_tick > 0.05:
                producer.tick()
                last_tick = time.monotonic()
            stamp[0] = time.monotonic_ns()
            producer.put(codes, handle=1, seq=seq, flags=1 if seq == args.count - 1 else 0, timeout=30.0)
        producer.close()
    finally:
        if server is not None:
            server.stop(grace=1.0)


# --- consumer process ----------------------------------------------------------------


def open_bench_consumer(kind: str, endpoint: dict, pattern: str):
    from services.transport.grpc_consumer import GrpcConsumer
    from services.transport.shm_consumer import RingConsumer

    if kind == "shm":
        spin_us = SPIN_US if pattern.startswith("idle") else 10_000_000  # busy: never sleeps
        return RingConsumer.attach(endpoint["ring_name"], spin_us=spin_us, liveness_timeout=30.0)
    return GrpcConsumer(endpoint["address"], "bench", secrets.randbits(64), capacity_bytes=CAPACITY,
                        liveness_timeout=30.0)


def stamp_of(view) -> int:
    return int(view.codes.reshape(-1)[:4].view("<u8")[0])


def run_consumer(args) -> None:
    import numpy as np

    pin("consumer", args.pattern)
    consumer = open_bench_consumer(args.kind, json.loads(Path(args.ready).read_text()), args.pattern)
    latencies = np.zeros(args.count, dtype=np.int64)
    received, first_ns, last_ns = 0, 0, 0
    try:
        consumer.tick()
        while received < args.count:
            if args.pattern == "throughput":
                batch = consumer.get_batch(256, timeout=1.0)
                now = time.monotonic_ns()
                first_ns, last_ns = first_ns or now, now if batch else last_ns
                received += len(batch)
            else:  # one record at a time, the clock read as get returns
                view = consumer.get(timeout=1.0)
                now = time.monotonic_ns()
                if view is not None:
                    latencies[received] = now - stamp_of(view)
                    received += 1
            consumer.release()
            consumer.tick()
    finally:
        consumer.close()
    Path(args.result).write_text(json.dumps({
        "latencies_ns": latencies[WARMUP:].tolist() if args.pattern != "throughput" else [],
        "records": received, "span_ns": last_ns - first_ns}))


# --- the bare semaphore reference ------------------------------------------------------


def run_bare_semaphore(count: int, pattern: str) -> list[int]:
    """Two processes, a shared stamp and a posix_ipc semaphore: the consumer spins 50 us,
    sleeps on the semaphore, reads the clock when woken. Returns latencies in ns."""
    import posix_ipc

    name = f"/voxring-bench-{secrets.randbits(64):016x}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    try:
        command = [sys.executable, "-m", MODULE, "--role", "sem-consumer", "--ready", name,
                   "--count", str(count), "--pattern", pattern]
        consumer = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE)
        pin("producer", pattern)
        mm = mmap_of(shm)
        ctl = memoryview(mm).cast("Q")
        while ctl[1] == 0 and consumer.poll() is None:
            time.sleep(0.01)
        for _ in range(count):
            time.sleep(GAP_S[("sem", pattern)])
            ctl[0] = time.monotonic_ns()
            sem.release()
        out, _ = consumer.communicate(timeout=60)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        ctl.release()
        mm.close()
        return json.loads(out)
    finally:
        posix_ipc.unlink_shared_memory(name)
        sem.unlink()


def mmap_of(shm):
    import mmap

    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    return mm


def run_sem_consumer(args) -> None:
    import posix_ipc

    pin("consumer", args.pattern)
    shm, sem = posix_ipc.SharedMemory(args.ready), posix_ipc.Semaphore(args.ready)
    mm = mmap_of(shm)
    ctl = memoryview(mm).cast("Q")
    ctl[1] = 1  # attached
    latencies = []
    for _ in range(args.count):
        until = time.perf_counter() + SPIN_US * 1e-6
        while time.perf_counter() < until:
            pass
        sem.acquire(5.0)
        latencies.append(time.monotonic_ns() - ctl[0])
    print(json.dumps(latencies[WARMUP:]))


# --- orchestration -------------------------------------------------------------------


def run_case(kind: str, size: int, pattern: str, count: int, workdir: Path) -> dict:
    ready, result = workdir / f"{kind}-{size}-{pattern}.ready", workdir / f"{kind}-{size}-{pattern}.json"
    common = ["--kind", kind, "--size", str(size), "--pattern", pattern, "--count", str(count),
              "--ready", str(ready), "--result", str(result)]
    script = [sys.executable, "-m", MODULE]
    producer = subprocess.Popen([*script, "--role", "producer", *common], cwd=REPO)
    consumer = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if producer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} producer did not start")
            time.sleep(0.01)
        consumer = subprocess.Popen([*script, "--role", "consumer", *common], cwd=REPO)
        consumer.wait(timeout=300)
        producer.wait(timeout=60)
    finally:
        for proc in (producer, consumer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    data = json.loads(result.read_text())
    case = {"transport": kind, "record_bytes": size, "pattern": pattern, "records": data["records"]}
    if pattern == "throughput":
        seconds = data["span_ns"] / 1e9
        case.update(records_per_s=round(data["records"] / seconds),
                    mb_per_s=round(data["records"] * size / seconds / 1e6, 1))
    else:
        case.update(latency_stats(kind, pattern, data["latencies_ns"]))
    return case


def latency_stats(kind: str, pattern: str, latencies_ns: list[int]) -> dict:
    import numpy as np

    lat_us = np.array(latencies_ns) / 1e3
    return {"gap_us": round(GAP_S[(kind, pattern)] * 1e6, 1),
            "p50_us": round(float(np.percentile(lat_us, 50)), 1),
            "p99_us": round(float(np.percentile(lat_us, 99)), 1), "mean_us": round(float(lat_us.mean()), 1)}


def machine_info() -> dict:
    import grpc
    import numpy as np
    import posix_ipc

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain"))
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "grpc": grpc.__version__,
            "posix_ipc": posix_ipc.VERSION, "commit": commit, "uncommitted_changes": dirty,
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}


def verdict(cases: list[dict]) -> dict:
    def p50(kind: str, size: int, pattern: str) -> float:
        return next(c["p50_us"] for c in cases
                    if (c["transport"], c["record_bytes"], c["pattern"]) == (kind, size, pattern))

    out = {}
    for size in SIZES:
        out[f"{size}B"] = {
            "idle_p50_le_25us": p50("shm", size, "idle") <= 25,
            "busy_p50_le_5us": p50("shm", size, "busy") <= 5,
            "busy_10x_below_grpc": p50("grpc", size, "busy") >= 10 * p50("shm", size, "busy"),
            "busy_speedup_vs_grpc": round(p50("grpc", size, "busy") / p50("shm", size, "busy"), 1)}
    return out


def table(cases: list[dict]) -> str:
    lines = ["| transport | record | case | p50 µs | p99 µs | records/s | MB/s |",
             "|---|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c['transport']} | {c['record_bytes']} B | {c['pattern']} | {c.get('p50_us', '')} | "
                     f"{c.get('p99_us', '')} | {c.get('records_per_s', '')} | {c.get('mb_per_s', '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("bench", "producer", "consumer", "sem-consumer"), default="bench")
    parser.add_argument("--kind", choices=("shm", "grpc"))
    parser.add_argument("--size", type=int)
    parser.add_argument("--pattern", choices=PATTERNS["shm"])
    parser.add_argument("--count", type=int)
    parser.add_argument("--ready")
    parser.add_argument("--result")
    parser.add_argument("--quick", action="store_true", help="a tenth of the records (a smoke run)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "transport" / "ring_latency.json"))
    args = parser.parse_args()
    if args.role == "producer":
        return run_producer(args)
    if args.role == "consumer":
        return run_consumer(args)
    if args.role == "sem-consumer":
        return run_sem_consumer(args)
    started, machine = time.monotonic(), machine_info()  # the load before this run adds its own
    cases = []
    with tempfile.TemporaryDirectory(prefix="vx-bench-") as tmp:
        for size in SIZES:
            for kind in ("shm", "grpc"):
                for pattern in PATTERNS[kind]:
                    count = count_for(kind, pattern, args.quick)
                    cases.append(run_case(kind, size, pattern, count, Path(tmp)))
                    print(json.dumps(cases[-1]), flush=True)
    for pattern in ("idle", "idle_split"):
        bare = run_bare_semaphore(count_for("sem", pattern, args.quick), pattern)
        cases.append({"transport": "posix semaphore alone (reference)", "record_bytes": 8, "pattern": pattern,
                      "records": len(bare) + WARMUP, **latency_stats("sem", pattern, bare)})
        print(json.dumps(cases[-1]), flush=True)
    report = {"machine": machine, "wall_s": round(time.monotonic() - started, 1),
              "warmup_records": WARMUP, "cases": cases, "targets_met": verdict(cases)}
    if not args.quick:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(cases))
    print(json.dumps(report["targets_met"], indent=2))


if __name__ == "__main__":
    main()
