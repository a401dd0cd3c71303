"""Decode and verification passes as CUDA graphs: captured once, replayed at any position.

A one-token step launches hundreds of kernels; on a GPU each launch costs microseconds of host time, which
can add up to more than the step's weight reads on a fast card. A CUDA graph replays the whole pass
as one launch. A graph fixes its tensors' addresses and shapes, so every pass is the same pass:
`Transformer.forward_at` takes the positions as a device tensor (rotary tables and cache writes index by
it) and attends over the whole cache under a mask.

Every pass of up to WIDTH tokens (a plain step: 1; a verification: k + 1; a draft model's step) is padded
to WIDTH rows and replays the same graph. WIDTH is the row tile of the int4 kernel (tinygemm: 16 rows; a pass
of 17 would read every weight twice), so a round drafts at most WIDTH - 1 tokens on CUDA (Engine.max_draft).
Padding costs little where decoding is bound by memory (WIDTH rows read the weights once) and buys exactness:
each row goes through the same kernels with the same shapes whatever the pass, so a verification gives every
position bit for bit the logits a plain step gives it, and greedy speculative output stays identical to plain
output. (The padding rows write keys and values beyond the cache's length, which no row attends to and the next
pass overwrites.) A pass no graph runs (a hybrid's, a mixture of experts') is padded to WIDTH rows eagerly, for
the same reason (LoadedModel.forward).

Every pass attends over the cache's whole capacity (the rows' masks hide what is not theirs): one graph
per cache, and the same attention kernel with the same shapes at every position, for the same exactness.
Reading the whole cache costs a few percent more bytes a step than reading the valid part (the keys and values
of a small-head-count model are small against its weights). Graphs of smaller spans
growing with the sequence would save that, but a position would then be computed over different spans in
a plain and in a speculative run, by a softmax whose reduction order follows the length.

A graph is captured when a pass first needs it and checked once against the same pass run eagerly: a graph
that disagrees is never used (a warning says so, and `disabled` says why: benchmarks check it) and the model runs
eagerly from then on.

A graph writes into its cache's tensors, so it lives exactly as long as that cache: it holds the cache weakly and
is dropped when the cache is (an engine's cache is the one the memory plan counts; a benchmark's or a tool's
short-lived caches are not kept alive by their graphs).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict

import torch

from quickdraft.quant.gpu import ROW_TILE

WIDTH = ROW_TILE  # rows of every graphed pass: a verification of up to WIDTH - 1 drafts plus its last token
KEEP = 4  # graphs kept, one per live cache (least recently used dropped): an engine's, a drafter's, a benchmark's
TOLERANCE = 1e-2  # most a graph's logits may differ from the eager pass's, relative to their largest


def cuda_capture(fn):
    """Capture fn (which returns a tensor) as a CUDA graph; (replay, output): replay() reruns it into output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up runs (library handles, workspaces) outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA calls stay legal
        output = fn()
    return graph.replay, output


def eager_capture(fn):
    """The same contract without a GPU: replay() runs fn again into the same output (tests the bookkeeping)."""
    output = fn()
    return (lambda: output.copy_(fn())), output


class _Graph:
    def __init__(self, model, cache, width: int, capture, tokens: torch.Tensor):
        """Captured on the pass of tokens at the cache's length (warm-up runs write its keys and values). The cache
        is held weakly: StepGraphs drops the graph with it."""
        device = model.device
        self.tokens = torch.zeros(1, width, dtype=torch.long, device=device)
        self.base = torch.arange(width, device=device)
        self.positions = self.base.clone()
        self.load(tokens, cache.length)
        ref, span = weakref.ref(cache), cache.capacity
        self.replay, self.logits = capture(lambda: model.forward_at(self.tokens, self.positions, ref(), span))

    def load(self, tokens: torch.Tensor, start: int) -> None:
        S = tokens.shape[1]
        self.tokens[:, :S].copy_(tokens)
        self.tokens[:, S:].zero_()
        torch.add(self.base, start, out=self.positions)


class StepGraphs:
    """The graphed passes of one model (LoadedModel.graphs): `applies` says whether a pass can replay one,
    `run` replays it as Transformer.forward would run it."""

    def __init__(self, model, width: int = WIDTH, capture=None):
        self.model, self.width = model, width
        self.capture = capture or (cuda_capture if model.device.type == "cuda" else eager_capture)
        self.graphs: OrderedDict = OrderedDict()
        self.disabled: str | None = None  # why graphs are off for this model, once they are
        if getattr(model, "hybrid", False):  # the recurrent state's history is host bookkeeping per pass
            self.disabled = "a hybrid model's linear-attention layers run eagerly"
        elif getattr(model.cfg, "n_experts", 0) if hasattr(model, "cfg") else False:  # routing reads the experts
            self.disabled = "a mixture of experts runs eagerly (its routing picks experts on the host)"

    def applies(self, tokens: torch.Tensor, cache) -> bool:
        return (self.disabled is None and tokens.shape[0] == 1 and cache.batch == 1 and not cache.offset
                and tokens.shape[1] <= self.width
                and cache.length + self.width <= min(cache.capacity, self.model.max_context))

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
        S, start = tokens.shape[1], cache.length
        key = id(cache)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(tokens, cache)
            if graph is None:  # disabled: the pass runs eagerly
                return self.model(tokens, cache, last_only)
            self.graphs[key] = graph
            weakref.finalize(cache, self.graphs.pop, key, None)  # the graph goes with its cache
            while len(self.graphs) > KEEP:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            graph.load(tokens, start)
            graph.replay()
        cache.length = start + S
        return (graph.logits[:, S - 1:S] if last_only else graph.logits[:, :S]).clone()

    def _capture(self, tokens: torch.Tensor, cache) -> _Graph | None:
        """A new graph for this cache, checked on this pass; None (graphs disabled) if it fails or disagrees."""
        try:
            graph = _Graph(self.model, cache, self.width, self.capture, tokens)
            graph.replay()
            want = self.model.forward_at(graph.tokens, graph.positions, cache, cache.capacity)
            error = float((graph.logits - want).abs().max()) / max(float(want.abs().max()), 1e-6)
            if not error <= TOLERANCE:
                raise RuntimeError(f"its logits differ from the eager pass's by {error:.2g} of their largest")
        except Exception as e:  # noqa: BLE001: any failure leaves the model running eagerly, as without graphs
            self.disabled = f"{type(e).__name__}: {e}"
            self.graphs.clear()
            warnings.warn(f"CUDA graphs are off for this model (a captured pass failed its check: {self.disabled}); "
                          "decoding runs eagerly, with the same output", RuntimeWarning, stacklevel=3)
            return None
        return graph
