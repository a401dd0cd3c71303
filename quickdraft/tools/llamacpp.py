"""llama.cpp as a reference: its own GGUF converter, tokenizer test vectors and programs (llama-server,
llama-perplexity), from the vendored tree in the llama-cpp-python source distribution on PyPI (downloaded once into
the cache, checked by its sha256, never installed or imported into quickdraft: the converter runs in a subprocess,
the programs are built once with cmake). The benchmarks against llama.cpp and the tests that compare with it use it."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the llama.cpp it vendors
# the parts of vendor/llama.cpp the tests use
WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-", "models/templates/")


def tree() -> Path:
    """The extracted vendor/llama.cpp (its converter, gguf-py, vocabularies and test vectors, chat templates)."""
    from quickdraft.weights import hub

    root = hub.cache_dir() / "ext" / f"llama.cpp-{VERSION}"
    if not (root / ".complete").exists():
        _extract(root, WANTED)
    return root


def server_binary(log=None, isa: str = "native") -> Path:
    """llama.cpp's own llama-server, built once from the vendored source into the cache (about 10 minutes on 2
    cores: for slow tests and benchmark scripts only); isa: one of ISAS."""
    return binary("llama-server", log, isa)


# How llama.cpp is built: for this CPU (its AVX-512 kernels where it has them), or for AVX2 + FMA only (what a CPU
# without AVX-512 runs: the peer of quickdraft's AVX2 kernels, measured on the same machine)
ISAS = {
    "native": ("noamx", ["-DGGML_NATIVE=ON"]),
    "avx2": ("avx2", ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                      "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
                      "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"]),
}


def _root(isa: str) -> Path:
    from quickdraft.weights import hub

    if isa not in ISAS:
        raise ValueError(f"isa {isa!r}: one of {', '.join(ISAS)}")
    return hub.cache_dir() / "ext" / f"llama-server-{VERSION}-{ISAS[isa][0]}"


def built(target: str, isa: str = "native") -> bool:
    """Whether a program is built already (binary would not build it)."""
    root = _root(isa)
    marked = (root / f".{target}.complete").exists() or (target == "llama-server" and (root / ".complete").exists())
    return marked and (root / "build" / "bin" / target).exists()


def binary(target: str, log=None, isa: str = "native") -> Path:
    """One of llama.cpp's programs (llama-server, llama-perplexity, ...), built once from the vendored source into
    the cache, all in one build (the libraries they share are built once); isa: one of ISAS."""
    root = _root(isa)
    path, done = root / "build" / "bin" / target, root / f".{target}.complete"
    if built(target, isa):
        return path
    if not (root / "src" / "CMakeLists.txt").exists():
        _extract(root / "src", ("",))
    out = log or subprocess.DEVNULL
    # without AMX: -march=native turns on llama.cpp's AMX matmul where the CPU has it, and on the Intel Xeon VMs of
    # this workplace it segfaults at the first pass (their tile state is not usable); its AVX-512 kernels remain
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    for command in (["cmake", "-S", str(root / "src"), "-B", str(root / "build"), *ISAS[isa][1], "-DLLAMA_CURL=OFF",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release",
                     f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"],
                    ["cmake", "--build", str(root / "build"), "-j", str(os.cpu_count() or 2), "--target", target]):
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT)
    done.write_text(COMMIT + "\n")
    return path


def _extract(root: Path, wanted: tuple[str, ...]) -> None:
    """The parts of vendor/llama.cpp named by wanted (prefixes; "" for all) from the sdist, sha256-checked."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q",
                              "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", tmp,
                              f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
        if got.returncode != 0:
            lines = got.stderr.strip().splitlines()
            raise Unavailable(f"pip download {PACKAGE}=={VERSION} failed: {lines[-1] if lines else got.returncode}")
        (sdist,) = Path(tmp).glob("*.tar.gz")
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        assert digest == SHA256, f"{sdist.name}: sha256 {digest}, expected {SHA256}"
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(wanted) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
    (root / ".complete").write_text(COMMIT + "\n")


class Unavailable(Exception):
    """llama.cpp's source could not be had (no network and nothing in the cache)."""


def convert(hf_dir: Path, out: Path, outtype: str = "f32", *flags: str, pre: str | None = None) -> Path:
    """A Hugging Face directory as llama.cpp's converter writes it to GGUF (flags: more of its options, e.g.
    --no-mtp). pre: the BPE pre-tokenizer to write for a tiny byte-level BPE tokenizer, which the converter cannot
    recognise (it knows a tokenizer by the hash of its tokens for a test text, a real model's); only that one
    function is replaced, the tensors and the rest of the metadata are the converter's own.

    The converter runs in a process of its own, kept for the next conversion: its imports (torch, transformers,
    its model classes) take seconds, each conversion of a small model a fraction of one."""
    global _converter
    if _converter is None or _converter.poll() is not None:
        _converter = subprocess.Popen([sys.executable, "-c", _CONVERTER, str(tree() / "convert_hf_to_gguf.py")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    job = {"argv": [str(hf_dir), "--outfile", str(out), "--outtype", outtype, *flags], "pre": pre}
    _converter.stdin.write(json.dumps(job) + "\n")
    _converter.stdin.flush()
    if not select.select([_converter.stdout], [], [], 600)[0]:  # as the one-process-a-file converter's limit
        _converter.kill()
        raise AssertionError(f"llama.cpp's converter took more than 600 s on {hf_dir}")
    reply = _converter.stdout.readline()
    assert reply, "llama.cpp's converter process ended"
    failed = json.loads(reply)["error"]
    assert failed is None, failed
    return out


_converter: subprocess.Popen | None = None
# The converter's process: a job per line on stdin ({"argv": [...], "pre": name or null}), a reply per line on stdout
# ({"error": null, or the converter's last log lines}); each job runs in a fork of it, its output kept apart.
_CONVERTER = r"""
import io, json, logging, os, runpy, sys, traceback
from pathlib import Path
script = sys.argv[1]
sys.path[:0] = [str(Path(script).parent), str(Path(script).parent / "gguf-py")]
from conversion import base  # the converter's model classes, with torch and transformers: imported once
for line in sys.stdin:  # each job in a fork: options the converter sets on its classes (--no-mtp) stay there
    job = json.loads(line)
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        quiet = os.open(os.devnull, os.O_WRONLY)  # what it writes to the descriptors themselves goes nowhere:
        os.dup2(quiet, 1)  # the parent's replies on 1 stay whole
        os.dup2(quiet, 2)
        if job["pre"] is not None:
            base.TextModel.get_vocab_base_pre = lambda self, tokenizer, p=job["pre"]: p
        log = io.StringIO()
        sys.stdout = sys.stderr = log
        error = None
        try:
            sys.argv = [script, *job["argv"]]
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                error = f"exit {e.code}: " + log.getvalue()[-3000:]
        except BaseException:
            error = traceback.format_exc()[-2000:] + log.getvalue()[-1000:]
        os.write(w, json.dumps({"error": error}).encode())
        os._exit(0)
    os.close(w)
    reply = b""
    while chunk := os.read(r, 65536):
        reply += chunk
    os.close(r)
    os.wait()
    sys.stdout.write((reply.decode() or json.dumps({"error": "the converter died"})) + "\n")
    sys.stdout.flush()
"""
