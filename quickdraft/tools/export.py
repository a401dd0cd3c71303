"""A tuned profile (quickdraft tune) as another engine's configuration: tune on one box, deploy on a cluster.

Each export names the engine version whose documented flags it uses, and carries the measured acceptance and
the predicted speed-up as comments. The flags:
- llama-server: llama.cpp at 0c1e570 (the tree llama-cpp-python 0.3.36 vendors; common/arg.cpp): `-md`,
  `--spec-type draft-simple|ngram-simple`, `--spec-draft-n-max/-n-min`, `--spec-draft-p-min`,
  `--spec-ngram-simple-size-n/-size-m` (the older `--draft-max` / `--draft-min` were removed there).
- vLLM 0.11 (vllm.config.speculative): `--speculative-config` JSON with `method` "ngram" (`num_speculative_tokens`,
  `prompt_lookup_max`, `prompt_lookup_min`) or "draft_model" (`model`, `num_speculative_tokens`).
- SGLang (docs.sglang.io, "Speculative Decoding"): `--speculative-algorithm STANDALONE` with
  `--speculative-draft-model-path`, `--speculative-num-steps`, `--speculative-eagle-topk 1`,
  `--speculative-num-draft-tokens`; or `NGRAM` (CUDA only) with `--speculative-num-draft-tokens`.
Neither vLLM nor SGLang puts n-gram lookup in front of a draft model: an "ngram+MODEL" profile exports its model.
Suffix decoding (quickdraft's `suffix`, as arctic-inference's which vLLM calls): vLLM's `"method": "suffix"` with its
tree depth and probability floor; llama.cpp and SGLang have none, and their n-gram lookup stands in for it.

A DFlash drafter (z-lab's block drafters; a profile whose draft_kind is "dflash"): llama.cpp's `--spec-type
draft-dflash` with `-md` (the drafter converted to GGUF by its convert_hf_to_gguf.py, llama.cpp #22105), vLLM's
`"method": "dflash"` (0.20 and later), SGLang's `--speculative-algorithm DFLASH`. An EAGLE-3 head (draft_kind
"eagle3"): llama.cpp's `--spec-type draft-eagle3` (#18039), vLLM's `"method": "eagle3"`, SGLang's
`--speculative-algorithm EAGLE3`. A DSpark drafter (draft_kind "dspark"): llama.cpp's `draft-dspark` (#25173),
vLLM's `"method": "dspark"`; SGLang has none this export knows of. Tree verification (--draft-tree) has no flag in
any of them: it is quickdraft's own.

A chain (`mtp,ngram`, `DIR,ngram`: draft_kinds lists its members' kinds): llama-server takes its types in order
(`--spec-type draft-eagle3,ngram-simple`); vLLM and SGLang run one method, the chain's first drafter that is not
n-gram lookup.
"""

from __future__ import annotations

import json
import shlex

from quickdraft.errors import QuickdraftError
from quickdraft.speculative.speed import expected_length
from quickdraft.speculative.suffix import DEPTH, MIN_PROB

ENGINES = ("llama-server", "vllm", "sglang")
VERSIONS = {"llama-server": "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)", "vllm": "vLLM 0.11",
            "sglang": "SGLang (docs.sglang.io, speculative decoding)"}
# the Hugging Face repositories of the default models, for engines that load checkpoints by name
HF_REPOS = {"qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
NGRAM_MIN, NGRAM_MAX = 2, 4  # quickdraft's prompt lookup matches 2..4-token suffixes (NgramDrafter)


def export(profile: dict, engine: str, target_file: str | None = None, draft_file: str | None = None) -> str:
    """The profile as engine's command-line flags (a shell fragment with comment lines). target_file / draft_file:
    the GGUF files llama-server loads (default: the profile's names)."""
    if engine == "speculators":
        return speculators(profile)
    if engine not in ENGINES:
        raise QuickdraftError(f"unknown engine {engine!r}: export to one of {', '.join(ENGINES)} or speculators")
    draft, k = profile["draft"], int(profile["draft_max"])
    members = [] if draft == "none" else draft.replace("ngram+", "ngram,", 1).split(",") if "," in draft or \
        draft.startswith("ngram+") else [draft]
    kinds = profile.get("draft_kinds") if profile.get("draft_kind") == "chain" else None  # (a chain's, by member)
    if not kinds or len(kinds) != len(members):
        kinds = [m if m in LOOKUPS else profile.get("draft_kind", "model") for m in members]
    lookup = any(m in LOOKUPS for m in members)
    suffix = "suffix" in members
    model = next((m for m in members if m not in LOOKUPS), None)
    kind = kinds[members.index(model)] if model else "ngram"
    if suffix and engine != "vllm":
        notes_suffix = f"{engine} has no suffix decoding: its n-gram lookup stands in for it"
    if engine == "llama-server" and sum(k not in LOOKUPS for k in kinds) > 1:
        raise QuickdraftError(f"the profile chains {draft}: llama-server loads one drafter beside lookup (-md); "
                              "export a chain of one drafter and ngram")
    winner = next((c for c in profile.get("candidates", []) if c["name"] == draft), None)
    notes = [f"{engine} flags for quickdraft's tuned profile ({VERSIONS[engine]})",
             f"target {profile['target']}; draft {draft}, k = {k}"]
    if profile.get("draft_tree", 1) > 1:
        notes.append(f"tune chose tree verification ({profile['draft_tree']} candidates), which {engine} has no flag "
                     "for: these flags verify the chain alone, so expect the chain's speed-up, not the tree's")
    if winner is not None:
        accepted = ", ".join(f"{a:.2f}" for a in winner["acceptance"][:k])
        notes.append(f"measured acceptance per draft position 1..{k} (each given the ones before): {accepted}")
        notes.append(f"so of {k} drafted tokens {100 * kept_share(winner['acceptance'], k):.0f}% kept: compare the "
                     "server's draft_n_accepted / draft_n (quickdraft bench --url shows it)")
    notes.append(f"predicted speed-up {profile.get('predicted_speedup', 0):.2f}x, measured "
                 f"{profile.get('measured_speedup', 0):.2f}x (quickdraft, one stream, on the machine that tuned)")
    if suffix and engine != "vllm":
        notes.append(notes_suffix)
    if draft == "none":
        notes.append("speculation did not pay on the tuning machine: no speculative flags")
        return _comment(notes)
    if model and kind in HEADS:
        return _head(engine, kind, lookup, kinds, notes, profile, model, k, target_file, draft_file)
    if engine == "llama-server":
        flags = ["-m", target_file or profile["target"]]
        if lookup:
            flags += ["--spec-ngram-simple-size-n", str(NGRAM_MAX), "--spec-ngram-simple-size-m", str(k)]
        if model:
            flags += ["-md", draft_file or model, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                      "--spec-draft-p-min", f"{profile.get('p_min', 0.0):g}"]
        flags = flags[:2] + ["--spec-type", _types(kinds)] + flags[2:]
        return _comment(notes) + "\nllama-server " + shlex.join(flags)
    target = HF_REPOS.get(profile["target"], profile["target"])
    if engine == "vllm":
        if model:
            config = {"method": "draft_model", "model": HF_REPOS.get(model, model), "num_speculative_tokens": k}
            if lookup:
                notes.append("vLLM runs one method: the draft model (no n-gram lookup beside it)")
        elif suffix:
            config = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": DEPTH,
                      "suffix_decoding_min_token_prob": MIN_PROB}
        else:
            config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": NGRAM_MAX,
                      "prompt_lookup_min": NGRAM_MIN}
        return _comment(notes) + "\nvllm serve " + shlex.join([target, "--speculative-config", json.dumps(config)])
    if model:
        flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", HF_REPOS.get(model, model),
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
        if lookup:
            notes.append("SGLang runs one algorithm: the draft model (no n-gram lookup beside it)")
    else:
        flags = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k)]
        notes.append("SGLang's NGRAM runs on CUDA only")
    return _comment(notes) + "\npython -m sglang.launch_server " + shlex.join(["--model-path", target, *flags])


# a head kind's method in each engine: llama.cpp's --spec-type, vLLM's method, SGLang's algorithm
HEADS = {"dflash": ("draft-dflash", "dflash", "DFLASH", "#22105"),
         "eagle3": ("draft-eagle3", "eagle3", "EAGLE3", "#18039"),
         "dspark": ("draft-dspark", "dspark", None, "#25173")}


LLAMA_TYPES = {"ngram": "ngram-simple", "suffix": "ngram-simple", "model": "draft-simple",
               **{kind: names[0] for kind, names in HEADS.items()}}
LOOKUPS = ("ngram", "suffix")  # drafters without a model: lookup in what was written


def _types(kinds: list[str]) -> str:
    """llama-server's --spec-type list for the profile's drafters, in their order."""
    missing = [k for k in kinds if k not in LLAMA_TYPES]
    if missing:
        raise QuickdraftError(f"the profile drafts with a {missing[0]} drafter, which llama-server has no --spec-type "
                              "for this export knows of: export to vllm")
    return ",".join(LLAMA_TYPES[k] for k in kinds)


def _head(engine: str, kind: str, lookup: bool, kinds: list[str], notes: list[str], profile: dict, model: str,
          k: int, target_file: str | None, draft_file: str | None) -> str:
    """A DFlash drafter's or an EAGLE-3 head's flags (its directory as the profile names it), n-gram lookup beside it
    where the engine chains methods."""
    _, method, algorithm, change = HEADS[kind]
    name = {"dflash": "the DFlash drafter", "eagle3": "the EAGLE-3 head", "dspark": "the DSpark drafter"}[kind]
    if lookup and engine != "llama-server":
        notes.append(f"{engine} runs one method: {name} (no n-gram lookup beside it)")
    if engine == "llama-server":
        gguf = draft_file if draft_file and draft_file.endswith(".gguf") else f"{model.rstrip('/')}.gguf"
        notes.append(f"llama-server reads {name} as GGUF: convert {model} with llama.cpp's convert_hf_to_gguf.py "
                     f"into {gguf} (llama.cpp {change} and later)")
        flags = ["-m", target_file or profile["target"], "-md", gguf, "--spec-type", _types(kinds),
                 "--spec-draft-n-max", str(k)]
        if lookup:
            flags += ["--spec-ngram-simple-size-n", str(NGRAM_MAX), "--spec-ngram-simple-size-m", str(k)]
        return _comment(notes) + "\nllama-server " + shlex.join(flags)
    target = HF_REPOS.get(profile["target"], profile["target"])
    if engine == "vllm":
        if kind == "dflash":
            notes.append("vLLM's dflash method: vLLM 0.20 and later")
        config = {"method": method, "model": model, "num_speculative_tokens": k}
        return _comment(notes) + "\nvllm serve " + shlex.join([target, "--speculative-config", json.dumps(config)])
    if algorithm is None:
        notes.append(f"SGLang has no {name.split()[-2]} algorithm this export knows of: serve it with vLLM or "
                     "llama-server")
        return _comment(notes)
    flags = ["--model-path", target, "--speculative-algorithm", algorithm, "--speculative-draft-model-path", model]
    if kind == "eagle3":  # a chain of k steps, one candidate each
        flags += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
    flags += ["--speculative-num-draft-tokens", str(k + 1)]
    return _comment(notes) + "\npython -m sglang.launch_server " + shlex.join(flags)


def speculators(profile: dict) -> str:
    """A tuned head's config in vLLM's speculators format (its directory's config.json with the tuned k as the
    greedy proposal's speculative_tokens and the target as the verifier), written by a shell fragment, then served:
    `vllm serve DIR` reads the verifier and the method from it. Heads in z-lab's DFlash form have no such config:
    convert them with speculators' converter first."""
    from pathlib import Path

    from quickdraft.weights.eagle3 import speculators_type

    draft, k = profile["draft"], int(profile["draft_max"])
    members = draft.replace("ngram+", "ngram,", 1).split(",") if draft != "none" else []
    model = next((m for m in members if m not in LOOKUPS), None)
    if model is None or speculators_type(model) is None:
        raise QuickdraftError(f"the profile drafts with {draft}; the speculators format holds heads trained for a "
                              "verifier (EAGLE-3, DFlash, DSpark in its form): export this one as vllm flags "
                              "(--export vllm)")
    path = Path(model).expanduser()
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    inner = dict(config.get("speculators_config") or {})
    inner["proposal_methods"] = [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}]
    inner["default_proposal_method"] = "greedy"
    verifier = dict(inner.get("verifier") or {})
    verifier["name_or_path"] = HF_REPOS.get(profile["target"], profile["target"])
    inner["verifier"] = verifier
    config["speculators_config"] = inner
    notes = [f"quickdraft's tuned profile as {path.name}'s config.json in vLLM's speculators format: k = {k}, verifier "
             f"{verifier['name_or_path']}",
             f"predicted speed-up {profile.get('predicted_speedup', 0):.2f}x, measured "
             f"{profile.get('measured_speedup', 0):.2f}x (quickdraft, one stream, on the machine that tuned)"]
    if len(members) > 1:
        notes.append("vLLM runs one method: the head (no n-gram lookup beside it)")
    body = json.dumps(config, indent=1)
    return (_comment(notes) + f"\ncat > {shlex.quote(str(path / 'config.json'))} <<'EOF'\n{body}\nEOF\n"
            f"vllm serve {shlex.quote(str(path))}")


def kept_share(acceptance: list[float], k: int) -> float:
    """The expected share of k drafted tokens the target keeps: E[L](k) less the target's own token, over k."""
    return (expected_length(acceptance[:k]) - 1) / k if k else 0.0


def _comment(lines: list[str]) -> str:
    return "\n".join("# " + line for line in lines)
