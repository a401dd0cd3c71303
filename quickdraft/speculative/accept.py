"""Exact acceptance of drafted tokens (Leviathan et al. 2023; Chen et al. 2023), as pure functions.

Both take what the target computed for the k + 1 positions of a round and return the tokens the round
emits (the accepted drafts, then one token from the target) and how many drafts were accepted.
"""

from __future__ import annotations

import torch


def accept_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[list[int], int]:
    """Temperature 0: keep the longest prefix of drafts on which the target's argmax agrees, plus the
    target's own token at the first disagreement (or after the last draft). Seeded sampling uses it too,
    with the target's Gumbel choices (sampling.gumbel_choice) in place of the argmax.

    target_argmax: (k + 1,) the target's choice at each position; draft_tokens: (k,).
    """
    k = draft_tokens.shape[0]
    agree = (target_argmax[:k] == draft_tokens).int()
    n = agree.cumprod(0).sum()
    read = torch.cat([n.view(1), target_argmax]).tolist()  # one read-back to the host (a GPU's one sync)
    return read[1:read[0] + 2], read[0]  # the target's choices: equal to the drafts on the accepted prefix


def accept_sampled(p_target: torch.Tensor, q_draft: torch.Tensor, draft_tokens: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """Rejection sampling: the emitted tokens are distributed exactly as if sampled from p_target.

    p_target: (k + 1, V) the target's processed distributions at each position;
    q_draft: (k, V) the distributions the drafts were drawn from (one-hot for deterministic drafters);
    draft_tokens: (k,). Draft i is accepted with probability min(1, p(x) / q(x)); at the first rejection
    the token is drawn from normalise(max(0, p - q)); if every draft is accepted, one more token is drawn
    from p_target[k].
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=p_target.device)
    p_x, q_x = p_target[rows, draft_tokens], q_draft[rows, draft_tokens]
    u = torch.rand(k, generator=generator, device=p_target.device)
    accepted = (u * q_x < p_x).int()  # u < p/q without dividing; q_x > 0 since x was drawn from q
    n = accepted.cumprod(0).sum()  # (on the device: the last token is drawn before anything is read back)
    at = n.view(1)
    stop = at.clamp(max=k - 1)  # the rejected draft's row, if one was rejected
    residual = (p_target.index_select(0, stop) - q_draft.index_select(0, stop)).clamp_min(0)[0]
    mass = residual.sum()
    # mass is 0 only if p <= q everywhere, i.e. p == q, where no rejection can happen; guard anyway. With every draft
    # accepted (n == k) the row is p_target[k].
    dist = torch.where((n < k) & (mass > 0), residual / mass, p_target.index_select(0, at)[0])
    last = torch.multinomial(dist, 1, generator=generator)
    read = torch.cat([at, last, draft_tokens]).tolist()  # one read-back to the host (a GPU's one sync)
    n = read[0]
    return read[2:2 + n] + [read[1]], n


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Row -> its children's rows, in order (node i is row i + 1; a parent of -1 is row 0, the pending token)."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        out.setdefault(parent + 1, []).append(i + 1)
    return out


def accept_tree_greedy(choices: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """A tree's greedy walk (seeded sampling's too, with the target's Gumbel choices): from the pending token's
    row, follow the child whose token is the target's choice at the row, while there is one; emit the target's
    choices along the way. choices: the target's choice at each row (1 + len(tokens)); tokens, parents: the nodes
    (node i at row i + 1, its parent's node index or -1). Returns (the emitted tokens, the rows of the kept path:
    0 first)."""
    children = _children(parents)
    row, path, out = 0, [0], []
    while True:
        choice = choices[row]
        out.append(choice)
        following = next((r for r in children.get(row, []) if tokens[r - 1] == choice), None)
        if following is None:
            return out, path
        path.append(following)
        row = following


def accept_tree_sampled(p_rows: torch.Tensor, q_rows: torch.Tensor, tokens: list[int], parents: list[int],
                        generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Recursive rejection sampling over a tree (SpecInfer's multi-candidate rule): at each row the children are
    tried in order, child x drawn from q_x (its row of q_rows, the distribution it was drawn from; one-hot for a
    deterministic candidate, which may depend on the candidates before it): accepted with probability
    min(1, r(x) / q_x(x)), r the target's distribution at the row at first and, after each rejection,
    normalise(max(0, r - q_x)); an accepted child's row is walked next, and where every child is rejected (or there
    is none) the last token is drawn from r. The emitted tokens are distributed exactly as the target's own.

    p_rows: (1 + N, V) the target's processed distributions at each row; q_rows: (N, V). Returns (the emitted tokens,
    the rows of the kept path: 0 first)."""
    children = _children(parents)
    row, path, out = 0, [0], []
    while True:
        r = p_rows[row]
        chosen = None
        for child in children.get(row, []):
            x, q = tokens[child - 1], q_rows[child - 1]
            u = float(torch.rand(1, generator=generator, device=p_rows.device))
            if u * float(q[x]) < float(r[x]):
                chosen = child
                break
            residual = (r - q).clamp_min(0)
            mass = residual.sum()
            if float(mass) > 0:  # 0 only where r <= q everywhere, i.e. r == q: no rejection can happen there
                r = residual / mass
        if chosen is None:
            out.append(int(torch.multinomial(r, 1, generator=generator)))
            return out, path
        out.append(tokens[chosen - 1])
        path.append(chosen)
        row = chosen
