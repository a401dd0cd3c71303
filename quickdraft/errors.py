"""The one exception type that front ends show to users as a single line."""

from __future__ import annotations

from typing import Mapping

# The library's keyword for a setting where it differs from the setting's own name (what str() of an error says)
KEYWORDS = {"chat": "messages", "prompt": "the prompt", "ngram": "ngram=True"}


class QuickdraftError(Exception):
    """A problem the user can fix: the message names the cause and the fix.

    Where the fix is a setting, the message names it in braces by the library's name for it ("raise {context}") and
    lists it in `settings`: each front end writes it its own way with `say` (the command line its flag, --ctx; the
    server the request's field), and str() gives the library's keyword (context=). The CLI prints it as one line (no
    traceback unless --debug) and exits non-zero.
    """

    def __init__(self, message: str, *settings: str):
        super().__init__(message)
        self.message, self.settings = message, settings

    def say(self, names: Mapping[str, str] = KEYWORDS) -> str:
        """The message with each setting written as `names` has it (else by its own name)."""
        text = self.message
        for setting in self.settings:
            text = text.replace("{" + setting + "}", names.get(setting, setting))
        return text

    def __str__(self) -> str:
        return self.say()


def read_json(path) -> object:
    """A JSON file's value; a file that is not JSON is a QuickdraftError naming it and where it stops being JSON (a
    checkpoint's config.json cut short or hand-edited), not a parser's traceback."""
    import json
    from pathlib import Path

    text = Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError as e:
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise QuickdraftError(f"{path} is not valid JSON{where}: fix it, or download the checkpoint again") from None
