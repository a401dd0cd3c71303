"""Stop strings over streamed text: hold back what could still become a stop string, cut at the first match."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # the tail of the text that is a prefix of some stop string
        self.matched = False

    def push(self, text: str) -> str:
        """Take the next piece; return what can be shown now (nothing after a match)."""
        if self.matched or not self.stops:
            return "" if self.matched else text
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.matched, self.held = True, ""
            return buf[:min(hits)]
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once the generation ended without a match."""
        out, self.held = ("" if self.matched else self.held), ""
        return out
