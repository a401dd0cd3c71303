"""From the target's logits to the tokens a step emits, as functions of the logits, the sequence and its proposal:
the target's own choice (a prefill's first token, a plain step), a chain's verification and a tree's. Each keeps the
sequence's cache to what it emits (rollback, or a tree's path committed in place)."""

from __future__ import annotations

import torch

from quickdraft import constraint as constraints, sampling
from quickdraft.config import SamplingParams
from quickdraft.engine.sequence import Sequence
from quickdraft.runtime.kv_cache import TreeRows
from quickdraft.speculative.accept import accept_greedy, accept_sampled, accept_tree_greedy, accept_tree_sampled
from quickdraft.speculative.base import Proposal


def choose(s: Sequence, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
    """The target's token after s.tokens from its logits (1, V), as a plain step chooses it, and its scores."""
    device, raw = logits.device, logits
    if s.constraint is not None:
        logits = constraints.apply(logits, s.constraint.allowed(device))
    history = sampling.history(s.tokens, s.params, device)
    token = int(sampling.next_token(logits, s.params, history, s.generators.on(device), len(s.tokens)))
    return [token], scores(raw, logits, history, 0, s.params)


def scores(raw, masked, history, k: int, params: SamplingParams) -> torch.Tensor | None:
    """Log-probabilities (k + 1, V) of the positions a pass scored, when the request asks for them: from the raw
    logits, or (post_sampling) from the distribution each position's token is drawn from. Both are functions
    of the target's logits there alone, so a plain step and a round give the same."""
    if params.logprobs is None:
        return None
    if not params.post_sampling:
        return torch.log_softmax(raw.float(), -1)
    return per_position(masked, history, k, lambda x, h: sampling.process(x, params, h)).log()


def chain(s: Sequence, proposal: Proposal, logits: torch.Tensor, masks, vocab: int):
    """Accept from the target's logits (k + 1, V) over the last token and the drafts, and roll the cache back
    to match: (the emitted tokens, the drafts kept, their scores). Under a constraint every position is masked as a
    plain step there would be (masks: the future of the drafts' masks)."""
    device, params, seq = logits.device, s.params, s.tokens
    raw = logits
    if masks is not None:
        logits = constraints.apply(logits, constraints.unpack(masks.result().to(device), logits.shape[-1]))
    drafts = torch.tensor(proposal.tokens, device=device)
    k = len(proposal.tokens)
    history = sampling.history(seq, params, device, appended=proposal.tokens)
    scored = scores(raw, logits, history, k, params)
    if params.greedy:
        rows = per_position(logits, history, k, lambda x, h: sampling.penalize(x, params, h))
        tokens, accepted = accept_greedy(rows.argmax(-1), drafts)
    else:
        p_target = per_position(logits, history, k, lambda x, h: sampling.process(x, params, h))
        if params.seed is not None:  # the target's own seeded choices: keep the drafts that match them
            tokens, accepted = accept_greedy(sampling.gumbel_choice(p_target, params.seed, len(seq)), drafts)
        else:
            q_draft = proposal.q_rows(vocab, device).to(device)
            tokens, accepted = accept_sampled(p_target, q_draft, drafts, s.generators.on(device))
    s.cache.rollback(len(seq) + accepted)  # keep the last token and the accepted drafts
    return tokens, accepted, scored


def tree(s: Sequence, proposal: Proposal, logits: torch.Tensor, vocab: int) -> tuple[list[int], list[int]]:
    """Accept over a tree from the target's logits (1 + N, V) at its rows: each row scored as a plain step after
    its own path would score it (the penalties' history is that path), the walk greedy, seeded or by recursive
    rejection sampling; the kept path's keys and values put in place (TreeRows.commit). Returns (the emitted
    tokens, the kept rows)."""
    device, params, seq = logits.device, s.params, s.tokens
    paths = tree_paths(proposal)

    def rows(fn):
        return torch.cat([fn(logits[r:r + 1], sampling.history(seq, params, device, appended=paths[r]))
                          for r in range(logits.shape[0])])

    if params.greedy:
        choices = rows(lambda x, h: sampling.penalize(x, params, h)).argmax(-1).tolist()
        tokens, path = accept_tree_greedy(choices, proposal.tokens, proposal.parents)
    else:
        p_rows = rows(lambda x, h: sampling.process(x, params, h))
        if params.seed is not None:  # the target's own seeded choice at each row's position
            choices = [int(sampling.gumbel_choice(p_rows[r:r + 1], params.seed, len(seq) + d)[0])
                       for r, d in enumerate(tree_depths(proposal))]
            tokens, path = accept_tree_greedy(choices, proposal.tokens, proposal.parents)
        else:
            q_rows = proposal.q_rows(vocab, device).to(device)
            tokens, path = accept_tree_sampled(p_rows, q_rows, proposal.tokens, proposal.parents,
                                               s.generators.on(device))
    TreeRows.commit(s.cache, len(seq) - 1, path)
    return tokens, path


def per_position(logits, history, k, fn):
    """Apply a processing step to each of the k + 1 positions with the history it would have had."""
    if history is None:
        return fn(logits, None)
    return torch.cat([fn(logits[i:i + 1], history[: history.shape[0] - k + i]) for i in range(k + 1)])


def tree_shape(proposal: Proposal) -> tuple[list[int], int] | None:
    """A proposal's tree as a pass takes it (Transformer.forward_segments): its rows' depths and the chain's rows;
    None for a chain."""
    return None if proposal.parents is None else (tree_depths(proposal), 1 + proposal.chain)


def tree_depths(proposal: Proposal) -> list[int]:
    """Each row's distance from the pending token (row 0) in a tree's pass."""
    depths = [0]
    for parent in proposal.parents:
        depths.append(depths[parent + 1] + 1)
    return depths


def tree_paths(proposal: Proposal) -> list[list[int]]:
    """Each row's drafted tokens from the pending token's on, itself included (row 0: none)."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(proposal.tokens, proposal.parents):
        paths.append(paths[parent + 1] + [token])
    return paths
