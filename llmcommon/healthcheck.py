"""python -m llmcommon.healthcheck HOST:PORT: exit 0 when the server is SERVING.

For container health checks: one Check call on the standard grpc.health.v1 service, exit 1 with
the reason on stderr otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from llmcommon.health import Status, check_health


def check(target: str, service: str = "", timeout: float = 3.0) -> str:
    """The serving status's name (SERVING, NOT_SERVING, ...); raises grpc.RpcError."""

    async def once() -> str:
        async with grpc.aio.insecure_channel(target) as channel:
            return Status.Name(await check_health(channel, service, timeout))

    return asyncio.run(once())


def main(argv: list[str] | None = None) -> int:
    prog = "python -m llmcommon.healthcheck"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("target", help="HOST:PORT of a gateway, scheduler or worker")
    parser.add_argument("--service", default="", help="a service name; '' = the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    try:
        status = check(args.target, args.service, args.timeout)
    except grpc.RpcError as err:
        print(f"{args.target}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"{args.target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
