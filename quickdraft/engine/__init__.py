"""The engine: sequences (sequence.py) stepped by Engine.step (engine.py: plan -> one target pass -> conclude), the
acceptance of a pass's tokens (verify.py), what a generation reports (reports.py), and several sequences stepped
together (batch.py)."""

from quickdraft.engine.batch import Batch
from quickdraft.engine.engine import Engine, Pass, draft_budget
from quickdraft.engine.reports import Event, Origin, Timings
from quickdraft.engine.sequence import Detokenizer, Halt, Sequence

__all__ = ["Batch", "Detokenizer", "Engine", "Event", "Halt", "Origin", "Pass", "Sequence", "Timings", "draft_budget"]
