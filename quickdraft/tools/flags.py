"""The command line's name for each setting a QuickdraftError may name (errors.py): what the CLI and the tools it runs
(doctor's findings) write where the library writes its keyword."""

FLAGS = {
    "context": "--ctx", "max_tokens": "-n", "prompt": "the prompt (-p or --prompt-file)", "chat": "--chat",
    "device": "--device", "dtype": "--dtype", "weights": "--weights", "cache_slots": "--cache-slots",
    "draft": "--draft", "ngram": "--ngram", "draft_weights": "--draft-weights", "draft_max": "--draft-max",
    "draft_min": "--draft-min", "p_min": "--draft-p-min", "draft_vocab": "--draft-vocab", "tree": "--draft-tree",
    "draft_window": "--draft-window", "draft_history": "--draft-history",
}


def say(problem) -> str:
    """A QuickdraftError as the command line writes it (its settings as flags); other text as it is."""
    return problem.say(FLAGS) if hasattr(problem, "say") else str(problem)
