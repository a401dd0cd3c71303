"""quickdraft: run open LLMs fast on one machine, with exact speculative decoding."""

__version__ = "0.1.0"
