"""How the package is layered, checked on its import graph (grimp, import-linter's graph): no import cycles between
modules, the contracts in pyproject.toml's [tool.importlinter] (lint-imports: the library never imports its front ends
or tools, the wire format never the engine, the engine never the loader), and no script importing the tests."""

import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("quickdraft", exclude_type_checking_imports=True)
    cycles = sorted({tuple(graph.find_shortest_chain(importer=b, imported=a) or ()) + (b,)
                     for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                     if graph.chain_exists(importer=b, imported=a)})
    assert not cycles, cycles


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "broken" in result.stdout and " 0 broken" in result.stdout


def test_scripts_import_no_tests():
    offenders = [f"{p.name}: {line.strip()}" for p in (ROOT / "scripts").glob("*.py")
                 for line in p.read_text(encoding="utf-8").splitlines()
                 if re.match(r"\s*(from tests[ .]|import tests\b)", line)]
    assert not offenders, offenders


def test_a_family_lives_in_its_own_file():
    """What sets one family apart is in weights/families/<family>.py: no other module of the library switches on a
    family's name (its config fields are the decoder's switches), and every family file is found without a list."""
    from quickdraft.weights import families

    files = sorted(p.stem for p in (ROOT / "quickdraft/weights/families").glob("*.py") if p.stem not in ("base",
                                                                                                         "__init__"))
    assert sorted(families.FAMILIES) == files
    names = "|".join(files)
    switch = re.compile(rf"""(arch\w*|family)\s*(==|!=|in|not in)\s*[(\[{{]?\s*["']({names})["']""")
    offenders = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in (ROOT / "quickdraft").rglob("*.py")
                 if "families" not in p.parts for line in p.read_text(encoding="utf-8").splitlines()
                 if switch.search(line)]
    assert not offenders, offenders


def test_a_drafter_kind_lives_in_its_own_file():
    """What sets one kind of drafter apart is in its own module (a Drafter subclass: how it is written, what it loads,
    how it drafts): neither speculative/draft.py nor the rest of the library switches on a kind's name. Outside the
    speculative package only the lookups' names ("ngram", "suffix": what bench's configurations and the chains are
    written in) and the description's own words ("none", "auto", "chain") are compared; tools/export.py translates a
    profile's kinds into other engines' method names, its subject."""
    from quickdraft.speculative.draft import KINDS

    modelled = [kind for kind, cls in KINDS.items() if not cls.lookup and kind != "chain"]
    assert {"model", "mtp", "assistant", "dflash", "eagle3"} <= set(modelled)
    for cls in KINDS.values():  # each kind is its module's class
        module = {"model": "draft_model", "chain": "combined"}.get(cls.kind, cls.kind)
        assert cls.__module__ == f"quickdraft.speculative.{module}"
    switch = re.compile(rf"""kind\w*\s*(==|!=|in|not in)\s*[(\[{{]?\s*["']({'|'.join(modelled)})["']""")
    every = re.compile(rf"""kind\w*\s*(==|!=|in|not in)\s*[(\[{{]?\s*["']({'|'.join(k for k in KINDS if k != 'chain')})["']""")
    offenders = []
    for p in (ROOT / "quickdraft").rglob("*.py"):
        if p.name == "export.py" or (p.parent.name == "speculative" and p.name != "draft.py"):
            continue
        pattern = every if p.name == "draft.py" else switch
        offenders += [f"{p.relative_to(ROOT)}: {line.strip()}" for line in p.read_text(encoding="utf-8").splitlines()
                      if pattern.search(line)]
    assert not offenders, offenders
