"""`llmserve bench tenants`: the issue's case through real processes. A chat tenant sends short
chats one after another beside a batch tenant's burst of long requests. Two API keys, one
stack, each queue policy in turn (switched live, the stack idle between phases). Per policy:
the chats' time to first token and the batch's throughput, as a ratio to the first policy's."""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from llmserve import client as api
from llmserve.bench.report import machine
from llmserve.bench.tenant_load import Client, Seen, run_phase
from llmserve.stack import Stack, StackSettings

IDLE_TIMEOUT_S = 120.0


def keys_file(directory: Path, chat_key: str, batch_key: str, top_priority: int) -> Path:
    path = directory / "api-keys"
    path.write_text(
        f"# tenant keys for bench tenants\n"
        f"{chat_key} chat weight=1 top_priority={top_priority}\n"
        f"{batch_key} batch weight=1\n"
    )
    path.chmod(0o600)
    return path


def wait_idle(admin: api.Client, timeout: float = IDLE_TIMEOUT_S) -> None:
    """Until nothing runs or waits (a cancelled request's KV is freed at its next step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = admin.status()
        if not s["running"] and not s["waiting"]:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the stack did not drain within {timeout:.0f} s")


def summary(policy: str, chat: Seen, batch: Seen, seconds: float) -> dict:
    ttft = np.array(chat.ttft) if chat.ttft else np.array([np.nan])
    return {
        "policy": policy,
        "chat_ttft_p50_s": float(np.percentile(ttft, 50)),
        "chat_ttft_p90_s": float(np.percentile(ttft, 90)),
        "chats_answered": len(chat.ttft),
        "chats_unanswered_at_end": chat.unanswered,
        "batch_tokens_per_s": batch.tokens / seconds,
        "batch_finished": batch.finished,
        "errors": chat.errors[:3] + batch.errors[:3],
    }


def run_tenants(args: argparse.Namespace, command: str) -> int:
    policies = [p for p in args.queue_policies.split(",") if p]
    chat_key, batch_key = secrets.token_hex(16), secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        admin_key = directory / "admin-key"
        admin_key.write_text(secrets.token_hex(16))
        admin_key.chmod(0o600)
        settings = replace(
            StackSettings(model=args.model, dtype=args.dtype, threads=args.threads),
            api_keys_file=str(keys_file(directory, chat_key, batch_key, args.chat_priority)),
            admin_key_file=str(admin_key),
        )
        stack = Stack(settings, directory / "logs")
        stack.start()
        rows = []
        try:
            with api.Client(
                settings.gateway, api_key=chat_key, admin_key=admin_key.read_text()
            ) as admin:
                if args.warmup > 0:  # the worker's first steps are slower: not in any phase
                    warm = Client(batch_key, args.batch_concurrency, args.batch_prompt_tokens,
                                  args.batch_output_tokens, label="warm-up")  # fmt: skip
                    run_phase(settings.gateway, [warm], args.warmup)
                    wait_idle(admin)
                for policy in policies:
                    admin.set_settings({"queue_policy": policy})
                    wait_idle(admin)
                    chat = Client(
                        chat_key, 1, args.chat_prompt_tokens, args.chat_output_tokens,
                        priority=args.chat_priority if policy == "priority" else None,
                        label="chat",
                    )  # fmt: skip
                    batch = Client(
                        batch_key, args.batch_concurrency, args.batch_prompt_tokens,
                        args.batch_output_tokens, label="batch",
                    )  # fmt: skip
                    batch_seen, chat_seen = run_phase(
                        settings.gateway, [batch, chat], args.duration
                    )
                    rows.append(summary(policy, chat_seen, batch_seen, args.duration))
                    print_row(rows[-1], rows[0])
                    wait_idle(admin)
        finally:
            stack.stop()
    report = {"command": command, "machine": machine(), "args": vars(args) | {"func": None}}
    report["rows"] = rows
    out = Path(args.out) / f"{args.name or 'tenants'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")
    return 0


def print_row(row: dict, first: dict) -> None:
    ratio = row["batch_tokens_per_s"] / first["batch_tokens_per_s"] if first else 1.0
    print(
        f"{row['policy']:>9}: chat TTFT p50 {row['chat_ttft_p50_s']:.3f} s, p90 "
        f"{row['chat_ttft_p90_s']:.3f} s ({row['chats_answered']} answered, "
        f"{row['chats_unanswered_at_end']} waiting at the end); batch "
        f"{row['batch_tokens_per_s']:.1f} tokens/s ({ratio:.2f}x {first['policy']})"
        + (f"; errors: {row['errors']}" if row["errors"] else ""),
        flush=True,
    )
