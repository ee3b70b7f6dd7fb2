"""``--client-processes P``: a tier's open-loop load sent from P processes instead of this one.

One asyncio loop in one process spends ~1 ms of CPU a request and ~85 us a chunk on its gRPC
streams (the bench notes: ~0.33 ms per audio second, 0.52 core at 2,048 streams past capacity in
run 45), so two pairs' load would make the load generator itself the limit and add its own
lateness to every time it measures. The pool's processes are started beside the stages, before
this process imports grpc (a process must not fork after that), and live for the run. For each
poisson or burst tier every process gets the whole config and its share (arrival i is process
i mod P's) and one start instant on the machine's monotonic clock; each sends its share on its own
connections (request i on connection i mod N, as one process would) and answers with its traces
as JSON (no pickle across processes); their traces together are summarized as one run. The
closed loop, the sequential C=1 tier and the warm-up's closed rounds stay in this process.

    python -m bench.server.load_pool   # a pool process: JSON lines in on stdin, out on stdout
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import selectors
import subprocess
import sys
import time

SHAREABLE = ("poisson", "burst")  # the loads a pool splits
START_MARGIN_S = 1.0   # the shared start instant, this far after the request: every process is ready
ANSWER_MARGIN_S = 60.0  # past a run's bound, a process that has not answered is taken as lost
TUPLE_FIELDS = ("audio_seconds", "idle_gaps_s", "more_targets")


def config_json(config) -> dict:
    """A BenchConfig as JSON (the bench's: no TLS material to carry)."""
    if config.root_certificates is not None or config.token is not None:
        raise ValueError("config: the pool carries no token or certificates (the bench uses neither)")
    return dataclasses.asdict(config)


def config_from_json(data: dict):
    from voxring.loadgen import BenchConfig

    return BenchConfig(**{k: tuple(v) if k in TUPLE_FIELDS and v is not None else v for k, v in data.items()})


def traces_from_json(rows: list[dict]) -> list:
    from voxring.loadgen import RequestTrace

    return [RequestTrace(**{**row, "arrivals": [tuple(a) for a in row["arrivals"]]}) for row in rows]


class LoadPool:
    """P processes that send shares of a tier's open-loop load; ``close()`` ends them."""

    def __init__(self, processes: int, env: dict[str, str], cwd) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-m", "bench.server.load_pool"], env=env, cwd=cwd,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(processes)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, config) -> dict:
        """The run's report (as ``run_load``'s), its parts sent by the pool's processes."""
        from voxring.loadgen import summarize

        if not self.procs or any(p.poll() is not None for p in self.procs):
            raise RuntimeError("load pool: closed, or a process of it ended")
        start_at = time.perf_counter() + START_MARGIN_S
        for index, proc in enumerate(self.procs):
            proc.stdin.write(json.dumps({"config": config_json(config), "index": index, "of": len(self.procs),
                                         "start_at": start_at}) + "\n")
            proc.stdin.flush()
        try:
            answers = self._answers(start_at + config.max_total_s + ANSWER_MARGIN_S)
        except RuntimeError:
            self.close()  # the others' answers would be read as the next run's: the pool is done
            raise
        traces = [t for answer in answers for t in traces_from_json(answer["traces"])]
        return summarize(config, traces, max(a["wall_s"] for a in answers),
                         timed_out=any(a["timed_out"] for a in answers),
                         loop_lag=[x for a in answers for x in a["loop_lag"]]).to_dict()

    def _answers(self, deadline: float) -> list[dict]:
        """Each process's answer line, in order; RuntimeError for one that died, failed or is late."""
        answers: dict[int, dict] = {}
        with selectors.DefaultSelector() as sel:
            for index, proc in enumerate(self.procs):
                sel.register(proc.stdout, selectors.EVENT_READ, index)
            while len(answers) < len(self.procs):
                ready = sel.select(timeout=max(0.0, deadline - time.perf_counter()))
                if not ready:
                    late = len(self.procs) - len(answers)
                    raise RuntimeError(f"load pool: {late} process(es) did not answer within the run's bound")
                for key, _ in ready:
                    line = key.fileobj.readline()
                    sel.unregister(key.fileobj)
                    if not line:
                        raise RuntimeError(f"load pool: process {key.data} ended (exit "
                                           f"{self.procs[key.data].wait(timeout=5)})")
                    answer = json.loads(line)
                    if "error" in answer:
                        raise RuntimeError(f"load pool: process {key.data}: {answer['error']}")
                    answers[key.data] = answer
        return [answers[i] for i in range(len(self.procs))]

    def close(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()  # its end of input: it exits
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()


def _serve() -> int:
    """A pool process: for each request line, its share of the run; one answer line each."""
    from voxring.loadgen import Share, run_traces

    for line in sys.stdin:
        try:
            request = json.loads(line)
            config = config_from_json(request["config"])
            share = Share(request["index"], request["of"], request["start_at"])
            got = asyncio.run(run_traces(config, share))
            answer = {"traces": [dataclasses.asdict(t) for t in got.traces], "wall_s": got.wall_s,
                      "timed_out": got.timed_out, "loop_lag": got.loop_lag}
        except Exception as exc:  # the parent reports it and stops the run
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
