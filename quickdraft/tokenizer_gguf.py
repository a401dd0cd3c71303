"""A GGUF file's tokenizer metadata -> a `tokenizers` backend that tokenizes as llama.cpp does (its test vectors are
the check: tests/test_tokenizer_vectors.py).

The kinds, by `tokenizer.ggml.model`:
- gpt2: byte-level BPE, split first by the pre-tokenizer `tokenizer.ggml.pre` names (llama.cpp's table of regexes);
- llama: SentencePiece (Llama 2, Mistral, Phi-3, Gemma 1-3): pieces merged by score, spaces escaped as U+2581 and
  one put in front of the text (unless add_space_prefix is false), bytes the vocabulary lacks as <0xNN> tokens;
- gemma4: BPE over raw UTF-8 with spaces escaped, runs of newlines and of other characters split apart;
- bert: WordPiece, as BERT's tokenizer.
"""

from __future__ import annotations

import logging

from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers

from quickdraft.errors import QuickdraftError

log = logging.getLogger("quickdraft")

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` (src/llama-vocab.cpp), each list applied in turn
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
           r"|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_DEEPSEEK_LLM = [  # (escaped: the class holds look-alikes of ASCII letters, e.g. U+212A, the Kelvin sign)
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
]
PRE_TOKENIZERS = {
    "llama-bpe": [_LLAMA3], "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "falcon3": [_LLAMA3], "pixtral": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2], "stablelm2": [_QWEN2], "megrez": [_QWEN2],
    "qwen35": [_QWEN35],
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2], "command-r": [r"\p{N}", _GPT2],
    "smollm": [r"\p{N}", _GPT2], "codeshell": [r"\p{N}", _GPT2],
    "gpt-2": [_GPT2], "gpt2": [_GPT2], "mpt": [_GPT2], "phi-2": [_GPT2], "olmo": [_GPT2], "jais": [_GPT2],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"}  # llama.cpp: a whole-word token wins


def backend(meta: dict) -> Backend:
    """The tokenizer the metadata describes (QuickdraftError for a kind quickdraft does not read)."""
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _bpe, "llama": _spm, "gemma4": _gemma4, "bert": _wpm}
    if kind not in builders:
        raise QuickdraftError(f"unsupported tokenizer type {kind!r} in the GGUF metadata: quickdraft reads "
                              f"{', '.join(builders)} ({_KINDS}); use the model's Hugging Face directory with its "
                              "tokenizer.json")
    if "tokenizer.ggml.tokens" not in meta:
        raise QuickdraftError("the GGUF metadata lacks tokenizer.ggml.tokens: the file has no vocabulary")
    return builders[kind](meta)


_KINDS = "byte-level BPE, SentencePiece, Gemma 4's BPE and WordPiece"


def token_types(meta: dict) -> list[int]:
    tokens = meta["tokenizer.ggml.tokens"]
    return meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)


def _added(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control tokens (matched in text as special tokens) and user-defined ones (matched as written)."""
    return [AddedToken(tokens[i], special=t == CONTROL, normalized=False) for i, t in enumerate(types)
            if t in (CONTROL, USER_DEFINED)]


def _bpe(meta: dict) -> Backend:
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        log.warning("unknown pre-tokenizer %r in the GGUF metadata: using llama.cpp's default", pre)
    tok = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False,
                             ignore_merges=pre in IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([a for a in _added(tokens, types) if a.special])
    tok.add_tokens([a for a in _added(tokens, types) if not a.special])
    return tok


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges its pieces best score first: as BPE merges, every split of a normal piece into two
    normal pieces, ranked by the piece's score (transformers' SentencePieceExtractor does the same)."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm(meta: dict) -> Backend:
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unknown] if unknown is not None and 0 <= unknown < len(tokens) else None
    tok = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, _spm_merges(tokens, scores, types),
                             unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    tok.add_special_tokens([a for a in _added(tokens, types) if a.special])
    tok.add_tokens([a for a in _added(tokens, types) if not a.special])
    return tok


def _gemma4(meta: dict) -> Backend:
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([a for a in _added(tokens, types) if a.special])
    tok.add_tokens([a for a in _added(tokens, types) if not a.special])
    return tok


def _wpm(meta: dict) -> Backend:
    """llama.cpp's converter keeps a word's first piece as U+2581 + piece and a continuation (##x) as x."""
    tokens, types = meta["tokenizer.ggml.tokens"], token_types(meta)
    vocab = {}
    for i, (t, kind) in enumerate(zip(tokens, types)):
        name = t if kind == CONTROL else t[1:] if t.startswith("▁") else f"##{t}"
        vocab.setdefault(name, i)
    unknown = meta.get("tokenizer.ggml.unknown_token_id", 100)
    tok = Backend(models.WordPiece(vocab, unk_token=tokens[unknown], continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind == CONTROL])
    return tok
