"""Can this draft speak for this target? The same token at every id they both have, and few ids only one has."""

from __future__ import annotations

from quickdraft.errors import QuickdraftError
from quickdraft.tokenizer import Tokenizer

# Ids only one of the two has, at most, as a share of those they share. Sizes of one family differ by a few padding
# or added tokens (Gemma 3's 4B-27B files add an image token and padding to 262,208, its 270M and 1B have 262,144;
# llama.cpp's own check allows 128); a vocabulary that is a small prefix of the other's belongs to another model.
MAX_UNSHARED = 0.01


def check_compatible(target: Tokenizer, draft: Tokenizer, target_rows: int, draft_rows: int) -> int:
    """The number of ids both vocabularies share (ids from 0 on, the same token at each: the ids a draft may
    propose); raise unless they agree on all of them and only a few ids belong to one alone.

    The models' embedding sizes may differ from their vocabularies (151,936 rows for 151,665 tokens): rows past a
    tokenizer's tokens are padding. The drafter never proposes an id past the shared ones, and feeds the draft a
    stand-in for a target token it does not have (exactness holds: the target verifies every draft).
    """
    for name, tokenizer, rows in (("target", target, target_rows), ("draft", draft, draft_rows)):
        if tokenizer.vocab_size > rows:
            raise QuickdraftError(
                f"the {name} has fewer embedding rows ({rows}) than its tokenizer has tokens "
                f"({tokenizer.vocab_size}): the file is inconsistent"
            )
    t_tokens, d_tokens = _by_id(target), _by_id(draft)
    shared = min(len(t_tokens), len(d_tokens))
    for i in range(shared):
        if t_tokens[i] != d_tokens[i]:
            raise QuickdraftError(
                f"the draft's vocabulary differs from the target's at id {i} (target {t_tokens[i]!r}, draft "
                f"{d_tokens[i]!r}): use a draft of the same model family with the same tokenizer"
            )
    unshared = max(len(t_tokens), len(d_tokens)) - shared
    if unshared > MAX_UNSHARED * shared:
        raise QuickdraftError(
            f"the draft's vocabulary has {len(d_tokens)} tokens and the target's {len(t_tokens)}: they agree on the "
            f"first {shared}, but {unshared} belong to one alone; use a draft of the same model family and size "
            "of vocabulary"
        )
    return shared


def _by_id(tokenizer: Tokenizer) -> list[str | None]:
    """Every id's token (None for an id with none: a gap)."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens
