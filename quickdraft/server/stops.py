"""Stop strings over streamed text: hold back what could still become a stop string, cut at the first match.

Each stop string is followed by a Knuth-Morris-Pratt automaton over the characters as they arrive, so each
character costs O(1) amortised per stop string, however long the stop strings and the held text are (a search of
the held text at every piece would cost its length each time: quadratic in a long near-match).
"""

from __future__ import annotations


def _failure(pattern: str) -> list[int]:
    """KMP's failure function: fail[i] = length of the longest proper prefix of pattern[:i + 1] that is also a
    suffix of it."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # per stop string: how much of it the text's end matches
        self.held = ""  # the tail of the text that is a prefix of some stop string
        self.matched = False

    def push(self, text: str) -> str:
        """Take the next piece; return what can be shown now (nothing after a match)."""
        if self.matched or not self.stops:
            return "" if self.matched else text
        buf = self.held + text
        start = len(self.held)  # characters before this have been fed already
        for offset, c in enumerate(text):
            for j, stop in enumerate(self.stops):
                k, fail = self.state[j], self.fail[j]
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):  # the first stop string complete ends the text, as a streamed generation stops
                    self.matched, self.held = True, ""
                    return buf[:start + offset + 1 - len(stop)]
                self.state[j] = k
        keep = max(self.state)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once the generation ended without a match."""
        out, self.held = ("" if self.matched else self.held), ""
        return out
