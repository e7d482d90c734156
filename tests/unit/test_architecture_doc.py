"""docs/architecture.md matches the tree, and the library's imports follow its intended flow
(tools/draw_architecture.py reads the sources with ast: nothing is imported, < 1 s)."""

import re

import pytest

from tools import draw_architecture as arch

# Imports against the flow that exist today, (importing module, imported module): each one
# is a dependency still to be removed. A new one fails test_imports_follow_the_flow; one
# that is gone must leave this list too (test_known_exceptions_still_exist), so it only
# shrinks.
KNOWN_AGAINST_FLOW: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def graph():
    return arch.build()


def test_doc_is_up_to_date(capsys):
    rc = arch.main(["--check"])
    assert rc == 0, capsys.readouterr().err


def test_check_sees_a_stale_doc(tmp_path, monkeypatch, graph):
    monkeypatch.setattr(arch, "build", lambda: graph)  # parsed once per module
    doc = tmp_path / "architecture.md"
    doc.write_text(f"# hand-written\n\n{arch.BEGIN}\nold graph\n{arch.END}\n\nmore text\n")
    assert arch.main(["--check", "--doc", str(doc)]) == 1
    assert "old graph" in doc.read_text()  # --check writes nothing


def test_only_the_marked_block_is_replaced():
    doc = f"# hand-written\n\n{arch.BEGIN}\nold graph\n{arch.END}\n\nmore text\n"
    assert arch.updated(doc, "new graph\n") == \
        f"# hand-written\n\n{arch.BEGIN}\nnew graph\n{arch.END}\n\nmore text\n"
    assert arch.updated("# no markers\n", "new\n") == f"# no markers\n\n{arch.BEGIN}\nnew\n{arch.END}\n"


def test_library_never_imports_the_trainer(graph):
    bad = [f"{i.source} imports {i.target}" for i in graph.imports
           if arch.node_of(i.source) != arch.TRAINER and arch.node_of(i.target) == arch.TRAINER]
    assert not bad


def test_every_package_has_a_layer(graph):
    unplaced = sorted(n for n in graph.nodes if arch.layer_of(n) is None)
    assert not unplaced, f"add {unplaced} to LAYERS in tools/draw_architecture.py"


def test_imports_follow_the_flow(graph):
    """store/state/copy never import save/load/cluster, save never imports load, ..."""
    new = sorted({(i.source, i.target) for i in graph.against_flow()} - KNOWN_AGAINST_FLOW)
    assert not new, "imports against the flow (tools/draw_architecture.py LAYERS): " + \
        "; ".join(f"{a} imports {b}" for a, b in new)


def test_known_exceptions_still_exist(graph):
    now = {(i.source, i.target) for i in graph.against_flow()}
    gone = sorted(KNOWN_AGAINST_FLOW - now)
    assert not gone, f"no longer imported, remove from KNOWN_AGAINST_FLOW: {gone}"


def test_every_package_says_what_it_owns(graph):
    assert not [n for n in graph.nodes if not arch.owns(n)]


DOC_FILES = ["README.md", *sorted(str(p.relative_to(arch.ROOT)) for p in (arch.ROOT / "docs").glob("*.md"))]
# a path in backticks under one of the repository's own top-level directories
PATH = re.compile(r"`((?:reft_ext|megatron/training|tests|tools|benchmarks|docs|examples|csrc)"
                  r"/[\w./-]*)`")


@pytest.mark.parametrize("name", DOC_FILES)
def test_docs_name_existing_files(name):
    """Files moved by a refactoring are renamed in the docs too."""
    text = (arch.ROOT / name).read_text()
    missing = sorted({p for p in PATH.findall(text) if not (arch.ROOT / p.rstrip("/")).exists()
                      and "*" not in p and "<" not in p})
    assert not missing, f"{name} names files that do not exist: {missing}"


def test_no_import_cycles_among_trainer_and_tools_modules():
    """No module of megatron/training/ or tools/ imports, directly or through others of
    them, a module that imports it (an import inside a function counts too: the cycle is
    there the moment both run, and a script run as __main__ is imported a second time)."""
    modules = {arch.module_name(p): p for top in ("megatron/training", "tools")
               for p in sorted((arch.ROOT / top).glob("*.py"))}
    imports = {m: {i.target for i in arch._imports_of(p) if i.target in modules} - {m}
               for m, p in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(imports[m])
        return False

    cycles = sorted(f"{a} imports {b}, which leads back to it"
                    for a in modules for b in imports[a] if reaches(b, a))
    assert not cycles, "; ".join(cycles)
