"""The voxring command: run a local stack and talk to a server.

``up``, ``down``, ``status`` and ``demo`` run the local stack (``up`` starts what is not
running, a stage that died included; ``status`` says which died and shows its log);
``say``, ``voices`` (``voices add``, ``voices rm``) and ``bench`` use a server's public API
(with ``--token-file`` and ``--tls-ca`` for a gateway that wants them); ``health`` asks a
service's gRPC health (for container probes).

Imports neither torch nor the engines. grpc is imported only by the commands that talk
to a server (``voxring.client`` is loaded inside them): ``up`` spawns processes, and a
process must not fork after importing grpc.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from voxring.bench_cli import DESCRIPTION as BENCH_DESCRIPTION
from voxring.bench_cli import add_bench_arguments
from voxring.cli_connection import (
    UsageError,
    add_connection_options,
    add_tls_options,
    client_arguments,
    tls_options,
)
from voxring.cli_say import add_say_arguments, cmd_say, fix_wav_sizes
from voxring.mps_daemon import MODES
from voxring.stack import STAGES, Stack, StackError, find_root
from voxring.voices_cli import DESCRIPTION as VOICES_DESCRIPTION
from voxring.voices_cli import add_voices_arguments

__all__ = ["cmd_say", "fix_wav_sizes", "main"]  # say lives in voxring/cli_say.py


def _stack(args: argparse.Namespace) -> Stack:
    root = find_root(args.root)
    config_dir = (args.config_dir or root / "deploy" / "configs").resolve()
    state_dir = (args.state_dir or root / ".voxring").resolve()
    return Stack(root=root, config_dir=config_dir, state_dir=state_dir)


def _print_endpoints(addresses: dict[str, str], stack: Stack) -> None:
    for stage in STAGES:
        print(f"  {stage:<9} {addresses.get(stage, '?')}")
    http = stack.address("gateway", "http")
    if http is not None:
        print(f"  {'http':<9} {http} (OpenAI's /v1/audio/speech; the playground at /, docs at /docs)")


def cmd_up(args: argparse.Namespace) -> int:
    stack = _stack(args)
    missing = [stage for stage, (pid, _) in stack.status().items() if pid is None]
    if not missing:
        print("a voxring stack is already running; waiting until it serves")
    else:
        print(f"starting {', '.join(missing)} (logs in {stack.log_dir})")
    addresses = stack.up(timeout=args.timeout, mps=args.mps, model=args.model)
    print("voxring stack is SERVING:")
    _print_endpoints(addresses, stack)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stack = _stack(args)
    stopped = stack.down(timeout=args.timeout)
    print(f"stopped: {', '.join(stopped)}" if stopped else "no voxring stack is running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Each stage: running (and its health), stopped, or died (with its log's last lines);
    the gateway's readiness and each engine pair's. Exit 0 when all serve or none runs."""
    from voxring.health import check_health

    stack = _stack(args)
    healthy = stopped = 0
    for stage, (pid, address) in stack.status().items():
        if pid is None:
            died = stack.died(stage)
            stopped += 1
            if died is None:
                print(f"  {stage:<9} stopped")
            else:
                print(f"  {stage:<9} DIED (pid {died} is gone; `voxring up` starts it again). "
                      f"Last lines of {stack.log_file(stage)}:")
                for line in stack.log_tail(stage, args.log_lines).splitlines():
                    print(f"      {line}")
            continue
        health = check_health(address, "") if address else "starting"
        healthy += health == "SERVING"
        print(f"  {stage:<9} running, pid {pid}, {address or 'starting'}: {health}")
        if (client := stack.ready(stage).get("mps_client")) is not None:  # an engine on a GPU
            print(f"      {'an' if client else 'NOT an'} MPS client")
        if stage == "gateway" and address:
            for name, target in stack.gateway_pairs().items():  # as the gateway reports them
                print(f"      pair {name} ({target}): {check_health(address, f'pair/{name}')}")
            if (http := stack.address("gateway", "http")) is not None:
                print(f"      HTTP API on {http}")
    return 0 if stopped == len(STAGES) or healthy == len(STAGES) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """Brings the stack up (unless one runs), checks each stage and the public API,
    and takes the stack down again if it started it."""
    stack = _stack(args)
    started = not all(pid is not None for pid, _ in stack.status().values())
    addresses = stack.up(timeout=args.timeout)
    try:
        print("voxring stack is SERVING:")
        _print_endpoints(addresses, stack)
        from voxring.demo import check_public_api

        return check_public_api(addresses["gateway"])
    finally:
        if started:
            stack.down()
            print("stack stopped")


def cmd_voices(args: argparse.Namespace) -> int:
    """``voices`` (list), ``voices add`` and ``voices rm`` (voxring/voices_cli.py)."""
    from voxring.voices_cli import run_voices_command

    try:
        connection = client_arguments(args)
    except UsageError as exc:
        print(f"voxring voices: {exc}", file=sys.stderr)
        return 2
    return run_voices_command(args, connection)


def cmd_bench(args: argparse.Namespace) -> int:
    from voxring.bench_cli import run_bench_command

    try:
        connection = client_arguments(args)
    except UsageError as exc:
        print(f"voxring bench: {exc}", file=sys.stderr)
        return 2
    return run_bench_command(args, connection)


def cmd_health(args: argparse.Namespace) -> int:
    """Asks ADDRESS's standard gRPC health service (no token needed): prints the status
    and exits 0 for SERVING, else prints the status or the error and exits 1."""
    try:
        tls = tls_options(args)
    except UsageError as exc:
        print(f"voxring health: {exc}", file=sys.stderr)
        return 2
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from voxring.client import channel_security

    credentials, options = channel_security(**tls)
    channel = (grpc.insecure_channel(args.address, options=options) if credentials is None
               else grpc.secure_channel(args.address, credentials, options=options))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"voxring health: {args.address}: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _add_client_commands(sub) -> None:
    say = sub.add_parser("say", help="synthesize text into an audio file",
                         description="Synthesize TEXT, or standard input as it is written "
                                     "(--stream-stdin), into an audio file and report time to "
                                     "first audio, duration and real-time factor.")
    add_say_arguments(say, _positive)

    voices = sub.add_parser("voices", help="list, add (voices add) or remove (voices rm) voices",
                            description=VOICES_DESCRIPTION)
    voices.set_defaults(fn=cmd_voices)
    add_voices_arguments(voices, _positive, add_connection_options)

    bench = sub.add_parser("bench", help="load a server with streaming requests",
                           description=BENCH_DESCRIPTION)
    bench.set_defaults(fn=cmd_bench)
    add_bench_arguments(bench, _positive)
    for parser in (say, bench):
        add_connection_options(parser)

    health = sub.add_parser("health", help="check a service's gRPC health (container probes)",
                            description="Ask ADDRESS's standard gRPC health service. Prints the "
                                        "status; exits 0 when SERVING, 1 otherwise (or when it "
                                        "cannot be reached in time). Needs no token.")
    health.set_defaults(fn=cmd_health)
    health.add_argument("address", metavar="ADDRESS", help="HOST:PORT or unix:PATH")
    health.add_argument("--service", default="",
                        help="a service name, e.g. voxring.v1.Synthesizer (default: the server "
                             "as a whole)")
    health.add_argument("--timeout", type=_positive(float), default=2.0, help="deadline, seconds")
    add_tls_options(health)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxring", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None,
                        help="the voxring checkout (default: found from the working directory)")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="folder with gateway.yaml, talker.yaml, code2wav.yaml "
                             "(default: <root>/deploy/configs)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="pid, ready and log files (default: <root>/.voxring)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, timeout, text in (
        ("up", cmd_up, 60.0, "start the local stack and wait until it is SERVING"),
        ("down", cmd_down, 45.0, "stop the local stack gracefully"),
        ("status", cmd_status, 0.0, "show what runs"),
        ("demo", cmd_demo, 60.0, "bring the stack up, try the public API, take it down"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(fn=fn)
        if timeout:
            p.add_argument("--timeout", type=float, default=timeout, help="seconds (bounded wait)")
        if name == "up":
            p.add_argument("--mps", choices=MODES, default="auto",
                           help="run talker and Code2Wav as clients of the stack's own NVIDIA MPS daemon, "
                                "so they share the GPU without time-slicing (auto: on a GPU host)")
            p.add_argument("--model", default=None, metavar="CHECKPOINT",
                           help="the checkpoint both engines serve, over their configs' "
                                "model.checkpoint: a folder (CSM or Qwen2.5-Omni), or a tiny default "
                                "(tiny:csm, tiny:qwen-omni)")
        if name == "status":
            p.add_argument("--log-lines", type=_positive(int), default=10,
                           help="lines of a dead stage's log to show")
    _add_client_commands(sub)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except StackError as exc:
        print(f"voxring: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
