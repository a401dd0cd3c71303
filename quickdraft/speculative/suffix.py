"""Suffix decoding (Oliveira et al., arXiv 2411.04975; vLLM's `suffix` method): drafts looked up in suffix trees of
what was written before, scored by how often each continuation followed.

Two trees answer each round: the request's own (its prompt and what it has generated so far) and its scope's history
(what this server answered before under the same API key: agents re-emit their tool calls, assistants the file they
were given, chats their own answers). Each is a trie of every suffix of its sequences up to `depth` tokens, a node
counting the suffix starts through it. A round matches the longest suffix of the sequence it can (up to depth - 1
tokens) and, from each matched length, walks the most frequent continuation while its probability (the product of
count ratios along the way) stays at least `min_prob`, for at most `factor` x the match length tokens: a long match
drafts long, a short one little. The best-scoring draft (the sum of its probabilities) of the two trees is proposed,
the request's own on a tie. The target verifies it like any drafter's (a deterministic proposal: exact at any
temperature).

The walk and its tie rules are arctic-inference 0.3.0's (SuffixDecodingCache, which vLLM calls): siblings in
non-increasing count, among equals the one whose count changed last first, a new one last; the proposals equal the
reference's on the same token streams (tests/test_suffix.py, against its recorded answers).

History is scoped and bounded: a scope's tree never holds more than its budget of tokens (the oldest answers dropped
first), is never written to disk, and `--draft-history 0` keeps none (docs/server.md says what timing can reveal).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from quickdraft.speculative.base import Branches, Drafter, KFor, Offer, Proposal

DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth
FACTOR = 1.0  # draft at most FACTOR x the match length (vLLM's max_spec_factor)
MIN_PROB = 0.1  # stop where a continuation's probability falls below this (vLLM's min_token_prob)
HISTORY = 16384  # a scope's history: at most this many tokens of answers (at most DEPTH trie nodes each: ~80 MB)
F32 = np.float32  # the reference computes its probabilities in float32: the same roundings, the same choices

class Node:
    """A trie node: the suffix starts through it (count), its children by token, and its place among its siblings:
    a list in non-increasing count whose ties are ordered by how each count was reached (the reference's rules: a new
    child goes last; one whose count rises goes to the head of its new group if it led its old one, else to its tail;
    one whose count falls leads its new group). heads and tails: each count's first and last child."""
    __slots__ = ("count", "kids", "token", "parent", "prev", "next", "first", "last", "heads", "tails")

    def __init__(self, token: int = -1, parent: "Node | None" = None):
        self.count, self.kids, self.token, self.parent = 0, None, token, parent
        self.prev = self.next = self.first = self.last = None
        self.heads = self.tails = None

    def ranked(self) -> list["Node"]:
        """The children, most frequent first (ties as the reference orders them)."""
        out, node = [], self.first
        while node is not None:
            out.append(node)
            node = node.next
        return out

    # ---- the children's order ----------------------------------------------------------------------------

    def add(self, token: int) -> "Node":
        """A new child of count 1, last."""
        child = Node(token, self)
        child.count = 1
        if self.kids is None:
            self.kids, self.heads, self.tails = {}, {}, {}
        self.kids[token] = child
        self._link_after(child, self.last)
        self.heads.setdefault(1, child)
        self.tails[1] = child
        return child

    def raise_count(self, child: "Node") -> None:
        """child's count + 1, moved before the group of the sibling before it where that sibling's count is at most
        the new one (the reference's increment)."""
        c, before = child.count, child.prev
        led = self.heads[c] is child
        self._leave(child, c)
        if before is not None and before.count <= c + 1:
            self._unlink(child)
            self._link_after(child, self.heads[before.count].prev)
        child.count = c + 1
        self._join(child, c + 1)

    def lower_count(self, child: "Node") -> None:
        """child's count - 1, moved behind the rest of its group first (the reference's decrement)."""
        c = child.count
        self._leave(child, c)
        tail = self.tails.get(c)
        if tail is not None:  # (others of its count stay before it)
            self._unlink(child)
            self._link_after(child, tail)
        child.count = c - 1
        self._join(child, c - 1)

    def drop(self, child: "Node") -> None:
        """child (count 1) removed."""
        self._leave(child, child.count)
        self._unlink(child)
        del self.kids[child.token]

    def _leave(self, child: "Node", c: int) -> None:
        """child leaves the group of count c (heads and tails of it mended)."""
        head, tail = self.heads[c], self.tails[c]
        if head is tail:
            del self.heads[c], self.tails[c]
        elif head is child:
            self.heads[c] = child.next
        elif tail is child:
            self.tails[c] = child.prev

    def _join(self, child: "Node", c: int) -> None:
        """child, in place, is of count c now: the head of its group where none of that count is before it."""
        if c not in self.heads:
            self.heads[c] = self.tails[c] = child
        elif child.prev is None or child.prev.count != c:
            self.heads[c] = child
        elif child.next is None or child.next.count != c:
            self.tails[c] = child

    def _unlink(self, child: "Node") -> None:
        if child.prev is None:
            self.first = child.next
        else:
            child.prev.next = child.next
        if child.next is None:
            self.last = child.prev
        else:
            child.next.prev = child.prev
        child.prev = child.next = None

    def _link_after(self, child: "Node", after: "Node | None") -> None:
        """child into the list after `after` (None: first)."""
        child.prev = after
        child.next = self.first if after is None else after.next
        if after is None:
            self.first = child
        else:
            after.next = child
        if child.next is None:
            self.last = child
        else:
            child.next.prev = child


class SuffixTree:
    """Every suffix of its sequences, up to `depth` tokens, as a trie with counts."""

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self.root = Node()
        self.sequences: dict = {}  # id -> its tokens
        self.active: dict = {}  # id -> the nodes its last suffixes (up to depth of them) end at
        self.nodes = 1

    def extend(self, key, tokens) -> None:
        """Append tokens to sequence `key` (a new one if unseen): each is the end of up to `depth` new suffixes."""
        seq, active = self.sequences.setdefault(key, []), self.active.setdefault(key, [])
        for token in tokens:
            token = int(token)
            active.append(self.root)
            self.root.count += 1
            if len(active) > self.depth:
                active.pop(0)
            seq.append(token)
            for i, node in enumerate(active):
                child = node.kids.get(token) if node.kids else None
                if child is None:
                    child = node.add(token)
                    self.nodes += 1
                else:
                    node.raise_count(child)
                active[i] = child

    def remove(self, key) -> None:
        """Forget sequence `key`: each of its suffixes counts no more, nodes no suffix passes through are dropped."""
        seq = self.sequences.pop(key, None)
        self.active.pop(key, None)
        if seq is None:
            return
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for token in seq[start:start + self.depth]:
                child = node.kids.get(token) if node.kids else None
                if child is None:
                    break
                if child.count > 1:
                    node.lower_count(child)
                    node = child
                    continue
                node.drop(child)
                self.nodes -= _size(child)
                break

    def match(self, context: list[int]) -> Node | None:
        node = self.root
        for token in context:
            node = node.kids.get(token) if node.kids else None
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], most: int, factor: float = FACTOR, min_prob: float = MIN_PROB):
        """The best draft after `context` (its last depth - 1 tokens at most matter): (tokens, probabilities, score,
        match length, the nodes drafted from); for each match length the walk of its most frequent continuation
        (walk), the best score kept, the longer match on a tie."""
        context = context[-self.depth:]
        best = ([], [], F32(0), 0, [])
        for length in range(1, len(context)):
            node = self.match(context[len(context) - length:])
            if node is None:
                break
            limit = max(0, min(most, int(float(F32(F32(F32(length) * F32(factor)))) + 1e-6)))
            tokens, probs, score, path = walk(node, limit, F32(min_prob))
            if score >= best[2]:
                best = (tokens, probs, score, length, path)
        return best


def walk(node: Node, limit: int, min_prob) -> tuple[list[int], list[float], object, list[Node]]:
    """From `node`, the most frequent continuation while its probability stays at least min_prob: tokens, their
    probabilities, their sum (float32, as the reference), and the nodes each was drafted from."""
    tokens, probs, path, prob, score = [], [], [], F32(1), F32(0)
    while len(tokens) < limit and prob >= min_prob:
        child = node.first
        if child is None:
            break
        prob = F32(prob * (F32(child.count) / F32(node.count)))
        if not prob >= min_prob:
            break
        path.append(node)
        tokens.append(child.token)
        probs.append(float(prob))
        score = F32(score + prob)
        node = child
    return tokens, probs, score, path


def _size(node: Node) -> int:
    """Nodes in the subtree at node."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += 1
        if n.kids:
            stack.extend(n.kids.values())
    return total


class History:
    """What a server answered before, per scope (the request's `user`; one scope where none is given): a suffix tree
    of each scope's answers, within `budget` tokens a scope (its oldest answers dropped first). Held in memory only;
    budget 0 keeps nothing."""

    def __init__(self, budget: int = HISTORY, depth: int = DEPTH):
        self.budget, self.depth = budget, depth
        self.scopes: dict = {}  # scope -> (SuffixTree, OrderedDict of its answers' keys -> lengths, oldest first)
        self.keys = itertools.count()

    def tree(self, scope) -> SuffixTree | None:
        """The scope's tree (None: no history kept, or none yet)."""
        held = self.scopes.get(scope)
        return held[0] if held is not None else None

    def add(self, scope, tokens: list[int]) -> None:
        """An answer of the scope's: into its tree (its last `budget` tokens at most), then its oldest answers out
        until the tree holds no more than the budget."""
        tokens = tokens[-self.budget:] if self.budget > 0 else []
        if not tokens:
            return
        tree, answers = self.scopes.setdefault(scope, (SuffixTree(self.depth), OrderedDict()))
        key = next(self.keys)
        tree.extend(key, tokens)
        answers[key] = len(tokens)
        while sum(answers.values()) > self.budget:
            oldest, _ = answers.popitem(last=False)
            tree.remove(oldest)

    def tokens(self, scope=None) -> int:
        """Tokens of answers held (for a scope, else for all)."""
        held = [self.scopes[scope]] if scope is not None else list(self.scopes.values())
        return sum(sum(answers.values()) for _, answers in held if answers)


class SuffixDrafter(Drafter):
    """Drafts from the request's own suffix tree and its scope's history (the module's note)."""

    kind = "suffix"
    named = lookup = True
    sources = ("suffix",)
    name = "suffix"
    trees = True

    def __init__(self, history: History | None = None, depth: int = DEPTH, factor: float = FACTOR,
                 min_prob: float = MIN_PROB):
        self.history = history if history is not None else History()  # (shared by its forks: the engine's slots)
        self.depth, self.factor, self.min_prob = depth, factor, min_prob
        self.scope = None  # whose history this generation reads and adds to (scoped)
        self.begin([])

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "SuffixDrafter":
        return cls(History(getattr(speculation, "draft_history", HISTORY)))

    def fork(self) -> "SuffixDrafter":
        return SuffixDrafter(self.history, self.depth, self.factor, self.min_prob)  # one history for every slot

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        self.own = SuffixTree(self.depth)
        self.seen = 0  # tokens of the sequence in own
        self.own.extend(0, prompt)
        self.seen = len(prompt)

    def scoped(self, scope) -> None:
        self.scope = scope

    def finish(self, tokens: list[int], prompt_n: int) -> None:
        """A generation ended with `tokens`: its answer (after its prompt's prompt_n) joins the scope's history."""
        self.history.add(self.scope, tokens[prompt_n:])

    def _draft(self, seq: list[int], k: int):
        if len(seq) < self.seen:  # (a sequence the drafter was not begun for)
            self.begin(seq)
        self.own.extend(0, seq[self.seen:])
        self.seen = len(seq)
        best = self.own.speculate(seq, k, self.factor, self.min_prob)
        shared = self.history.tree(self.scope)
        if shared is not None:
            theirs = shared.speculate(seq, k, self.factor, self.min_prob)
            if theirs[2] > best[2]:
                best = theirs
        return best

    def propose(self, seq, k_for: KFor, params, generator, constraint=None,
                branches: Branches | None = None) -> Proposal:
        k = k_for("suffix")
        if k <= 0 or len(seq) < 2:
            return Proposal([], "suffix")
        tokens, probs, _, _, path = self._draft(seq, k)
        if constraint is not None:  # cut where the grammar would refuse: the target surely would
            tokens = tokens[:constraint.valid_prefix(tokens)]
        if branches is not None and tokens:
            tree = self._tree(tokens, probs, path, branches("suffix", len(tokens)))
            if tree is not None:
                return tree
        return Proposal(tokens, "suffix")

    @staticmethod
    def _tree(tokens: list[int], probs: list[float], path: list[Node], width: int) -> Proposal | None:
        """The chain with up to width - 1 alternatives at its least sure step (the branching point whose chosen
        continuation took the smallest share of its node's count): the next most frequent continuations there."""
        if width < 2:
            return None
        j = min(range(len(tokens)), key=lambda i: path[i].first.count / path[i].count)
        others = [n.token for n in path[j].ranked() if n.token != tokens[j]][:width - 1]
        if not others:
            return None
        return Proposal(tokens + others, "suffix", parents=list(range(-1, len(tokens) - 1)) + [j - 1] * len(others),
                        chain=len(tokens))

    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Deterministic in the sequence (and the history as it is): each position's proposal asked for directly."""
        self.begin(prompt)
        out = [Offer("", 0, 0)]
        for t in range(1, len(output)):
            tokens = self._draft(prompt + output[:t], kmax)[0]
            kept = next((i for i, (a, b) in enumerate(zip(tokens, output[t:])) if a != b),
                        min(len(tokens), len(output) - t))
            out.append(Offer("suffix", len(tokens), kept) if tokens else Offer("", 0, 0))
        return out
