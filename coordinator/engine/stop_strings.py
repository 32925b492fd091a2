"""Stop strings as one Aho-Corasick automaton: matching costs O(new characters) per token,
whatever the number of stop strings.

The automaton is built once per distinct set of stop strings (requests sharing a set share
it) and walked one character at a time by each request's ``StopMatcher``. Its state after a
character is the longest tail of the text that is a prefix of some stop string: that tail is
exactly what a stream must hold back (it may still become a stop string), and a state whose
tail ends with a whole stop string is a match. The first stop string to end wins; of several
ending at the same character, the longest (it starts first). ``SamplingParams`` caps the
strings a request may carry (``MAX_STOP_STRINGS`` of ``MAX_STOP_CHARS``), so an automaton has
at most 16,384 states.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """The trie of the stop strings with failure links (immutable once built)."""

    def __init__(self, stops: tuple[str, ...]):
        self.goto: dict[tuple[int, str], int] = {}
        self.depth = [0]  # state -> length of the text it stands for
        self.fail = [0]
        self.match = [0]  # state -> length of the longest stop string ending here (0: none)
        for s in stops:
            node = 0
            for ch in s:
                nxt = self.goto.get((node, ch))
                if nxt is None:
                    nxt = len(self.depth)
                    self.goto[node, ch] = nxt
                    self.depth.append(self.depth[node] + 1)
                    self.fail.append(0)
                    self.match.append(0)
                node = nxt
            if s:
                self.match[node] = len(s)
        self._link()
        self.longest = max((len(s) for s in stops), default=0)

    def _link(self) -> None:
        """Breadth-first failure links; a state inherits the match of its failure state."""
        children: dict[int, list[tuple[str, int]]] = {}
        for (node, ch), nxt in self.goto.items():
            children.setdefault(node, []).append((ch, nxt))
        queue = deque(nxt for _, nxt in children.get(0, ()))
        while queue:
            node = queue.popleft()
            for ch, nxt in children.get(node, ()):
                f = self.fail[node]
                while f and (f, ch) not in self.goto:
                    f = self.fail[f]
                self.fail[nxt] = self.goto.get((f, ch), 0)
                if not self.match[nxt]:
                    self.match[nxt] = self.match[self.fail[nxt]]
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and (state, ch) not in goto:
            state = fail[state]
        return goto.get((state, ch), 0)


@lru_cache(maxsize=256)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class StopMatcher:
    """One request's walk through its stop strings' automaton."""

    def __init__(self, stops: list[str]):
        self._auto = automaton(tuple(sorted(set(s for s in stops if s))))
        self._state = 0

    @property
    def empty(self) -> bool:
        return self._auto.longest == 0

    def feed(self, piece: str) -> tuple[int, int] | None:
        """Advance over ``piece``; where in ``piece`` the first stop string to end starts (negative
        when it began in earlier text) and ends, or None when none ended."""
        auto, state = self._auto, self._state
        for i, ch in enumerate(piece):
            state = auto.step(state, ch)
            if auto.match[state]:
                self._state = state
                return i + 1 - auto.match[state], i + 1
        self._state = state
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text so far that may still begin a stop string."""
        return self._auto.depth[self._state]
