"""quickdraft: run open LLMs fast on one machine, with exact speculative decoding.

    import quickdraft
    llm = quickdraft.load("qwen2.5-coder-1.5b")
    print(llm.generate("def fib(n):", max_tokens=64, temperature=0).text)

`load` returns an `LLM` (api.py); its `generate` returns a `Completion` and `stream` yields an `Event` per token.
The names below are imported on first use, so that `import quickdraft` (and the command line's --help) stays quick.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load": "quickdraft.api", "LLM": "quickdraft.api", "Completion": "quickdraft.api",
    "Event": "quickdraft.engine", "Draft": "quickdraft.speculative.draft", "Grammar": "quickdraft.grammar",
    "SamplingParams": "quickdraft.config", "SpeculationConfig": "quickdraft.config", "EngineConfig": "quickdraft.config",
    "QuickdraftError": "quickdraft.errors",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'quickdraft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
