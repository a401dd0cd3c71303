"""The bundled prompt set: code, question answering and summarisation, in English and Chinese.

Fixed texts, so that figures from `verify` (and the benchmarks) on different machines or days compare.
"""

from __future__ import annotations

_ARTICLE_EN = (
    "The printing press, developed by Johannes Gutenberg around 1440, made copies of books cheap. Before it, "
    "a single book could take a scribe months to copy by hand, and libraries held a few hundred volumes at "
    "most. Within fifty years presses were working in more than two hundred European cities and had printed "
    "millions of books. Reading spread from monasteries to merchants and craftsmen, scientists could compare "
    "identical copies of the same tables and diagrams, and ideas crossed borders faster than ever before."
)
_ARTICLE_ZH = (
    "高铁是指设计时速在二百五十公里以上的铁路客运系统。中国在二零零八年开通了第一条真正意义上的高速铁路，"
    "即京津城际铁路。此后十多年里，高铁网络迅速扩展，连接了大部分省会城市。高铁缩短了城市之间的时间距离，"
    "改变了人们的出行方式，也带动了沿线地区的经济发展，但建设成本高、部分线路客流不足等问题也引起了讨论。"
)

PROMPTS: dict[str, str] = {
    "code-en": "Write a Python function that merges two sorted lists into one sorted list, with a docstring "
               "and a short example.",
    "code-zh": "用 Python 写一个函数，判断一个字符串是否是回文，并加上中文注释。",
    "qa-en": "What causes the seasons on Earth? Answer in a short paragraph.",
    "qa-zh": "为什么天空是蓝色的？请用一段话回答。",
    "summary-en": "Summarize the following text in two sentences, reusing its wording:\n\n" + _ARTICLE_EN,
    "summary-zh": "请用两句话概括下面这段文字：\n\n" + _ARTICLE_ZH,
}


def _long(text: str, copies: int) -> str:
    return "Summarize the following text in three sentences:\n\n" + "\n\n".join([text] * copies)


def reference_text() -> str:
    """The bundled reference text (~1,000 tokens: the quality text tune --formats scores, a conversation's system
    prompt)."""
    from importlib import resources

    return resources.files("quickdraft").joinpath("data/ppl.txt").read_text(encoding="utf-8")


def _review(module: str) -> str:
    """A code review of a module of Python's standard library (its text is fixed for a Python version: 3.11 here)."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(module))
    return ("Review the following Python module: point out bugs, unclear code and missing tests, quoting the lines "
            f"you mean.\n\n```python\n{source}```")


def _edit(module: str) -> str:
    """A code edit: a module of Python's standard library given whole, to be returned whole with a change (an answer
    that is mostly the prompt's text again: what suffix decoding and lookup draft from)."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(module))
    return ("Rename the parameter `lo` to `low` and `hi` to `high` everywhere in this Python module, and return the "
            f"whole module, changed, with nothing else.\n\n```python\n{source}```")


# Long prompts: what the time to first token is made of, and what a draft's cost grows with (about 1,000, 4,000, 1,000,
# 5,500 and 11,500 tokens with the default pair's tokenizer; long-4k repeats one text, the reviews do not), and a code
# edit (about 1,000 tokens, whose answer copies it). Not in the default set (a cold prefill of each per run); name them
# with --prompts.
LONG = {"long-1k": lambda: _long(reference_text(), 1), "long-4k": lambda: _long(reference_text(), 4),
        "review-1k": lambda: _review("bisect"), "review-5k": lambda: _review("pprint"),
        "review-12k": lambda: _review("configparser"), "edit-1k": lambda: _edit("bisect")}
NAMES = [*PROMPTS, *LONG]


def text(name: str) -> str:
    return PROMPTS[name] if name in PROMPTS else LONG[name]()


def encoded(tokenizer, names: list[str] | None = None) -> dict[str, list[int]]:
    """The prompts as chat turns for the model's template (raw text when it has none), encoded."""
    out = {}
    for name in names or list(PROMPTS):
        prompt = text(name)
        if tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        out[name] = tokenizer.encode(prompt)
    return out
