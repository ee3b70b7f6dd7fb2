"""The ``voxring`` command: run a local stack (``up``, ``down``, ``status``, ``demo``).

Imports neither torch nor the engines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from voxring.stack import STAGES, Stack, StackError, find_root


def _stack(args: argparse.Namespace) -> Stack:
    root = find_root(args.root)
    config_dir = (args.config_dir or root / "deploy" / "configs").resolve()
    state_dir = (args.state_dir or root / ".voxring").resolve()
    return Stack(root=root, config_dir=config_dir, state_dir=state_dir)


def _print_endpoints(addresses: dict[str, str]) -> None:
    for stage in STAGES:
        print(f"  {stage:<9} {addresses.get(stage, '?')}")


def cmd_up(args: argparse.Namespace) -> int:
    stack = _stack(args)
    if all(pid is not None for pid, _ in stack.status().values()):
        print("a voxring stack is already running:")
        _print_endpoints({s: addr or "?" for s, (_, addr) in stack.status().items()})
        return 0
    print(f"starting gateway, talker and Code2Wav (logs in {stack.log_dir})")
    addresses = stack.up(timeout=args.timeout)
    print("voxring stack is SERVING:")
    _print_endpoints(addresses)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stack = _stack(args)
    stopped = stack.down(timeout=args.timeout)
    print(f"stopped: {', '.join(stopped)}" if stopped else "no voxring stack is running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    stack = _stack(args)
    running = 0
    for stage, (pid, address) in stack.status().items():
        state = f"running, pid {pid}, {address or 'starting'}" if pid else "stopped"
        running += pid is not None
        print(f"  {stage:<9} {state}")
    return 0 if running in (0, len(STAGES)) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """Brings the stack up (unless one runs), checks each stage and the public API,
    and takes the stack down again if it started it."""
    stack = _stack(args)
    started = not all(pid is not None for pid, _ in stack.status().values())
    addresses = stack.up(timeout=args.timeout)
    try:
        print("voxring stack is SERVING:")
        _print_endpoints(addresses)
        from voxring.demo import check_public_api

        return check_public_api(addresses["gateway"])
    finally:
        if started:
            stack.down()
            print("stack stopped")


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
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except StackError as exc:
        print(f"voxring: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
