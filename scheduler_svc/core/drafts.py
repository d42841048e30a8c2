"""Speculative decoding in a step: which running decodes take a draft and how long (the
proposer's tokens, within the token budget, the step-time budget and the free KV: a draft never
preempts anyone), and what a draft step's answer does (the tokens kept up to a stop or the
length, the position advanced by what the worker kept, the blocks of rejected positions given
back). docs/speculative.md."""

from __future__ import annotations

from functools import partial

from scheduler_svc.config import DraftLength
from scheduler_svc.core.state import CoreState
from scheduler_svc.output import Event, Outputs
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.speculation.acceptance import ACCEPT_PRIOR, next_rate
from scheduler_svc.speculation.length import Row, auto_lengths, fixed_lengths, worth_drafting
from scheduler_svc.step import Draft, Step
from scheduler_svc.step_cost import step_shape
from scheduler_svc.worker_state import WorkerState


class Drafts(CoreState):
    """Drafts into a planned step, and their results out of a completed one."""

    def _speculate(self, ws: WorkerState, step: Step) -> None:
        """Turn decodes of `step` into decodes with a draft, after everything else is planned
        (drafts take only what is left). A request with a step in flight drafts past that
        step's token, which the proposal stands in for; one with more in flight (a decode run)
        does not draft; where it has a proposal that the next step would draft (`auto`'s rule
        on this step's shape, or any under `fixed`), this step is not made a run
        (`Step.draft_next`): another run would follow it instead of the draft."""
        proposer = self.proposer
        if proposer is None or not step.decodes or step.budget <= 0 or step.repeat > 1:
            return
        auto = self.config.speculative_length is DraftLength.AUTO
        predict = partial(self.predict, ws.index)
        limit = step.timer.limit if step.timer is not None else 0.0
        base = step_shape(step)
        if auto and not worth_drafting(
            base,
            step.num_sampled,
            predict,
            # a fresh request's rate at least: a lower one is measured again (`_shadow`)
            max(ACCEPT_PRIOR, max(s.acceptance for s in step.decodes)),
            min(s.num_computed for s in step.decodes) - 1,
            limit,
        ):
            return  # not even the likeliest, cheapest draft token would pay: under load
        most = self.config.num_speculative_tokens
        rows: list[Row] = []
        later: list[Row] = []  # those with a run in flight: they may draft in the next step
        picked: list[tuple[int, list[int]]] = []
        guesses: dict[int, int] = {}  # decodes whose proposal predicts this step's own token
        for i, seq in enumerate(step.decodes):
            ahead = seq.num_inflight - 1  # sampled by steps sent before this one
            room = seq.max_planned - seq.num_planned  # tokens it may sample after this one
            if room <= 0:
                continue
            if ahead > 1:  # a run in flight: no draft now
                tokens = proposer.propose(seq, min(most, room))
                if tokens:
                    later.append(Row(seq.num_computed - 1, len(tokens), seq.acceptance))
                continue
            tokens = proposer.propose(seq, min(most, room), skip=ahead)
            if tokens:
                rows.append(Row(seq.num_computed - 1, len(tokens), seq.acceptance))
                picked.append((i, tokens))
                if not ahead:
                    guesses[i] = tokens[0]
        if later:  # no run either where the next step would draft (a run would only follow)
            step.draft_next = not auto or any(
                auto_lengths(later, base, step.num_sampled, predict, step.budget, limit)
            )
        if not rows:
            return
        if auto:
            lengths = auto_lengths(rows, base, step.num_sampled, predict, step.budget, limit)
        else:
            lengths = fixed_lengths(rows, base, predict, step.budget, limit)
        chosen: dict[int, list[int]] = {}
        for (i, tokens), k in zip(picked, lengths, strict=True):
            k = self._draft_room(ws, step, step.decodes[i], k) if k else 0
            if k:
                chosen[i] = tokens[:k]
        if chosen:
            self._plan_drafts(step, chosen)
        self._shadow(step, guesses, chosen)

    def _shadow(self, step: Step, guesses: dict[int, int], chosen: dict[int, list[int]]) -> None:
        """The decodes that had a proposal and took no draft: the token each samples now says
        whether the proposal's first token would have been kept (`shadow_rates`), so that a
        request whose rate fell (auto drafts nothing for it) is measured again at no cost and
        drafts again where its text starts to repeat."""
        if not guesses:
            return
        at = 0  # the index in the step's decodes after the drafts left them
        for i in range(len(step.decodes) + len(chosen)):
            if i in chosen:
                continue
            if i in guesses:
                step.shadows.append((at, step.decode_handles[at], guesses[i]))
            at += 1

    def _shadow_rates(self, step: Step, tokens: list[int]) -> None:
        """After the step: each shadowed decode's rate, as if its proposal had been a draft of
        one token (`tokens`: the decodes' sampled tokens, in order)."""
        decodes = step.decodes
        for at, handle, guess in step.shadows:
            seq = decodes[at]
            if seq.handle == handle:
                seq.acceptance = next_rate(seq.acceptance, 1, int(tokens[at] == guess))

    def _draft_room(self, ws: WorkerState, step: Step, seq: Sequence, k: int) -> int:
        """The most of `k` draft tokens `seq` holds KV for, growing its table from the free
        blocks (never preempting): its input is at num_computed - 1, its draft after it."""
        kv, bs = ws.kv, ws.spec.block_size
        held = kv.held(seq)
        k = min(k, held + kv.num_free * bs - seq.num_computed)
        if k <= 0 or seq.num_computed + k <= held:
            return max(k, 0)
        new = kv.allocate(seq, seq.num_computed + k)
        assert new is not None  # within the free blocks counted above
        for at, (handle, blocks) in enumerate(step.grants):
            if handle == seq.handle:  # its table grew in this step already: one grant
                step.grants[at] = (handle, blocks + new)
                return k
        step.grants.append((seq.handle, new))
        return k

    def _plan_drafts(self, step: Step, chosen: dict[int, list[int]]) -> None:
        decodes, handles = [], []
        for i, (seq, handle) in enumerate(zip(step.decodes, step.decode_handles, strict=True)):
            tokens = chosen.get(i)
            if tokens is None:
                decodes.append(seq)
                handles.append(handle)
                continue
            step.drafts.append(Draft(seq, handle, seq.num_computed - 1, tokens))
            step.budget -= len(tokens)
            seq.drafting = True
        step.decodes, step.decode_handles = decodes, handles
        if step.timer is not None:
            step.timer.shape = step_shape(step)

    def _complete_drafts(
        self, step: Step, tokens: list[int], emitted: list[int], outputs: Outputs
    ) -> None:
        """The drafts' `tokens` (after the chunks' and the decodes'), `emitted[i]` of them for
        draft i, into `outputs` for the requests still where they were planned; the others'
        are dropped (preempted, moved or finished since)."""
        drafts = step.drafts
        if len(emitted) != len(drafts) or sum(emitted) != len(tokens):
            raise ValueError(f"{len(tokens)} draft tokens, emitted {emitted}, {len(drafts)} drafts")
        if any(not 1 <= n <= len(d.token_ids) + 1 for d, n in zip(drafts, emitted, strict=True)):
            raise ValueError(
                f"emitted {emitted} for drafts of {[len(d.token_ids) for d in drafts]}"
            )
        assert outputs.tokens is not None
        ws, at = self.workers[step.worker], 0
        seqs, kept = list(outputs.tokens.seqs), list(outputs.tokens.tokens)  # new lists: the
        for draft, n in zip(drafts, emitted, strict=True):  # plain part's may be step.decodes
            got, at = tokens[at : at + n], at + n
            seq = draft.seq
            if seq.handle == draft.handle and seq.worker == step.worker:
                got = self._complete_draft(ws, draft, got, outputs.finishes)
                seqs += [seq] * len(got)
                kept += got
        outputs.tokens.seqs, outputs.tokens.tokens = seqs, kept

    def _complete_draft(
        self, ws: WorkerState, draft: Draft, got: list[int], finishes: list[Event]
    ) -> list[int]:
        """One request's draft answer: it keeps the tokens up to the first that ends it (then
        it finishes, and its KV goes); its position advances by what it kept (the worker's own
        advance, when it runs on), and the blocks past it (only rejected positions, garbage the
        worker never counts as written) go back to the pool. Returns the tokens kept."""
        seq, drafted = draft.seq, len(draft.token_ids)
        seq.drafting = False
        self._count_draft(drafted, len(got) - 1)
        seq.acceptance = next_rate(seq.acceptance, drafted, len(got) - 1)
        got = got[: seq.kept(got)]
        seq.num_computed += len(got) - 1  # past its input: the accepted tokens it keeps
        seq.num_planned += len(got) - 1
        seq.output_ids += got
        self.generated += len(got)
        if got[-1] in seq.stop_ids:
            finishes.append(self._finish(seq, Finish.STOP))
        elif len(seq.output_ids) >= seq.output_limit:
            finishes.append(self._finish(seq, Finish.LENGTH))
        elif not self.reserve and (keep := ws.kv.trim(seq)) is not None:
            ws.trims.append((seq.handle, keep))
        return got

    def _count_draft(self, drafted: int, accepted: int) -> None:
        """vLLM's counters: drafts, draft tokens, accepted tokens, accepted by position."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        per_pos = self.spec_accepted_per_pos
        for pos in range(accepted):
            per_pos[pos] += 1
