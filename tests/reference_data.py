"""What independent implementations answered, recorded as data, so that the suite need not build llama.cpp (about 10
minutes on 2 cores) or load the real models in transformers' float32 on every run: the tests compare quickdraft's
answers with these, and this module regenerates them (slow) with the versions it then records.

- llama-server.json (and the GGUF files beside it): llama.cpp's own llama-server, greedy, on llama.cpp's own f32
  conversions of the tiny hybrid and mixture-of-experts models (tests/test_hybrid_gguf.build), kept here as they were
  converted, so that the files are the ones llama-server read whatever versions the suite runs with later.
- llama-perplexity.json: llama.cpp's llama-perplexity of the real Gemma 3 270M on the start of quickdraft/data/ppl.txt.
- transformers.json: transformers (float32, the same GGUF files) on the real models: perplexity by llama.cpp's method
  and greedy tokens of the test prompts.
- suffix.json: arctic-inference 0.3.0's SuffixDecodingCache (the suffix decoding vLLM calls), its C++ extension built
  from the sdist (cmake, nanobind; no torch, no CUDA), on seeded token streams: every request's prompt and responses,
  and what each speculate call proposed (tests/test_suffix.py replays them on quickdraft's suffix trees).

Usage: .venv/bin/python -m tests.reference_data [llama-server] [llama-perplexity] [transformers[=ALIAS,...]] [suffix]
(all by default; transformers=qwen2.5-coder-0.5b records that model alone, keeping the others)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "reference"
HYBRIDS = ("qwen3_5", "qwen3_5-mtp", "qwen3_5_moe", "qwen3_moe")  # tests/test_hybrid_gguf.MODELS
GREEDY_N = 24
PPL_CTX, PPL_CHARS = 128, 2000  # llama-perplexity's windows over the first PPL_CHARS characters of the quality text


def load(name: str) -> dict:
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


def hybrid_file(name: str) -> Path:
    return HERE / f"{name}-f32.gguf"


def _save(name: str, data: dict) -> None:
    HERE.mkdir(exist_ok=True)
    (HERE / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {HERE / name}.json", file=sys.stderr)


def _llama_version() -> dict:
    from quickdraft.tools import llamacpp

    return {"llama.cpp": llamacpp.COMMIT, "source": f"{llamacpp.PACKAGE} {llamacpp.VERSION}"}


def llama_server() -> None:
    from quickdraft.tools import llamacpp
    from quickdraft.tools.servers import LlamaServer
    from tests import loopback
    from tests.helpers import PROMPT
    from tests.test_hybrid_gguf import build

    HERE.mkdir(exist_ok=True)
    out = {**_llama_version(), "prompt": PROMPT, "n": GREEDY_N, "tokens": {}}
    for name in HYBRIDS:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "hf").mkdir()
            build(name, Path(tmp) / "hf")
            flags = ("--no-mtp",) if name in ("qwen3_5", "qwen3_5_moe") else ()
            pre = "qwen35" if name.startswith("qwen3_5") else "qwen2"
            llamacpp.convert(Path(tmp) / "hf", hybrid_file(name), "f32", *flags, pre=pre)
        server = LlamaServer(llamacpp.server_binary(), "-m", str(hybrid_file(name)), "--temp", "0")
        try:
            reply = loopback.post(f"{server.url}/completion", json={
                "prompt": PROMPT, "n_predict": GREEDY_N, "temperature": 0, "top_k": 1, "return_tokens": True,
                "cache_prompt": False, "ignore_eos": True}, timeout=300).json()
        finally:
            server.stop()
        out["tokens"][name] = reply["tokens"]
    _save("llama-server", out)


def perplexity_text() -> str:
    from quickdraft.tools.quality import TEXT

    return TEXT.read_text(encoding="utf-8")[:PPL_CHARS]


def llama_perplexity() -> None:
    import re

    from quickdraft.tools import llamacpp
    from quickdraft.weights.loader import ensure_pulled

    path = ensure_pulled("gemma3-270m")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(perplexity_text())
        f.flush()
        result = subprocess.run([str(llamacpp.binary("llama-perplexity")), "-m", str(path), "-f", f.name, "-c",
                                 str(PPL_CTX), "-t", "2", "-b", str(PPL_CTX)], capture_output=True, text=True,
                                timeout=900)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{(result.stdout + result.stderr)[-3000:]}")
    _save("llama-perplexity", {**_llama_version(), "model": "gemma3-270m", "ctx": PPL_CTX, "chars": PPL_CHARS,
                               "ppl": float(found.group(1))})


def transformers_reference(aliases: list[str] | None = None) -> None:
    """Every model of tests/test_real_models.MODELS, or those named (the others' records kept as they are, each
    model's entry naming the versions that answered it)."""
    import torch
    import transformers

    from tests.test_real_models import CTX, MODELS, PROMPTS, TEXT, hf_from_gguf, hf_greedy, hf_perplexity, prompt_ids
    from quickdraft.weights.loader import ensure_pulled, load_tokenizer

    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    out = {**versions, "ctx": CTX, "models": {}}
    if aliases:
        out = load("transformers")
        out["models"] = {a: e for a, e in out["models"].items() if a in MODELS}
    for alias in aliases or MODELS:
        path = ensure_pulled(alias)
        tokenizer = load_tokenizer(alias)
        tokens = tokenizer.encode(TEXT)
        bos = tokenizer.bos_id if tokenizer.add_bos else None
        model = hf_from_gguf(path)
        out["models"][alias] = {
            **(versions if aliases else {}),
            "ppl": hf_perplexity(model, tokens, CTX, bos),
            "greedy": [{"prompt": p, "n": 32, "tokens": hf_greedy(model, prompt_ids(tokenizer, p), 32)}
                       for p in PROMPTS]}
        del model
        print(f"transformers: {alias} done", file=sys.stderr)
    _save("transformers", out)


ARCTIC = "arctic-inference==0.3.0"
SUFFIX_STREAMS = 40


def suffix_streams(seed: int) -> dict:
    """One seeded session of requests: small vocabularies and a few repeated templates (so that matches, ties and
    branching happen), responses in chunks, a speculate call with varied settings after each chunk."""
    import random

    rnd = random.Random(seed)
    vocab, depth = rnd.choice([3, 5, 20, 50]), rnd.choice([8, 24, 64])
    templates = [[rnd.randrange(vocab) for _ in range(rnd.randint(3, 30))] for _ in range(3)]
    requests = []
    for r in range(rnd.randint(2, 6)):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 60))] + rnd.choice(templates)
        steps = []
        for _ in range(rnd.randint(2, 30)):
            k = rnd.randint(1, 4)
            chunk = [rnd.randrange(vocab) for _ in range(k)] if rnd.random() < 0.4 else (rnd.choice(templates) * 2)[:k]
            steps.append({"add": chunk, "context_len": rnd.randint(1, 2 * depth), "max_spec_tokens": rnd.choice(
                [1, 4, 8, 16, 32]), "factor": rnd.choice([0.5, 1.0, 2.0, 4.0]), "min_prob": rnd.choice(
                [0.0, 0.05, 0.1, 0.3, 0.6])})
        requests.append({"prompt": prompt, "steps": steps})
    return {"depth": depth, "requests": requests}


def suffix_reference() -> None:
    """arctic-inference's answers on the streams (its sdist built in a temporary directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        cache_class = _build_arctic(Path(tmp))
        sessions = []
        for seed in range(SUFFIX_STREAMS):
            session = suffix_streams(seed)
            cache = cache_class(session["depth"], -1)
            for r, request in enumerate(session["requests"]):
                cache.start_request(r, request["prompt"])
                seq = list(request["prompt"])
                for step in request["steps"]:
                    cache.add_active_response(r, step["add"])
                    seq += step["add"]
                    draft = cache.speculate(r, seq[-step["context_len"]:], max_spec_tokens=step["max_spec_tokens"],
                                            max_spec_factor=step["factor"], min_token_prob=step["min_prob"])
                    step["proposed"] = {"tokens": [int(t) for t in draft.token_ids],
                                        "probs": [float(p) for p in draft.probs], "score": float(draft.score),
                                        "match_len": int(draft.match_len)}
                cache.stop_request(r)
            sessions.append(session)
    _save("suffix", {"reference": ARCTIC, "sessions": sessions})


def _build_arctic(tmp: Path):
    """arctic-inference's suffix decoding, built from its sdist: its setup.py imports torch to read its metadata, so
    the download goes through a stub of it; the extension needs only cmake and nanobind."""
    import importlib

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "setuptools", "wheel", "nanobind==2.9.2", "numpy", "cmake"], check=True)
    (tmp / "stub" / "torch").mkdir(parents=True)
    (tmp / "stub" / "torch" / "__init__.py").write_text("")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
                    "--no-build-isolation", ARCTIC, "-d", str(tmp)], check=True, env={"PYTHONPATH": str(tmp / "stub"),
                                                                                     "PATH": "/usr/bin:/bin"})
    subprocess.run(["tar", "xzf", next(tmp.glob("arctic_inference-*.tar.gz")).name], cwd=tmp, check=True)
    source = next(p for p in tmp.glob("arctic_inference-*") if p.is_dir())
    build = tmp / "build"
    subprocess.run([str(venv / "bin" / "cmake"), "-S", str(source / "csrc" / "suffix_decoding"), "-B", str(build),
                    f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                    f"-Dnanobind_DIR={_nanobind_dir(venv)}"], check=True)
    subprocess.run([str(venv / "bin" / "cmake"), "--build", str(build), "-j2"], check=True)
    package = tmp / "pkg" / "arctic_inference"
    package.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(source / "arctic_inference" / "suffix_decoding"), str(package)], check=True)
    (package / "__init__.py").write_text("")
    for built in build.glob("_C*.so"):
        subprocess.run(["cp", str(built), str(package / "suffix_decoding")], check=True)
    sys.path.insert(0, str(tmp / "pkg"))
    return importlib.import_module("arctic_inference.suffix_decoding").SuffixDecodingCache


def _nanobind_dir(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "nanobind", "--cmake_dir"], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


MAKERS = {"llama-server": llama_server, "llama-perplexity": llama_perplexity, "transformers": transformers_reference,
          "suffix": suffix_reference}

if __name__ == "__main__":
    for which in sys.argv[1:] or list(MAKERS):
        which, _, names = which.partition("=")
        MAKERS[which](*([names.split(",")] if names else []))
