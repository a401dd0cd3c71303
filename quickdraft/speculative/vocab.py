"""Can this draft speak for this target? Same tokens at the same ids, up to padding rows."""

from __future__ import annotations

from quickdraft.errors import QuickdraftError
from quickdraft.tokenizer import Tokenizer


def check_compatible(target: Tokenizer, draft: Tokenizer, target_rows: int, draft_rows: int) -> None:
    """Raise unless both tokenizers map every id to the same token.

    The models' embedding sizes may differ (e.g. 151936 vs 152064 rows): rows beyond the tokenizer's
    vocabulary are padding, and the draft never proposes ids the target lacks (the drafter masks them).
    """
    t_size, d_size = target.vocab_size, draft.vocab_size
    for i in range(max(t_size, d_size)):
        t_tok = target.backend.id_to_token(i) if i < t_size else None
        d_tok = draft.backend.id_to_token(i) if i < d_size else None
        if t_tok != d_tok:
            raise QuickdraftError(
                f"the draft's vocabulary differs from the target's at id {i} (target {t_tok!r}, draft {d_tok!r}): "
                "use a draft of the same model family with the same tokenizer"
            )
    if max(t_size, d_size) > min(target_rows, draft_rows):
        raise QuickdraftError(
            f"a model has fewer embedding rows ({min(target_rows, draft_rows)}) than its tokenizer has "
            f"tokens ({max(t_size, d_size)}): the file is inconsistent"
        )
