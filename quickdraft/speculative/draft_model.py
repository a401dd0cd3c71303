"""A smaller model of the same family drafts tokens autoregressively, with its own KV cache."""

from __future__ import annotations

import copy
import time

import torch

from quickdraft import constraint as constraints, quant, sampling
from quickdraft.config import MAX_DRAFT, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.models.transformer import ROWWISE_MAX
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import common_prefix
from quickdraft.speculative.base import Branches, Drafter, KFor, Offer, Proposal, branch, drive, replay_chain
from quickdraft.speculative.subset import SubsetHead
from quickdraft.speculative.vocab import check_compatible
from quickdraft.weights import memory

# Tokens of the sequence the draft has not seen that its first drafting pass feeds along (after a fully accepted
# round: its own last draft, which it never fed, and the target's extra token); more are caught up first.
CATCH_UP = 2
# A probe (a round after PROBE_AFTER or more plain steps, while the policy decodes plainly) drafts from the last
# PROBE_WINDOW tokens written after the prefix the draft has, and forgets them after: catching up on every skipped
# token is a prefill of them all, which made probing cost more than speculation could win back where it does not
# pay. The round that resumes speculation catches up in full.
PROBE_AFTER = 16
PROBE_WINDOW = 32
# A draft with a window (--draft-window W) keeps its first SINKS tokens (attention sinks: StreamingLLM) and the last W
# of the rest, each at its own position; the window grows by up to SLACK tokens before the oldest are dropped (a copy
# of keys and values behind the sinks, no pass), and its cache holds no more than that and a round's drafts.
SINKS = 4
SLACK = 64
DEFAULT_WINDOW = 1024  # on the CPU, where a draft's prefill of a long prompt costs more than its drafts save


def window_of(speculation, device) -> int:
    """The window a draft model drafts from: --draft-window, else DEFAULT_WINDOW on the CPU and the whole context on a
    GPU (its prefill is cheap there, and its graphs replay a cache without one)."""
    window = getattr(speculation, "draft_window", None)
    if window is not None:
        return window
    return DEFAULT_WINDOW if torch.device(device).type == "cpu" else 0


class DraftModelDrafter(Drafter):
    kind = "model"
    text_model = True
    sources = ("draft",)
    samples = True
    trees = True
    dists: list | None = None  # while a tree is drafted: the draft's distribution at each position
    window = 0  # tokens of the context it drafts from past its sinks (0: all of them)
    dropped = 0  # tokens of the sequence between the sinks and the window: not in its cache (KVCache.offset)

    def __init__(self, lm, target_vocab: int, capacity: int, p_min: float = 0.0, shared: int | None = None,
                 vocab: int = 0, window: int = 0):
        """lm: the draft's LoadedModel; target_vocab: the target's rows (the width of the distributions);
        capacity: positions of the draft's KV cache; shared: the ids both vocabularies share (check_compatible's
        answer; default: the draft tokenizer's ids up to target_vocab): no other id is proposed, and a target token
        past them reaches the draft as a stand-in; vocab: score only the first this many ids and the text's
        (speculative/subset.py; 0: every id); window: draft from the first SINKS tokens and the last `window` of the
        rest (0: the whole context; a recurrent draft, whose state holds everything, always has it whole)."""
        self.lm = lm
        self.device = lm.device
        self.name = lm.name
        self.target_vocab = target_vocab
        self.shared = min(target_vocab, lm.tokenizer.vocab_size) if shared is None else shared
        self.p_min = p_min
        self.capacity = capacity
        self.window = window if window and not lm.model.state_layout() else 0
        self.cache = KVCache.for_model(lm.model, self.cache_positions(capacity, self.window))
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds
        self.matched = 0  # length of the prefix of tokens known to equal the sequence
        self.skipped = 0  # plain steps (k = 0) since its last round
        self.subset = SubsetHead(lm.model, vocab, self.shared) if 0 < vocab < self.shared else None
        self.seen = 0  # tokens of the sequence the subset has taken in

    @classmethod
    def load(cls, draft, target, load) -> list:
        return [load(draft.model)]

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "DraftModelDrafter":
        (lm,) = models
        shared = check_compatible(target.tokenizer, lm.tokenizer, target.config.vocab_size, lm.config.vocab_size)
        window = window_of(speculation, lm.device)
        if window > capacity and getattr(speculation, "draft_window", None) is not None:
            raise QuickdraftError(f"{{draft_window}} {window} is beyond the context of {capacity} tokens: give 0 (the "
                                  f"whole context) to {capacity}", "draft_window")
        window = window if window < capacity else 0  # a default as long as the context: the whole context
        return cls(lm, target.config.vocab_size, capacity, speculation.p_min, shared, speculation.draft_vocab,
                   window)

    @staticmethod
    def cache_positions(context: int, window: int) -> int:
        """Positions its cache holds: the context's, or a window's (its sinks, the window and its slack, a round's
        drafts)."""
        return min(context, SINKS + window + SLACK + MAX_DRAFT + 1) if window else context

    def fork(self) -> "DraftModelDrafter":
        other = copy.copy(self)  # the same model, settings and cut head's rows; a cache and a sequence of its own
        other.cache = KVCache.for_model(self.lm.model, self.cache_positions(self.capacity, self.window))
        other.tokens, other.matched, other.skipped, other.seen, other.dropped = [], 0, 0, 0, 0
        other.subset = self.subset.fork() if self.subset is not None else None
        return other

    @property
    def models(self) -> tuple:
        return (self.lm,)

    def adopt(self, other: "DraftModelDrafter", n: int) -> None:
        n = min(n, len(other.tokens))
        if self.cache.recurrent:  # a recurrent draft's state is not copied: it prefills what it needs
            n = 0
        if other.dropped:  # its window is not a prefix: the sinks are, the rest is caught up when it drafts
            n = min(n, SINKS)
        self.cache.copy_prefix(other.cache, n)
        self.tokens, self.matched, self.dropped = other.tokens[:n], 0, 0

    def forget(self) -> None:
        self.cache.reset()
        self.tokens, self.matched, self.dropped = [], 0, 0

    def lag(self, seq: list[int], source: str) -> int:
        """What a round now would feed it first: the tokens it has not seen (at most its sinks and window), or after
        PROBE_AFTER plain steps a probe's window of them (_propose_steps)."""
        if source != "draft":
            return 0
        behind = max(0, len(seq) - 1 - len(self.tokens))
        behind = min(behind, SINKS + self.window) if self.window else behind
        if self.skipped >= PROBE_AFTER and behind > PROBE_WINDOW and self.cache.max_draft is None:
            return PROBE_WINDOW
        return behind

    @torch.inference_mode()
    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        """Prefill the prompt now, so that a round's draft time is the cost of drafting alone. What the cache holds
        of it already (this slot's last generation: the conversation so far) is kept; a recurrent draft keeps it
        only where its state can return to."""
        self.matched = 0  # a new sequence: what it holds is compared from the start
        if self.cache.recurrent:
            n = common_prefix(self.tokens, prompt)
            if n not in self.cache.recurrent[0].saved:
                n = 0
            self.cache.rollback(n) if n else self.cache.reset()
            del self.tokens[n:]
            self.matched = n
        self.skipped = 0
        if self.subset is not None:
            self.subset.reset(prompt)
            self.seen = len(prompt)
        if not prefill:  # what it lacks is caught up when it first drafts
            self._match(prompt, len(prompt))
            return
        feed = self._sync(prompt, keep_last=False)
        if feed:
            self._logits(feed)

    def _sync(self, seq: list[int], keep_last: bool = True) -> list[int]:
        """Keep the longest cached prefix that still matches seq; return the tokens still to feed.

        This is the one place that knows the draft's cache can run behind or beside the sequence: after a
        fully accepted round the draft never fed its own last drafted token, so that token and the
        target's extra one are both pending; after a rejection, its cache holds drafts the target did not
        keep. At least one token is always left to feed (keep_last; begin's prefill feeds them all): the next
        draft needs its logits.

        With a window, what it would feed is cut to the window: once the tokens past its sinks would outgrow the
        window by SLACK, the oldest are dropped (those it holds move behind the sinks; those it does not hold are
        never fed), so what it feeds, and a draft step's attention, is bounded by the window however long the
        sequence.
        """
        n = self._match(seq, len(seq) - 1 if keep_last else len(seq))
        start = len(seq) - self.window  # where the window begins once it is cut
        if not self.window or start - (SINKS + self.dropped) <= SLACK or start <= SINKS:
            return seq[n:]
        if n < SINKS:  # the sinks first, at their own positions
            self._logits(seq[n:SINKS])
            n = SINKS
        if n > start:  # it holds the window's beginning: moved behind the sinks
            self.cache.compact(SINKS, start - self.dropped, start - SINKS)
        else:  # it holds none of the window: it is fed from its beginning
            self.cache.compact(SINKS, self.cache.length, start - SINKS)
            self.tokens[n:] = seq[n:start]  # (the tokens between: not in the cache, known to match)
            n = self.matched = start
        self.dropped = start - SINKS
        return seq[n:]

    def _match(self, seq: list[int], end: int) -> int:
        """Keep what it holds of seq[:end] (the longest prefix that matches: what it holds of a dropped part of the
        window does not count), forget the rest; how many tokens of seq that is."""
        limit = min(len(self.tokens), end)
        n = min(self.matched, limit)  # tokens[:matched] == seq[:matched] held at the last sync; seq only grows
        while n < limit and self.tokens[n] == seq[n]:
            n += 1
        if self.dropped and n < SINKS + self.dropped:  # what it needs of the window was dropped: start after the sinks
            n = min(n, SINKS)
        self._truncate(n)
        self.matched = n
        return n

    def _truncate(self, n: int) -> None:
        """Forget every token from the n-th of the sequence on (n past the window's drop, or at most SINKS)."""
        if self.dropped and n < SINKS + self.dropped:
            self.cache.rollback(n)
            self.cache.offset = self.dropped = 0
        else:
            self.cache.rollback(n - self.dropped)
        del self.tokens[n:]

    def _ids(self, ids) -> torch.Tensor:
        """The ids as the draft reads them, (1, n) on its device: a token the draft does not share (a target's added
        or padding token, which text hardly ever holds) becomes id 0, a stand-in that costs acceptance, never
        exactness. ids: a list, or the draft's own last token still on the device (it shares every id it drafts)."""
        if isinstance(ids, torch.Tensor):
            return ids.view(1, -1)
        return torch.tensor([[i if i < self.shared else 0 for i in ids]], dtype=torch.long, device=self.device)

    def _over_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits (..., rows) -> (..., target_vocab), -inf at every id past the shared ones: never proposed."""
        V, n = self.target_vocab, min(self.shared, logits.shape[-1])
        if logits.shape[-1] >= V:  # the usual case: a view, masked in place (the logits are this call's own)
            out = logits[..., :V]
            out[..., n:] = float("-inf")
            return out
        out = logits.new_full((*logits.shape[:-1], V), float("-inf"))
        out[..., :n] = logits[..., :n]
        return out

    def _logits(self, feed) -> torch.Tensor:
        """Run feed (ids, or the last draft still on the device: see _draft) through the draft, in passes of at
        most the model's chunk; logits of the last position over the target's vocabulary (V,)."""
        head = self._head()
        return self._taken_in(feed, self.lm.prefill(self._ids(feed), self.cache, head=head)[0, 0], head)

    def _head(self):
        return self.subset if self.subset is not None and self.subset.active else None

    def _taken_in(self, feed, logits: torch.Tensor, head) -> torch.Tensor:
        """What follows a pass over feed: feed recorded as held, the last row's logits (V',) over the target's
        vocabulary."""
        if isinstance(feed, list):  # a draft fed from the device is recorded once read back (propose)
            self.tokens += feed
        if head is not None:
            return head.scatter(logits, self.target_vocab)
        return self._over_target(logits)

    @property
    def batchable(self) -> bool:
        """Whether this round's draft passes may run in one pass with other sequences' (engine.Engine.plan): a plain
        draft model's on the CPU, whose passes are row-invariant and whose drafts are read as they are drawn."""
        return type(self) is DraftModelDrafter and self.device.type == "cpu"

    def batched_pass(self, drafters: list["DraftModelDrafter"], feeds: list) -> list[torch.Tensor]:
        """The draft passes of several sequences' drafters (this one's model, each its own cache) as one:
        per drafter the logits of its feed's last row over the target's vocabulary, as _logits gives them."""
        if any(d._head() is not None for d in drafters):  # a cut head scores its own rows: each alone
            return [d._logits(f) for d, f in zip(drafters, feeds)]
        out, group = [], []
        for d, f in zip(drafters, feeds):  # passes of at most ROWWISE_MAX rows in all
            if group and sum(len(g[1]) for g in group) + len(f) > ROWWISE_MAX:
                out += self._one_pass(group)
                group = []
            group.append((d, f))
        return out + self._one_pass(group)

    def _one_pass(self, group: list) -> list[torch.Tensor]:
        rows = self.lm.model.forward_segments([d._ids(f)[0] for d, f in group], [d.cache for d, _ in group],
                                              [True] * len(group))
        return [d._taken_in(f, r[0], None) for (d, f), r in zip(group, rows)]

    @torch.inference_mode()
    def propose(self, seq: list[int], k_for: KFor, params: SamplingParams,
                generator: torch.Generator, constraint=None, branches: Branches | None = None) -> Proposal:
        return drive(self._propose_steps(seq, k_for, params, generator, constraint, branches), self._logits)

    def propose_steps(self, seq: list[int], k_for: KFor, params: SamplingParams,
                      generator: torch.Generator, constraint=None, branches: Branches | None = None):
        if not self.batchable:  # a drafter built on this one (mtp, assistant, dflash), or on a GPU: propose whole
            return self.propose(seq, k_for, params, generator, constraint, branches)
        return (yield from self._propose_steps(seq, k_for, params, generator, constraint, branches))

    def pass_logits(self, feed) -> torch.Tensor:
        return self._logits(feed)

    def _propose_steps(self, seq: list[int], k_for: KFor, params: SamplingParams,
                       generator: torch.Generator, constraint=None, branches: Branches | None = None):
        """propose as a generator: it yields each draft pass's feed and is sent the logits _logits would give
        (engine.Engine.plan runs several sequences' passes as one); it returns the Proposal."""
        k = k_for("draft")
        if k == 0:  # a plain step: nothing is fed now (the next round catches up in one pass, timed apart), so that
            self.skipped += 1  # decoding plainly costs what plain decoding costs
            return Proposal([], "draft")
        t0 = time.perf_counter()  # what it takes in first (its window, once the prompt's; after plain steps) is timed
        feed = self._sync(seq)
        if self.subset is not None:  # the answer's tokens are scored from now on
            self.subset.add(seq[self.seen:], answer=True)
            self.seen = len(seq)
        # (not on a recurrent draft, whose state rolls back HISTORY positions at most)
        probe = self.skipped >= PROBE_AFTER and len(feed) > PROBE_WINDOW and self.cache.max_draft is None
        self.skipped = 0
        kept = len(self.tokens)  # a probe's window and drafts are forgotten after it: the cache is the prefix again
        dropped = self.dropped
        if probe:
            feed = feed[-PROBE_WINDOW:]
        catch_up_s, caught_up = 0.0, 0
        if len(feed) > CATCH_UP:  # after plain steps: catch up first, so that timing a round times drafting
            self._logits(feed[:-1])
            caught_up, feed = len(feed) - 1, feed[-1:]
            catch_up_s = time.perf_counter() - t0
        tokens, q_rows = [], []
        self.dists = [] if branches is not None and constraint is None else None
        try:
            drawn = yield from self._draft_steps(seq, k, feed, params, generator, constraint, tokens, q_rows)
            self.tokens += drawn[:self.cache.length + self.dropped - len(self.tokens)]  # the drafts fed before read
        finally:
            if constraint is not None:  # the drafts were looked ahead: the state is the sequence's again
                constraint.pop(len(tokens))
            if probe:
                self.cache.rollback(kept - dropped)
                del self.tokens[kept:]
        proposal = self._proposal(tokens, q_rows, "draft", catch_up_s, branches)
        proposal.caught_up = caught_up
        return proposal

    def _pending_chain(self, seq, k, params, generator, constraint, source: str, branches: Branches | None,
                       catch_up_s: float = 0.0) -> Proposal:
        """A round of the drafters built on the target's states (mtp, assistant, dflash): up to k drafts from the
        pending token on (_draft), the constraint's state left as found, alternatives where a tree is asked for."""
        tokens, q_rows = [], []
        self.dists = [] if branches is not None and constraint is None else None
        try:
            self._draft(seq, k, [seq[-1]], params, generator, constraint, tokens, q_rows)
        finally:
            if constraint is not None:
                constraint.pop(len(tokens))
        return self._proposal(tokens, q_rows, source, catch_up_s, branches)

    def _proposal(self, tokens: list[int], q_rows: list, source: str, catch_up_s: float = 0.0,
                  branches: Branches | None = None) -> Proposal:
        """The round's proposal: its chain, with alternatives beside it where the engine asks for a tree."""
        dists, self.dists = self.dists, None
        if branches is not None and dists is not None and tokens:
            tree = branch(tokens, dists, q_rows, branches(source, len(tokens)))
            if tree is not None:
                tree.source, tree.catch_up_s = source, catch_up_s
                return tree
        return Proposal(tokens, source, torch.stack(q_rows) if q_rows else None, catch_up_s)

    def _draft(self, seq, k, feed, params, generator, constraint, tokens: list[int], q_rows: list) -> list[int]:
        return drive(self._draft_steps(seq, k, feed, params, generator, constraint, tokens, q_rows), self._logits)

    def _draft_steps(self, seq, k, feed, params, generator, constraint, tokens: list[int], q_rows: list):
        """Draft up to k tokens into tokens (and their distributions into q_rows), each masked by constraint at the
        state it is drafted in (the constraint is advanced through them). Returns every token drawn, kept or not.

        On a GPU, without a constraint or penalties (which need each token on the host), the drafts stay on the
        device and are read back once, after the last (a read-back waits for the device: one per draft would make
        Python and the GPU take turns); the early stop (p_min) is then applied to what was read, so a round may run
        a few passes past it. Elsewhere each draft is read as it is drawn and drafting stops at once. A generator: it
        yields each pass's feed and is sent its logits (_draft sends _logits')."""
        resident = self._resident(constraint, params)
        drawn, sure = [], []  # resident: each draft (1,) and whether the draft was sure of it, on the device
        for i in range(k):
            history = sampling.history(seq, params, self.device, appended=tokens)
            logits = (yield feed)[None]  # _logits(feed), alone or beside other sequences' passes
            if constraint is not None:
                logits = constraints.apply(logits, constraint.allowed(self.device))
            token, q, confident = self._choose(logits, params, history, generator, len(seq) + i)
            if q is not None:
                q_rows.append(q[0])
            if self.dists is not None:  # a tree's alternatives come from here
                self.dists.append(q[0] if q is not None else logits[0].float().softmax(-1))
            if resident:
                drawn.append(token)
                sure.append(confident)
                feed = token
                continue
            token = int(token)
            if not bool(confident) and tokens:  # stop early: the draft itself doubts this token
                del q_rows[len(tokens):]
                break
            if constraint is not None:  # drawn from the masked distribution: the matcher takes it
                constraint.advance(token)
            tokens.append(token)
            if constraint is not None and constraint.stopped:  # the output is complete: nothing follows
                break
            feed = [token]
        if not resident or not drawn:
            return list(tokens)
        read = torch.cat(drawn + [torch.stack(sure).view(-1).long()] if self.p_min > 0 else drawn).tolist()
        n = len(drawn)
        kept = next((i for i in range(1, n) if not read[n + i]), n) if self.p_min > 0 else n
        tokens += read[:kept]
        del q_rows[kept:]
        return read[:n]

    def _resident(self, constraint, params: SamplingParams) -> bool:
        """Whether this round's drafts stay on the device until its end (_draft): on a GPU, without a constraint or
        penalties."""
        return self.device.type != "cpu" and constraint is None and not params.penalized

    def _choose(self, logits, params: SamplingParams, history, generator, position: int):
        """The draft's token at sequence index `position` from its logits (1, V), as the target would choose it
        (greedy, seeded or drawn), left on the device: (token (1,), its processed distribution (1, V) or None when
        greedy, whether the draft's top probability reaches p_min: a device bool, or True without a p_min)."""
        if params.greedy:
            logits = sampling.penalize(logits, params, history)
            sure = logits.softmax(-1).amax() >= self.p_min if self.p_min > 0 else True
            return logits.argmax(-1), None, sure
        q = sampling.process(logits, params, history)
        if params.seed is not None:  # guess the target's seeded choice with the same noise
            token = sampling.gumbel_choice(q, params.seed, position)
        else:
            token = sampling.sample(q, generator)
        return token, q, q.amax() >= self.p_min if self.p_min > 0 else True

    # ---- self-description ---------------------------------------------------------------------------------

    @property
    def max_draft(self) -> int | None:
        return self.cache.max_draft

    @property
    def cut_head(self) -> bool:
        return self.subset is not None

    def cache_bytes(self) -> int:
        return self.cache.nbytes()

    @classmethod
    def planned(cls, draft, target_cfg, device: torch.device, dtype: torch.dtype, context: int,
                window: int | None = None) -> list:
        """The draft model's weights in its format, its KV cache and its prefill, where it shares the target's card
        (on another device they are that device's)."""
        spec = cls.planned_model(draft, device, dtype)
        if spec is None:
            return []
        window = window if window is not None else window_of(None, device)
        positions = cls.cache_positions(context, window if window < context else 0)  # (as long as the context: whole)
        return cls.planned_weights(spec, device) + [
            memory.Item("draft KV cache", memory.kv_bytes(spec.cfg, positions), f"{positions} positions, bf16"),
            memory.Item("activations", memory.activation_bytes(spec.cfg, context))]

    @staticmethod
    def planned_model(draft, device: torch.device, dtype: torch.dtype) -> memory.ModelSpec | None:
        """The draft model's spec (its config and file's tensors, in the format it will load in) where it shares the
        target's card, else None."""
        own = torch.device(draft.device) if draft.device else device
        if own != device and not (own.type == device.type and device.index in (None, 0) and own.index in (None, 0)):
            return None
        return memory.spec_from_source("draft", draft.model, quant.resolve(draft.weights, own, dtype, role="draft"))

    @staticmethod
    def planned_weights(spec: memory.ModelSpec, device: torch.device) -> list:
        weights, how = memory.weight_bytes(spec.cfg, spec.fmt, device, spec.types, spec.file_bytes)
        return [memory.Item("draft weights", weights, f"{spec.name}, {how}")]

    @torch.inference_mode()
    def pass_seconds(self, prompt: list[int], reps: int = 3) -> float:
        """Median seconds of one drafting pass (one token after prompt)."""
        from quickdraft.runtime.timing import median_seconds

        cache = KVCache.for_model(self.lm.model, len(prompt) + 2)
        if self.subset is not None:
            self.subset.reset(prompt)
        self.lm.forward(self._ids(prompt), cache, last_only=True, head=self.subset)
        feed = self._ids(prompt[-1:])
        return median_seconds(lambda: self.lm.forward(feed, cache, last_only=True, head=self.subset), self.device,
                              reps, lambda: cache.rollback(len(prompt)))

    @torch.inference_mode()
    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Exact for greedy decoding: the draft's i-th guess, while the ones before it were kept, sees the known
        prefix, so one teacher-forced pass gives a round's chain up to its first wrong guess; past it the chain goes
        on from the draft's own token (what a tree's choice of position and the early stop, p_min, read), run from a
        copy of the cache's known prefix. (A draft with recurrent layers, whose state at every position is not
        kept, takes its confidence past a wrong guess from the known sequence: that only moves the cost of drafts
        the target rejects anyway, and where a tree puts its alternatives.)"""
        n = len(output)
        seq = prompt + output
        room = len(seq) + self.lm.chunk  # a CUDA pass pads to its rows: the replay's passes are padded as decoding's
        cache = KVCache.for_model(self.lm.model, room)
        logits = self._over_target(self.lm.teacher_forced(self._ids(seq[:-1]), cache)[0, len(prompt) - 1:])
        # the ids a round's cut head scores: those of its start (the sequence up to the pending token), all its rounds
        allowed = self.subset.allowed(prompt, output, logits.shape[-1]) if self.subset is not None else None
        own = KVCache.for_model(self.lm.model, room)  # the chains past a wrong guess, one after another
        out = [Offer("", 0, 0)]
        for t in range(1, n):
            step = self._teacher_forced(cache, own, logits, None if allowed is None else allowed[t], seq,
                                        len(prompt) + t - 1)
            out.append(replay_chain("draft", step, output[t - 1], output[t:], kmax, self.p_min))
        return out

    def _teacher_forced(self, cache: KVCache, own: KVCache, logits: torch.Tensor, allowed, seq: list[int], at: int):
        """replay_chain's step for a round whose pending token is seq[at]: the teacher-forced rows while the chain
        is the known sequence, then single-token passes in `own` from a copy of the cache's prefix; allowed: the ids
        the round's cut head scores (None: every id)."""
        state = {"i": 0, "off": False}
        row0 = at - (len(seq) - 1 - logits.shape[0])  # logits' row of the pending token's position

        def step(token: int) -> torch.Tensor:
            i = state["i"]
            state["i"] = i + 1
            if not state["off"] and (token == seq[at + i] or cache.recurrent):
                x = logits[row0 + i]
            else:
                if not state["off"]:  # the first token off the known sequence: its prefix is the teacher-forced pass's
                    state["off"] = True
                    own.copy_prefix(cache, at + i)
                x = self._over_target(self.lm.forward(self._ids([token]), own, last_only=True)[0, -1])
            return x.masked_fill(~allowed, float("-inf")) if allowed is not None else x

        return step

    @staticmethod
    def replay_round(source: str, drafted: int, stopped_early: bool, kept: int, behind: int) -> tuple[int, int]:
        """One pass per drafted token, one more for the pass that found it unsure, one more to catch up when
        more than CATCH_UP tokens arrived since it last drafted (after plain steps or n-gram rounds)."""
        if source != "draft":
            return 0, behind + kept + 1
        passes = drafted + stopped_early + (behind > CATCH_UP)
        return passes, CATCH_UP if kept == drafted else 1
