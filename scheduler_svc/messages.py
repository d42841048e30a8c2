"""A planned step as the message a worker receives: only what changed since its last step."""

from __future__ import annotations

from llmcommon.sampling_wire import to_wire
from llmcommon.v1 import worker_pb2
from scheduler_svc.step import Step


def step_message(number: int, step: Step) -> worker_pb2.Step:
    msg = worker_pb2.Step(step=number, decodes=step.decode_handles, released=step.released)
    if step.repeat > 1:
        msg.repeat = step.repeat
    starts = {work.handle: work.start for work in step.chunks}
    shared = {handle for handle, blocks in step.shares if blocks}
    for seq in step.added:
        added = msg.added.add(
            handle=seq.handle,
            request_id=seq.request_id,
            sampling=to_wire(seq.sampling),
            sample_index=len(seq.output_ids),
        )
        if seq.handle in shared:  # its first chunk starts after the cached prefix
            added.cached_token_ids.extend(seq.tokens[: starts.get(seq.handle, 0)])
    for handle, blocks in step.shares:
        if blocks:
            msg.shared.add(handle=handle, blocks=blocks)
    for handle, keep in step.trims:
        msg.trims.add(handle=handle, keep=keep)
    for handle, blocks in step.grants:
        if blocks:
            msg.grants.add(handle=handle, blocks=blocks)
    for work in step.chunks:
        msg.chunks.add(
            handle=work.handle,
            token_ids=work.token_ids,
            start_position=work.start,
            sample=work.sample,
        )
    for draft in step.drafts:
        msg.drafts.add(handle=draft.handle, token_ids=draft.token_ids)
    return msg
