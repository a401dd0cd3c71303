"""DFlash and DFlash2 block drafters (`--draft DIR`, DIR holding z-lab's drafter: config.json names DFlashDraftModel
or DFlash2DraftModel): a whole block of drafts from one pass of a few layers over the target's hidden states.

The engine's cache keeps, at every position the target has run, the outputs of the target layers the drafter reads
(KVCache.keep_features). A round: the context rows the drafter has not taken in yet (the positions committed since
its last round, all of the prompt's at first) go into its own cache in the same pass that drafts the block, the
pending token and B - 1 mask tokens at the positions from the pending one on (models/dflash.py). Its rows 1 .. B - 1
through the target's head are the guesses for the next B - 1 tokens. DFlash's guesses are independent of each other
(the block is one pass); DFlash2's candidate selector chooses each from its candidates given the token chosen before
it, so its chain is drawn position by position.

Drafting and verification are the draft model's (DraftModelDrafter._draft: greedy, seeded, or drawn from the
drafter's own distribution at each position, masked by a grammar, stopped early below --draft-p-min): exactness is
the engine's, whatever the drafts. A round costs one pass whatever k (`per_round`): the policy counts it so.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.models.dflash import DFlashConfig
from quickdraft.models.transformer import linear
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import common_prefix
from quickdraft.speculative.base import Offer, Proposal, replay_chain
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.weights import dflash as dflash_files, memory

is_dflash = dflash_files.is_dflash
# DFlash2's tokens outside a position's candidates score this far below the lowest candidate: at any temperature a
# sampler short of 1e3 never draws them (the reference's selector cannot), yet a grammar that allows none of the
# candidates still leaves finite scores to draft from
OUTSIDE = 1e5


class HeadModel:
    """A loaded drafter over the target's states (a DFlash or DSpark drafter, an EAGLE-3 head: models/dflash.py's
    HeadLayers): its module and where it came from (what DraftBuilder loads once per target), described as doctor and
    bench describe a loaded model (weights format, kernel plan, load time; no tokenizer of its own: it drafts in the
    target's vocabulary)."""

    tokenizer = None
    graphs = None
    kept_from = None

    def __init__(self, name: str, model, weights: str, plan: dict, load_seconds: float = 0.0):
        self.name, self.model, self.weights, self.plan = name, model, weights, plan
        self.device = model.device
        self.load_seconds = load_seconds

    @property
    def config(self):
        """Its module's config (a DFlashConfig, an Eagle3Config)."""
        return self.model.cfg

    @classmethod
    def load(cls, path: Path, weights: str, load) -> "HeadModel":
        """The module load() gives (a HeadLayers), its norms' kernels planned, described, its load timed."""
        from collections import Counter

        from quickdraft.runtime.plan import kernels_apply, layer_format

        t0 = time.perf_counter()
        model = load()
        kernels = kernels_apply(model)
        model.plan(kernels)
        linear = Counter(layer_format(m) for m in model.modules() if hasattr(m, "fused_operands")
                         or isinstance(m, torch.nn.Linear))
        plan = {"cpu_kernels": kernels, "layers": model.cfg.n_layers, "fused_layers": 0, "linear": dict(linear)}
        return cls(str(path), model, weights, plan, time.perf_counter() - t0)


class DFlashDrafter(DraftModelDrafter):
    kind = "dflash"
    text_model = False
    layer_states = True

    @classmethod
    def recognizes(cls, source: str) -> bool:
        return is_dflash(source)

    @classmethod
    def flavour(cls, draft) -> str:
        """A DSpark drafter (vLLM speculators' dspark type in a DFlash-kind directory) is its own method elsewhere."""
        from quickdraft.weights.eagle3 import speculators_type

        return "dspark" if speculators_type(draft.model) == "dspark" else "dflash"
    sources = ("dflash",)
    per_round = ("dflash",)
    samples = True
    reads_hidden = True

    def __init__(self, drafter: HeadModel, target, capacity: int, p_min: float = 0.0):
        """drafter: the loaded DFlash drafter; target: the LoadedModel it drafts for."""
        cfg, tcfg = drafter.config, target.config
        check_target(cfg, drafter.name, target)
        if drafter.device != target.device:
            raise QuickdraftError(f"a DFlash drafter reads the target's hidden states: it runs on the target's device "
                                  f"({target.device}), not {drafter.device}")
        self.drafter, self.target = drafter, target
        self.lm = drafter  # what DraftModelDrafter's helpers call the model
        self.device = target.device
        self.name = drafter.name
        self.target_vocab = self.shared = tcfg.vocab_size
        self.p_min = p_min
        self.capacity = capacity
        self.cache = KVCache(drafter.model.kv_layout(), capacity + cfg.block_size, dtype=drafter.model.dtype,
                             device=self.device)
        self.target_cache: KVCache | None = None
        self.seen: list[int] = []  # the sequence whose context rows its cache holds
        self.logits: torch.Tensor | None = None  # the round's block: (B - 1, V) logits of its guesses
        self.selection = None  # DFlash2: (unary scores, candidates, projected hidden states) of the round's block
        self.position = 0  # the round's next guess
        self.rows: torch.Tensor | None = None  # DSpark: the block's rows (B, dim), which its heads read
        self.state: torch.Tensor | None = None  # DSpark's recurrent Markov head: its state after the rows so far
        self.confidence: torch.Tensor | None = None  # DSpark: its confidence head's chance the last guess is kept
        self.sure: torch.Tensor | None = None  # and the product of the round's: the chance the chain gets that far

    def fork(self) -> "DFlashDrafter":
        return DFlashDrafter(self.drafter, self.target, self.capacity, self.p_min)

    @classmethod
    def load(cls, draft, target, load) -> list:
        return [load(draft.model, lambda dtype, weights, capacity: load_drafter(draft.model, target, dtype, weights,
                                                                                capacity))]

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "DFlashDrafter":
        (drafter,) = models
        return cls(drafter, target, capacity, speculation.p_min)

    @property
    def models(self) -> tuple:
        return ()  # not a LoadedModel: its bytes are counted as its cache's neighbour (cache_bytes)

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    def attach(self, cache: KVCache) -> None:
        self._keep(cache)
        self.target_cache = cache

    def _keep(self, cache: KVCache) -> None:
        """Have `cache` keep the outputs of the target layers the drafter reads."""
        cache.keep_features(list(self.drafter.config.target_layers), self.target.config.dim)

    def adopt(self, other: "DFlashDrafter", n: int) -> None:
        """Its context row p is the target's hidden states at p: those of the first n tokens are other's."""
        self.cache.copy_prefix(other.cache, min(other.cache.length, n))
        self.seen = list(other.seen[:n])

    def forget(self) -> None:
        self.cache.reset()
        self.seen = []

    def lag(self, seq: list[int], source: str) -> int:
        return 0  # the context rows it has not taken in ride along the drafting pass

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        """Nothing to prefill: the prompt's context rows go in with the first block. Rows of the slot's last
        generation that the prompt begins with are kept."""
        self.cache.rollback(min(self.cache.length, common_prefix(self.seen, prompt)))
        self.seen = list(prompt)

    @torch.inference_mode()
    def propose(self, seq: list[int], k_for, params, generator, constraint=None, branches=None) -> Proposal:
        if self.target_cache is None or self.target_cache.features is None:
            raise QuickdraftError("a DFlash drafter reads the target's hidden states: build its engine with it "
                                  "(Engine(target, context, drafter))")
        k = min(k_for("dflash"), self.drafter.config.guesses)
        committed = len(seq) - 1  # the target has run positions 0 .. committed - 1; seq[committed] is pending
        if k <= 0 or committed < 1:
            return Proposal([], "dflash")
        same = len(seq) if self.seen is seq else common_prefix(self.seen, seq)  # (the engine's list only grows)
        self.cache.rollback(min(self.cache.length, same, committed))
        self.seen = seq
        self._block(seq[-1], committed)
        return self._pending_chain(seq, k, params, generator, constraint, "dflash", branches)

    def _block(self, pending: int, committed: int) -> None:
        """The drafting pass: the context rows up to `committed` taken in, the block from the pending token on."""
        start = self.cache.length
        rows = self.drafter.model.block(self.target_cache.features[start:committed], self._embedded(pending),
                                        self.cache)
        self.rows, self.state, self.confidence, self.sure = rows, None, None, None
        hidden = rows if self.drafter.config.sample_from_anchor else rows[1:]
        self.logits = self._head(hidden)
        selector = self.drafter.model.candidate_selector
        self.selection = selector.candidates(hidden, self.logits) if selector is not None else None
        self.position = 0

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output head over the block's rows (float32 (P, V)), as the drafter scales and caps it (not
        the target's own soft cap: the reference uses the head's weights alone)."""
        model, cfg = self.target.model, self.drafter.config
        if self.drafter.model.lm_head is not None:  # the speculators form's own, over its draft vocabulary
            return self.drafter.model.lm_head(hidden).float()
        logits = (linear(hidden, model.tok_embeddings.weight) if model.output is None else model.output(hidden)).float()
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.softcap:
            logits = torch.tanh(logits / cfg.softcap) * cfg.softcap
        return logits

    def _logits(self, feed) -> torch.Tensor:
        """The next guess's logits (V,): the block's row for DFlash; DFlash2's selector scores of its candidates
        after the token fed (the pending one first, then each drawn), every other token OUTSIDE below the lowest
        candidate (finite, so that a grammar that allows none of the candidates still leaves something to draft)."""
        i = self.position
        self.position += 1
        if self.selection is None:
            return self._over_target(self._biased(feed, i))
        unary, candidates, projected = self.selection
        previous = self._ids(feed)[0, -1]
        scores = self.drafter.model.candidate_selector.scores(unary, candidates, projected, i, previous).float()
        out = (scores.min() - OUTSIDE).expand(self.target_vocab).clone()  # (no read-back: a GPU round stays queued)
        return out.scatter_(0, candidates[i], scores)

    def _biased(self, feed, i: int) -> torch.Tensor:
        """Guess i's logits over the drafter's vocabulary: the block's row, plus DSpark's Markov bias after the token
        fed (the pending one first, then each drawn); its confidence head's chance of the guess kept given the ones
        before into confidence, their product over the round so far (the chance the chain is kept that far: what
        dynamic draft lengths are scheduled by) into sure."""
        model, cfg = self.drafter.model, self.drafter.config
        if model.markov_head is None and model.confidence_head is None:
            return self.logits[i].clone()
        previous = self._ids(feed)[0, -1:]
        row = self.rows[i if cfg.sample_from_anchor else i + 1]
        logits, emb = self.logits[i].clone(), None
        if model.markov_head is not None:
            if i == 0 and not cfg.sample_from_anchor and model.markov_head.kind == "rnn":  # the pending row's update
                _, _, self.state = model.markov_head.step(previous, self.rows[0], None)
            bias, emb, self.state = model.markov_head.step(previous, row, self.state)
            logits += bias.float()
        if model.confidence_head is not None:
            self.confidence = model.confidence_head(row if emb is None or not cfg.confidence_with_markov else
                                                    torch.cat([row, emb.to(row.dtype)]))
            self.sure = self.confidence if i == 0 or self.sure is None else self.sure * self.confidence
        return logits

    def _over_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the drafter's vocabulary (V',) -> the target's (V,): each at the target id d2t maps it to,
        every other OUTSIDE below the lowest (the identity where it scores the target's own vocabulary)."""
        if self.drafter.model.lm_head is None:
            return logits
        out = (logits.min() - OUTSIDE).expand(self.target_vocab).clone()
        return out.scatter_(0, self.drafter.model.target_ids, logits)

    def _choose(self, logits, params, history, generator, position: int):
        """As a draft model chooses; with DSpark's confidence head, the chance the chain is kept up to this guess (the
        product of its confidences, not the top probability) says whether to stop early below --draft-p-min."""
        token, q, sure = super()._choose(logits, params, history, generator, position)
        if self.sure is not None and self.p_min > 0:
            sure = self.sure >= self.p_min
        return token, q, sure

    # ---- self-description ---------------------------------------------------------------------------------

    @property
    def max_draft(self) -> int | None:
        return self.drafter.config.guesses

    @property
    def cut_head(self) -> bool:
        return False

    @classmethod
    def planned(cls, draft, target_cfg, device: torch.device, dtype: torch.dtype, context: int,
                window: int | None = None) -> list:
        """Its weights (layers over the target's states, on its device, at most in its dtype), its keys and values of
        the context (and a block's) and the target's hidden states of the layers it reads, in bf16."""
        path = Path(draft.model).expanduser()
        cfg = dflash_files.read_config(path)
        size = torch.empty(0, dtype=dtype).element_size()
        kv = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
        features = len(cfg.target_layers) * target_cfg.dim * 2
        return [memory.Item("draft weights", dflash_files.weight_bytes(path, size),
                            f"{path.name}, at most {str(dtype).removeprefix('torch.')}"),
                memory.Item("draft KV cache", (context + cfg.block_size) * kv + context * features,
                            f"{context} positions: its keys and values (and a block's), the target's hidden states "
                            f"of {len(cfg.target_layers)} layers")]

    def cache_bytes(self) -> int:
        features = self.target_cache.features if self.target_cache is not None else None
        return self.cache.nbytes() + (features.numel() * features.element_size() if features is not None else 0)

    @torch.inference_mode()
    def pass_seconds(self, prompt: list[int], reps: int = 3) -> float:
        """Median seconds of one drafting pass (a block after the prompt's context)."""
        from quickdraft.runtime.timing import median_seconds

        n = len(prompt)
        cache = KVCache(self.drafter.model.kv_layout(), n + self.block_size + 1, dtype=self.drafter.model.dtype,
                        device=self.device)
        features = torch.zeros(n, self.target_cache.features.shape[1] if self.target_cache is not None else
                               len(self.drafter.config.target_layers) * self.target.config.dim,
                               dtype=self.drafter.model.dtype, device=self.device)
        self.drafter.model.block(features[:-1], self._embedded(prompt[-1]), cache)

        def one():
            self.drafter.model.block(features[-1:], self._embedded(prompt[-1]), cache)
            self._head(torch.zeros(self.block_size - 1, self.target.config.dim, dtype=self.drafter.model.dtype,
                                   device=self.device))

        return median_seconds(one, self.device, reps, lambda: cache.rollback(n - 1))

    def _embedded(self, pending: int) -> torch.Tensor:
        """The block's input rows: the target's raw embedding of the pending token and of B - 1 mask tokens, times
        the drafter's input_embedding_scale."""
        cfg = self.drafter.config
        ids = torch.tensor([pending] + [cfg.mask_token] * (cfg.block_size - 1), device=self.device)
        embedded = self.target.model.tok_embeddings(ids)
        return embedded * cfg.embedding_scale if cfg.embedding_scale != 1.0 else embedded

    @torch.inference_mode()
    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Greedy replay: the target's hidden states of the known sequence (one teacher-forced pass), then at each
        position t the block a round would draft there, counting how many of its guesses the output has."""
        seq = prompt + output
        target = KVCache.for_model(self.target.model, len(seq) + self.target.chunk)
        self._keep(target)
        self.target.prefill(torch.tensor([seq[:-1]], device=self.device), target)  # (its states)
        cache = KVCache(self.drafter.model.kv_layout(), len(seq) + self.block_size, dtype=self.drafter.model.dtype,
                        device=self.device)
        out = [Offer("", 0, 0)]
        kmax = min(kmax, self.drafter.config.guesses)
        saved = self.target_cache, self.cache
        try:
            self.target_cache, self.cache = target, cache
            for t in range(1, len(output)):
                committed = len(prompt) + t - 1
                self._block(seq[committed], committed)
                out.append(replay_chain("dflash", lambda token: self._logits([token]), seq[committed], output[t:], kmax,
                                        self.p_min, lambda: self.sure))
        finally:
            self.target_cache, self.cache = saved
        return out

    @staticmethod
    def replay_round(source: str, drafted: int, stopped_early: bool, kept: int, behind: int) -> tuple[int, int]:
        """One drafting pass per round, whatever it drafts; it takes in what it missed along, so it is never
        behind."""
        if source != "dflash":
            return 0, 0
        return 1, 0


def check_target(cfg: DFlashConfig, name: str, target) -> None:
    """QuickdraftError, naming the fix, where the drafter was made for another target than `target` (a
    LoadedModel): another width, vocabulary, or layers it does not have."""
    tcfg = target.config
    if cfg.vocab_size != tcfg.vocab_size or cfg.dim != tcfg.dim:
        raise QuickdraftError(f"{name} was made for a target of {cfg.dim} wide with {cfg.vocab_size} tokens; "
                              f"{target.name} is {tcfg.dim} wide with {tcfg.vocab_size}: give the DFlash drafter made "
                              "for this target")
    if max(cfg.target_layers) >= tcfg.n_layers or min(cfg.target_layers) < 0:
        raise QuickdraftError(f"{name} reads target layers {list(cfg.target_layers)}; {target.name} has "
                              f"{tcfg.n_layers}: give the DFlash drafter made for this target")


def load_drafter(source: str, target, dtype: torch.dtype, weights: str, capacity: int) -> HeadModel:
    """The DFlash drafter in directory `source`, for `target` (a LoadedModel), on the target's device."""
    path = Path(source).expanduser()
    check_target(dflash_files.read_config(path), path.name, target)
    return HeadModel.load(path, weights, lambda: dflash_files.load(path, target.config.dim, capacity, dtype,
                                                                   target.device, weights))
