"""The proof that speculation changes nothing, for any target and drafter: `quickdraft verify`.

Three checks, each with its evidence:
- greedy identity: over the bundled prompts, speculative greedy output equals plain greedy output token
  for token (adaptive k and a fixed k), else the first position where they differ;
- seeded identity: a seeded sampled generation is the same with speculation on and off;
- the sampled distribution: the first token a speculative round emits, drawn many times (unseeded, so by
  rejection sampling) at the chosen temperature, against the exact distribution computed from the target
  alone, P(t2) = sum over t1 of P(t1) P(t2 | t1), by a chi-square test (top-k keeps the sum short).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from quickdraft import sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime.kv_cache import KVCache

P_THRESHOLD = 1e-3  # the chi-square test fails below this p-value (1 false alarm in 1000 honest runs)


@dataclass
class IdentityCheck:
    prompt: str
    config: str
    tokens: int
    identical: bool
    first_difference: int | None = None  # index of the first differing token
    acceptance: float = 0.0


@dataclass
class DistributionCheck:
    temperature: float
    top_k: int
    draws: int
    rounds_exercised: int  # draws whose second token came from a speculative round
    chi2: float
    dof: int
    p_value: float
    passed: bool
    outside_support: int  # draws of tokens the target gives probability 0
    top: list[dict] = field(default_factory=list)  # the most likely tokens: expected vs observed share


@dataclass
class VerifyReport:
    greedy: list[IdentityCheck]
    seeded: list[IdentityCheck]
    distribution: DistributionCheck | None

    @property
    def passed(self) -> bool:
        return (all(c.identical for c in self.greedy + self.seeded)
                and (self.distribution is None or self.distribution.passed))

    def to_dict(self) -> dict:
        return {"passed": self.passed, "greedy": [asdict(c) for c in self.greedy],
                "seeded": [asdict(c) for c in self.seeded],
                "distribution": asdict(self.distribution) if self.distribution else None}

    def text(self, tokenizer) -> str:
        """The evidence as the verify command prints it, ending in PASS or FAIL."""
        lines = [f"{'check':9} {'prompt':11} {'config':17} {'tokens':>6} {'accept':>6}  result"]
        for kind, checks in (("greedy", self.greedy), ("seeded", self.seeded)):
            for c in checks:
                result = "identical" if c.identical else f"DIFFERS at token {c.first_difference}"
                lines.append(f"{kind:9} {c.prompt:11} {c.config:17} {c.tokens:6} {100 * c.acceptance:5.0f}%  {result}")
        d = self.distribution
        if d is not None:
            lines.append(f"sampled distribution (temperature {d.temperature}, top-k {d.top_k}, {d.draws} draws of the "
                         f"first token a round emits): chi2 {d.chi2:.1f} on {d.dof} dof, p = {d.p_value:.3g} "
                         f"({'>=' if d.p_value >= P_THRESHOLD else '<'} {P_THRESHOLD:g}), {d.outside_support} draws "
                         "outside the target's support")
            for row in d.top:
                lines.append(f"  token {row['token']:>7} {tokenizer.token_text(row['token'])!r:14} expected "
                             f"{row['expected']:.3f} observed {row['observed']:.3f}")
        lines.append("PASS: speculation changed nothing" if self.passed else "FAIL: speculation changed the output")
        return "\n".join(lines)


def _tokens(engine: Engine, prompt, params, spec=None):
    events = list(engine.generate(prompt, params, spec))
    return [e.token for e in events if e.token is not None], events[-1].stats


def _first_difference(a, b) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def identity(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams,
             specs: dict[str, SpeculationConfig], progress=None) -> list[IdentityCheck]:
    """Each prompt under each speculation setting against the same engine with speculation off."""
    checks = []
    for name, prompt in prompts.items():
        plain, _ = _tokens(engine, prompt, params, SpeculationConfig(draft_max=0))
        for config, spec in specs.items():
            ours, stats = _tokens(engine, prompt, params, spec)
            checks.append(IdentityCheck(name, config, len(ours), ours == plain, _first_difference(ours, plain),
                                        stats.acceptance_rate))
            if progress:
                progress(1)
    return checks


def exact_second_token(target, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's own distribution of the second generated token, (V,) float64."""
    model, device = target.model, target.device
    cache = KVCache.for_model(model, len(prompt) + 2)
    with torch.inference_mode():
        p1 = sampling.process(model(torch.tensor([prompt], device=device), cache, last_only=True)[0], params)[0]
        exact = torch.zeros(p1.shape[-1], dtype=torch.float64)
        for t1 in p1.nonzero().flatten().tolist():
            cache.rollback(len(prompt))
            p2 = sampling.process(model(torch.tensor([[t1]], device=device), cache)[0], params)[0]
            exact += float(p1[t1]) * p2.double().cpu()
    return exact


def distribution(engine: Engine, prompt: list[int], temperature: float, top_k: int, draws: int,
                 progress=None) -> DistributionCheck:
    """Draw the second token `draws` times with one-token rounds and test it against the exact distribution."""
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, stop_at_eos=False)
    exact = exact_second_token(engine.target, prompt, params)
    counts = torch.zeros_like(exact)
    exercised = 0
    # one-token rounds; with --draft-tree, candidates beside it: the tree's rule decides the second token
    spec = SpeculationConfig(draft_max=1, adaptive=False, tree=engine.speculation.tree, p_min=0.0)
    for _ in range(draws):
        tokens, stats = _tokens(engine, prompt, params, spec)
        counts[tokens[1]] += 1
        exercised += stats.rounds > 0 and stats.k_history[0] == 1
        if progress:
            progress(1)
    chi2, dof, p_value = chi_square(counts, exact)
    outside = int(counts[exact == 0].sum())
    order = exact.argsort(descending=True)[:8].tolist()
    top = [{"token": t, "expected": float(exact[t]), "observed": float(counts[t] / draws)} for t in order
           if exact[t] > 0]
    passed = outside == 0 and p_value >= P_THRESHOLD and exercised == draws
    return DistributionCheck(temperature, top_k, draws, exercised, chi2, dof, p_value, passed, outside, top)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's test of counts against probs; categories expected fewer than 5 times are pooled.
    The p-value uses the Wilson-Hilferty approximation (no scipy needed)."""
    n = float(counts.sum())
    expected = probs * n
    keep = expected >= 5
    order = expected[keep].argsort(descending=True)
    obs, exp = counts[keep][order].tolist(), expected[keep][order].tolist()
    rest_obs, rest_exp = float(counts[~keep].sum()), float(expected[~keep].sum())
    while 0 < rest_exp < 5 and exp:  # the pooled bin must be large enough too: absorb the smallest kept one
        rest_obs, rest_exp = rest_obs + obs.pop(), rest_exp + exp.pop()
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    dof = len(obs) - 1
    if dof < 1:
        return 0.0, 0, 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return stat, dof, 0.5 * math.erfc(z / math.sqrt(2))


def verify(engine: Engine, prompts: dict[str, list[int]], n: int, temperature: float, top_k: int, draws: int,
           distribution_prompt: list[int], k: int = 4, progress=None) -> VerifyReport:
    fixed = SpeculationConfig(draft_max=k, adaptive=False, tree=engine.speculation.tree)  # trees where asked for
    greedy = identity(engine, prompts, SamplingParams(max_tokens=n, stop_at_eos=False),
                      {"adaptive": engine.speculation, f"k={k}": fixed}, progress)
    seeded_params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=n, stop_at_eos=False, seed=7)
    seeded = identity(engine, dict(list(prompts.items())[:2]), seeded_params, {"adaptive, seed 7": engine.speculation},
                      progress)
    dist = distribution(engine, distribution_prompt, temperature, top_k, draws, progress) if draws else None
    return VerifyReport(greedy, seeded, dist)
