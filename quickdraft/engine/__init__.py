"""The engine: sequences (sequence.py) stepped by Engine.step (engine.py: schedule -> one target pass -> conclude),
what each step works on (scheduler.py), one sequence's speculative round (round.py), the acceptance of a pass's tokens
(verify.py), what a generation reports (reports.py), and several sequences stepped together (batch.py)."""

from quickdraft.engine.batch import Batch
from quickdraft.engine.engine import Engine, Pass
from quickdraft.engine.round import draft_budget
from quickdraft.engine.reports import Event, Origin, Timings
from quickdraft.engine.sequence import Detokenizer, Halt, Sequence

__all__ = ["Batch", "Detokenizer", "Engine", "Event", "Halt", "Origin", "Pass", "Sequence", "Timings", "draft_budget"]
