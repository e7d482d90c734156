"""Every command in README.md and docs/*.md runs as written (issue 36).

The fenced shell blocks (```, ```bash, ```sh, ```console) and the inline code spans that
start with a program are read as a new user would paste them: backslash continuations
joined, ``$ `` prompts, comments, redirections and here-documents dropped. Every flag of a
command that runs the trainer (``pretrain_llama.py``, also through torchrun or
``python -m torch.distributed.run``), the planner (``python -m reft_ext.plan``), torchrun
itself, or a script of tools/ or benchmarks/ must be one its parser knows; the scripts
must start as scripts (``python tools/x.py`` from the repository root); ``make`` targets,
script files and pytest paths must exist. Complete trainer commands are also validated
(layout, batch sizes) and complete planner commands are run, all in this process, with
no training: the default tier takes a few seconds. The slow tier runs every mentioned
script's ``--help`` and the planner examples as real subprocesses.

Placeholders are values, never flags: ``<...>``, ``$VAR``, ``...``, upper-case words
(``PATH``, ``N``) and ``[optional]`` groups (their flags are checked, they are left out
of what runs).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import glob
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO)
                              for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
PLACEHOLDER = "PLACEHOLDER"
# what may stand before the program: launchers that pass the rest of the line on
WRAPPERS = {"srun", "env", "time", "nohup", "exec", "sudo"}
# make targets whose ARGS="..." the Makefile appends to the trainer's flags
MAKE_TRAINER_TARGETS = {"run", "run-inprocess", "demo", "demo-nodes"}
SCRIPT_DIRS = ("tools", "benchmarks")


# ---- reading the docs ----------------------------------------------------------------
@dataclass
class Command:
    doc: str
    line: int                 # 1-based line of the command's first line
    text: str                 # as written, continuations joined
    words: list[str]          # shell words, placeholders replaced
    optional: list[bool] = field(default_factory=list)  # inside [...] in the doc
    output: list[str] = field(default_factory=list)  # what a `$ ` command prints in the doc

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _is_python(word: str) -> bool:
    return bool(re.fullmatch(r"(?:\S*/)?python(?:3(?:\.\d+)?)?|\$\(PY\)", word))


def _is_torchrun(word: str) -> bool:
    return bool(re.fullmatch(r"(?:\S*/)?torchrun", word))


def _script_names() -> dict[str, str]:
    """Bare file name -> repo path of every script in tools/ and benchmarks/ (prose names
    ``launch_nodes.py --min-nodes M`` without the directory)."""
    out = {}
    for d in SCRIPT_DIRS:
        for p in glob.glob(os.path.join(REPO, d, "*.py")):
            out[os.path.basename(p)] = os.path.relpath(p, REPO)
    return out


SCRIPTS = _script_names()


def _starts_a_program(words: list[str]) -> bool:
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[i]):
        i += 1
    if i == len(words):
        return False
    w = words[i]
    return (_is_python(w) or _is_torchrun(w) or w in WRAPPERS or w == "make"
            or w == "pretrain_llama.py" or w in SCRIPTS
            or any(w.startswith(d + "/") and w.endswith(".py") for d in SCRIPT_DIRS))


def _shell_words(text: str) -> tuple[list[str], list[bool]]:
    """Shell words with placeholders made values and ``[...]`` groups marked optional."""
    text = re.sub(r"(?<![<\w])<(?!<)[^<>\n]*>", PLACEHOLDER, text)  # <job id>, <flags>
    try:
        raw = shlex.split(text, comments=True)
    except ValueError:
        raw = text.split("#")[0].split()
    words, optional, depth = [], [], 0
    for w in raw:
        opened = 0
        while w.startswith("[") and not w.startswith("[["):
            w, opened = w[1:], opened + 1
        closed = 0
        if "[" not in w:  # RANK:ITER[:SIGNAL]...: a value with its own brackets
            while w.endswith("]"):
                w, closed = w[:-1], closed + 1
        depth += opened
        if w:
            words.append(w)
            optional.append(depth > 0)
        depth = max(0, depth - closed)
    return words, optional


def _fenced_commands(doc: str, lines: list[str]) -> list[Command]:
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"\s*```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, i = m.group(1), i + 1
        heredoc, prompted = None, None
        while i < len(lines) and not lines[i].strip().startswith("```"):
            start, text = i, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            if heredoc:  # the body of `python - <<'EOF'`: Python, not shell
                heredoc = None if text.strip() == heredoc else heredoc
                continue
            if lang not in SHELL_FENCES:
                continue
            h = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
            if h:
                heredoc = h.group(1)
            has_prompt = bool(re.match(r"\s*\$ ", text))
            text = re.sub(r"^\s*\$ ", "", text)
            words, optional = _shell_words(text)
            if _starts_a_program(words):
                out.append(Command(doc, start + 1, text.strip(), words, optional))
                prompted = out[-1] if has_prompt else None
            elif prompted:
                prompted.output.append(text)
        i += 1
    return out


def _inline_commands(doc: str, lines: list[str]) -> list[Command]:
    """`...` spans outside fences that start with a program (they may wrap lines)."""
    text, starts, fenced = [], [], False
    for n, line in enumerate(lines):
        if re.match(r"\s*```", line):
            fenced = not fenced
            line = ""
        starts.append(sum(len(t) + 1 for t in text))
        text.append("" if fenced else line)
    joined = "\n".join(text)
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        span = " ".join(m.group(1).split())
        words, optional = _shell_words(span)
        if words and _starts_a_program(words):
            line = bisect.bisect_right(starts, m.start())
            out.append(Command(doc, line, span, words, optional))
    return out


def doc_commands(doc: str) -> list[Command]:
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        lines = f.read().splitlines()
    return _fenced_commands(doc, lines) + _inline_commands(doc, lines)


# ---- what each program accepts ---------------------------------------------------------
@functools.lru_cache(maxsize=None)
def trainer_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import build_parser

    return build_parser()


@functools.lru_cache(maxsize=None)
def planner_parser() -> argparse.ArgumentParser:
    from reft_ext.plan.cli import build_parser

    return build_parser()


@functools.lru_cache(maxsize=None)
def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@contextlib.contextmanager
def _as_a_script(path: str):
    """This process as ``python PATH`` from the repository root would be: sys.path[0] is
    the script's directory and the repository's own packages (tools, benchmarks, tests)
    are not importable unless the script makes them so; all put back afterwards."""
    hidden = ("tools", "benchmarks", "tests")
    saved_modules = {k: v for k, v in sys.modules.items() if k.split(".")[0] in hidden}
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    for k in saved_modules:
        del sys.modules[k]
    sys.path[:] = [os.path.dirname(path)] + [
        p for p in saved_path if p and os.path.realpath(p) != REPO]
    sys.argv[:] = [path, "--help"]
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in hidden]:
            del sys.modules[k]
        sys.modules.update(saved_modules)
        sys.path[:], sys.argv[:] = saved_path, saved_argv


@functools.lru_cache(maxsize=None)
def script_parser(script: str):
    """(parser or None, help text or None, error or None) of a tools/benchmarks script:
    the script runs as ``__main__`` with ``--help`` and the first parser it asks to parse
    is taken (nothing after that runs); a script that parses without argparse gets its
    real ``--help`` output instead. Once per script."""
    path = os.path.join(REPO, script)
    real_parse = argparse.ArgumentParser.parse_known_args

    def grab(self, *a, **k):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = grab  # parse_args calls it too
    try:
        with _as_a_script(path), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
    except _Parsed as got:
        return got.parser, None, None
    except SystemExit:
        pass
    except BaseException as exc:  # noqa: BLE001 (any failure to start is the finding)
        return None, None, f"{type(exc).__name__}: {exc}"
    finally:
        argparse.ArgumentParser.parse_known_args = real_parse
    r = subprocess.run([sys.executable, path, "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    return None, r.stdout + r.stderr, None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string, the subcommands' included (``local_slurm.py up --nodes``)."""
    out = set()
    for a in parser._actions:
        out.update(a.option_strings)
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _options(sub)
    return out


def _takes_value(parser: argparse.ArgumentParser, flag: str) -> bool:
    a = parser._option_string_actions.get(flag)
    return a is not None and a.nargs != 0


def _is_flag(word: str) -> bool:
    return word.startswith("-") and word != "-" and not re.fullmatch(r"-[\d.]+(e\d+)?", word)


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    with open(os.path.join(REPO, "Makefile")) as f:
        return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", f.read(), re.M))


# ---- checking one command --------------------------------------------------------------
@dataclass
class Invocation:
    """One program of a command: what it is and its arguments."""

    program: str              # "trainer", "planner", "torchrun", "pytest", a script path
    args: list[str]
    optional: list[bool]
    world_size: int | None = None


def _complete(words: list[str]) -> bool:
    """No placeholder left: the command can be taken literally."""
    return not any(w in ("...", "…", PLACEHOLDER) or "$" in w or re.fullmatch(r"[A-Z][A-Z_]*", w)
                   for w in words)


class Checker:
    def __init__(self, cmd: Command):
        self.cmd = cmd
        self.problems: list[str] = []
        self.invocations: list[Invocation] = []

    def fail(self, msg: str) -> None:
        self.problems.append(f"{self.cmd.where()}: {msg}  [{self.cmd.text[:120]}]")

    # -- splitting the line into programs
    def run(self) -> "Checker":
        words, opt = self.cmd.words, self.cmd.optional
        segment, seg_opt = [], []
        for w, o in list(zip(words, opt)) + [("&&", False)]:
            if w in ("&&", "||", ";", "|"):
                if segment:
                    self.segment(segment, seg_opt)
                segment, seg_opt = [], []
            elif re.fullmatch(r"\d?>>?|<|\d?>&\d", w):
                segment.append(">")  # a redirection: it and its target are dropped below
                seg_opt.append(o)
            else:
                segment.append(w)
                seg_opt.append(o)
        return self

    def segment(self, words: list[str], opt: list[bool]) -> None:
        keep = [i for i, w in enumerate(words)
                if w != ">" and not (i and words[i - 1] == ">")]
        words, opt = [words[i] for i in keep], [opt[i] for i in keep]
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):  # VAR=x cmd
            words, opt = words[1:], opt[1:]
        if not words:
            return
        if words[0] in WRAPPERS:  # srun --jobid=... python tools/x.py: from the program on
            nxt = next((i for i, w in enumerate(words) if _is_python(w) or _is_torchrun(w)),
                       None)
            if nxt is None:
                return
            words, opt = words[nxt:], opt[nxt:]
        head = words[0]
        if head == "make":
            self.make(words[1:], opt[1:])
        elif _is_torchrun(head):
            self.torchrun(words[1:], opt[1:])
        elif _is_python(head):
            self.python(words[1:], opt[1:])
        else:
            self.script(head, words[1:], opt[1:])

    def make(self, words, opt):
        targets = [w for w in words if not _is_flag(w) and "=" not in w]
        if not all(re.fullmatch(r"[A-Za-z0-9_.-]+", t) for t in targets):
            return  # "make run:" in a log sample is a label, not a command
        for t in targets:
            if t not in make_targets():
                self.fail(f"make has no target {t!r} (Makefile)")
        for w in words:
            if w.startswith("ARGS=") and MAKE_TRAINER_TARGETS & set(targets):
                args, aopt = _shell_words(w[len("ARGS="):])
                self.invocations.append(Invocation("trainer", args, aopt))

    def torchrun(self, words, opt):
        p = torchrun_parser()
        i = 0
        while i < len(words) and _is_flag(words[i]):
            flag = words[i].split("=", 1)[0]
            if flag not in _options(p):
                self.fail(f"{flag}: not a flag of torchrun")
            i += 2 if "=" not in words[i] and _takes_value(p, flag) else 1
        head = words[:i]
        if i == len(words):
            return
        nproc = nnodes = 1
        for j, w in enumerate(head):
            name, _, val = w.partition("=")
            if name in ("--nproc-per-node", "--nproc_per_node"):
                val = val or head[j + 1]
                nproc = int(val) if val.isdigit() else None
            if name == "--nnodes":
                val = val or head[j + 1]
                nnodes = int(val) if val.isdigit() else None
        self.script(words[i], words[i + 1:], opt[i + 1:],
                    nproc * nnodes if nproc and nnodes else None)

    def python(self, words, opt):
        while words and words[0] in ("-u", "-O", "-B", "-X", "-W"):  # interpreter options
            n = 2 if words[0] in ("-X", "-W") else 1
            words, opt = words[n:], opt[n:]
        if not words or words[0] in ("-", "-c") or words[0].startswith("-c"):
            return  # inline Python: not a command line of ours
        if words[0] == "-m" and len(words) > 1:
            self.module(words[1], words[2:], opt[2:])
        elif words[0].endswith(".py"):
            self.script(words[0], words[1:], opt[1:])

    def module(self, name, words, opt, world_size=None):
        if name == "reft_ext.plan":
            self.invocations.append(Invocation("planner", words, opt))
        elif name in ("torch.distributed.run", "reft_ext.cluster.torchrun"):
            self.torchrun(words, opt)
        elif name == "pytest":
            for w in words:
                if not _is_flag(w) and _complete([w]):
                    if not glob.glob(os.path.join(REPO, w.split("::")[0])):
                        self.fail(f"pytest: no test file matches {w!r}")

    def script(self, path, words, opt, world_size=None):
        if path == "pretrain_llama.py" or path.endswith("/pretrain_llama.py"):
            self.invocations.append(Invocation("trainer", words, opt, world_size))
            return
        path = SCRIPTS.get(path, path)
        if not _complete([path]) or path.startswith("/"):
            return
        if not os.path.isfile(os.path.join(REPO, path)):
            if path.endswith((".py", ".sh", ".sbatch")):
                self.fail(f"{path}: no such file")
            return
        if not path.startswith(tuple(d + "/" for d in SCRIPT_DIRS)) or \
                not path.endswith(".py"):
            return
        if "--" in words:  # a launcher: its flags, then the training script or its flags
            k = words.index("--")
            rest, rest_opt = words[k + 1:], opt[k + 1:]
            words, opt = words[:k], opt[:k]
            ws = self._launcher_world(words)
            if rest and rest[0].endswith(".py"):
                self.script(rest[0], rest[1:], rest_opt[1:], ws)
            else:  # tools/demo.py -- <trainer flags>
                self.invocations.append(Invocation("trainer", rest, rest_opt, ws))
        self.invocations.append(Invocation(path, words, opt))

    @staticmethod
    def _launcher_world(words):
        vals = {}
        for j, w in enumerate(words[:-1]):
            if w in ("--nnodes", "--nproc-per-node"):
                vals[w] = words[j + 1]
        n, p = vals.get("--nnodes", "1"), vals.get("--nproc-per-node", "1")
        return int(n) * int(p) if n.isdigit() and p.isdigit() else None

    # -- the flags of each program
    def check_flags(self) -> None:
        for inv in self.invocations:
            if inv.program == "trainer":
                known = _options(trainer_parser())
                what = "pretrain_llama.py (megatron/training/arguments.py)"
            elif inv.program == "planner":
                known, what = _options(planner_parser()), "python -m reft_ext.plan"
            else:
                parser, help_text, error = script_parser(inv.program)
                if error:
                    self.fail(f"{inv.program} does not start as a script from the "
                              f"repository root: {error}")
                    continue
                known = _options(parser) if parser else None
                what = inv.program
            for w in inv.args:
                if not _is_flag(w):
                    continue
                flag = w.split("=", 1)[0]
                ok = flag in known if known is not None else \
                    re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text)
                if not ok:
                    self.fail(f"{flag}: not a flag of {what}")


def checked(cmd: Command) -> Checker:
    c = Checker(cmd).run()
    c.check_flags()
    return c


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in doc_commands(doc)]


def _required(inv: Invocation) -> list[str]:
    return [w for w, o in zip(inv.args, inv.optional) if not o]


# ---- the tests -------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_of_every_command_is_known(doc):
    problems = [p for cmd in doc_commands(doc) for p in checked(cmd).problems]
    assert not problems, "\n" + "\n".join(problems)


def test_complete_trainer_commands_pass_argument_validation():
    """Flags known is not enough: TP x PP must divide the ranks, batches must split..."""
    from megatron.training.arguments import ArgumentError, validate_args

    validated, problems = 0, []
    for cmd in all_commands():
        for inv in checked(cmd).invocations:
            args = _required(inv)
            if inv.program != "trainer" or inv.world_size is None or not _complete(args):
                continue
            validated += 1
            try:
                ns = trainer_parser().parse_args(args)
                ns.world_size = inv.world_size
                validate_args(ns)
            except (ArgumentError, SystemExit) as exc:
                problems.append(f"{cmd.where()}: {exc}  [{cmd.text[:120]}]")
    assert validated >= 2  # README's two torchrun examples at least
    assert not problems, "\n" + "\n".join(problems)


def _planner_runs(paper_check: bool = True):
    for cmd in all_commands():
        for inv in checked(cmd).invocations:
            args = _required(inv)
            # with no argument it is the tool's name in prose (it needs a model to plan)
            if inv.program == "planner" and args and _complete(args) and \
                    (paper_check or "--paper-check" not in args):
                yield cmd, args


def test_complete_planner_commands_run():
    from reft_ext.plan.cli import main

    ran, problems, docs = 0, [], set()
    # --paper-check plans a dozen set-ups (~2 s): tests/unit/test_plan_scale.py runs it, and
    # the slow tier below runs it as written
    for cmd, args in _planner_runs(paper_check=False):
        docs.add(cmd.doc)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = main(args)
            except SystemExit as exc:
                rc = exc.code
        ran += 1
        if rc:
            problems.append(f"{cmd.where()}: exit {rc}: {out.getvalue().strip()[-300:]}")
        printed = set(out.getvalue().splitlines())
        for line in cmd.output:  # the sample under a `$ ` command: each line as printed
            if line.strip() not in ("", "...") and line not in printed:
                problems.append(f"{cmd.where()}: the doc shows a line the command does not "
                                f"print: {line!r}")
    assert ran >= 4  # docs/planner.md's two, docs/user_guide.md's and README's
    assert "README.md" in docs  # complete (no "..."): a newcomer pastes it as it is
    assert not problems, "\n" + "\n".join(problems)


# The README and the guides a newcomer follows after `make run` (which makes .venv): their
# commands name the venv's programs, as a bare python or torchrun has no torch.
VENV_DOCS = ("README.md", "docs/huggingface.md", "docs/user_guide.md")
VENV = ".venv/bin/"


def _bare_program(cmd: Command) -> str | None:
    """The bare python/python3/torchrun that runs this command's project code, or None
    (the venv's, a name in prose, python's own -m venv, a stdin script)."""
    words = cmd.words
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]
    if not words or words[0] not in ("python", "python3", "torchrun"):
        return None
    rest = words[1:]
    if not rest or (rest[0] == "-m" and len(rest) == 2) or rest[:2] == ["-m", "venv"] \
            or rest[0] == "-":
        return None
    return words[0]


def test_readme_and_guides_run_in_the_venv_they_name():
    """What a newcomer pastes after `make run` runs: .venv/bin/python, not a bare python
    without torch (issue 52: README's Hugging Face section)."""
    problems = []
    for doc in VENV_DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            lines = f.read().splitlines()
        # inline: python commands only (prose names "`torchrun --max-restarts 3`")
        inline = [c for c in _inline_commands(doc, lines) if c.words[0] != "torchrun"]
        for cmd in _fenced_commands(doc, lines) + inline:
            bare = _bare_program(cmd)
            if bare:
                problems.append(f"{cmd.where()}: `{bare}` is not the venv's: write "
                                f"{VENV}{bare}  [{cmd.text[:100]}]")
    assert not problems, "\n" + "\n".join(problems)
    # what they run is in it: the converter's extra, torchrun
    import importlib.util

    assert importlib.util.find_spec("transformers") and os.path.isfile(
        os.path.join(os.path.dirname(sys.executable), "torchrun"))


def test_install_by_hand_installs_the_extras_make_install_does():
    with open(os.path.join(REPO, "Makefile")) as f:
        made = re.search(r"-e '\.\[([\w,]+)\]'", f.read())
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        by_hand = re.findall(r"^pip install .*-e '\.\[([\w,]+)\]'", f.read(), re.M)
    assert made and len(by_hand) == 1, by_hand
    assert set(made.group(1).split(",")) <= set(by_hand[0].split(",")), \
        (made.group(1), by_hand[0])  # the hf extra: the converter needs transformers


def test_the_checker_sees_a_bare_python():
    text = "python tools/convert_checkpoint.py --to hf --load x --output y"
    assert _bare_program(Command("d", 1, text, _shell_words(text)[0])) == "python"
    for ok in (".venv/bin/python tools/convert_checkpoint.py --help", "python -m reft_ext.plan",
               "python3 -m venv .venv", "python - <<'EOF'"):
        assert _bare_program(Command("d", 1, ok, _shell_words(ok)[0])) is None, ok


# Flags of other programs that the docs name in prose (Slurm, pip, setuptools, hipcc, the
# example scripts' launch_node.sh, NVRx): not ours to check.
FOREIGN_FLAGS = {
    "srun/sbatch": {"--jobid", "--overlap", "--ntasks-per-node", "--label", "--exclude",
                    "--kill-on-bad-exit", "--no-kill", "--node-timeout", "--requeue",
                    "--signal", "--gpu-bind"},
    "nvidia-smi": {"--query-compute-apps", "--format"},
    "pip": {"--no-build-isolation"},
    "setup.py build_ext": {"--build-lib", "--build-temp"},
    "hipcc": {"--offload-arch"},
    "python -m csrc.setup_ext (sys.argv, not argparse)": {"--hip-check"},
    "examples/slurm/launch_node.sh": {"--cleanup"},
    "NVRx": {"--replication-jump"},
}


def test_every_flag_named_in_prose_exists():
    """A flag named anywhere in the docs (``--reft-keep 2`` in a sentence) is a flag of the
    trainer, the planner, torchrun or one of the scripts; a renamed or removed one is
    caught here even where no command line shows it."""
    known = _options(trainer_parser()) | _options(planner_parser()) | \
        _options(torchrun_parser()) | set().union(*FOREIGN_FLAGS.values())
    for script in _mentioned_scripts():
        parser, help_text, _ = script_parser(script)
        known |= _options(parser) if parser else set(re.findall(r"--[\w-]+", help_text or ""))
    problems = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                # --reft-* (a family) ends in '-' or '*': not a flag
                for m in re.finditer(r"(?<![\w/.-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*/-])", line):
                    if m.group(0) not in known:
                        problems.append(f"{doc}:{n}: {m.group(0)}: no program of this "
                                        f"repository has this flag")
    assert not problems, "\n" + "\n".join(problems)


# named in the docs but not files of the tree, on purpose
NOT_IN_THE_TREE = {
    "megatron/__init__.py": "README: there is none, the namespace is shared with megatron-core",
}


def _exists(path: str) -> bool:
    if path in NOT_IN_THE_TREE:
        return True
    m = re.search(r"\{([^{}]*)\}", path)  # csrc/copy_engine.{h,cpp}
    if m:
        return all(_exists(path[:m.start()] + alt + path[m.end():])
                   for alt in m.group(1).split(","))
    if re.fullmatch(r"data/\w+_text_document(\.bin|\.idx)?", path):  # built on first use
        return True
    roots = [REPO]
    if path.startswith("megatron/core"):  # megatron-core's own sources, installed
        import megatron.core

        roots = [os.path.dirname(os.path.dirname(os.path.dirname(megatron.core.__file__)))]
    for root in roots:
        full = os.path.join(root, path)
        if glob.glob(full) or glob.glob(full + "*"):  # a dataset prefix: data/pd_english
            return True
    return False


def test_paths_named_in_docs_exist():
    """tests/, tools/, benchmarks/, docs/... paths in the docs are in the tree (a test
    file that moved to tests/unit/ left docs/csrc.md pointing at nothing)."""
    problems = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for m in re.finditer(r"(?<![\w./-])((?:tests|tools|benchmarks|reft_ext|megatron|"
                                     r"examples|csrc|docs|data)/[\w./*{},-]*[\w*}])", line):
                    path = m.group(1).split("::")[0]
                    if not _exists(path):
                        problems.append(f"{doc}:{n}: {path}: no such file or directory")
    assert not problems, "\n" + "\n".join(problems)


# the [FAULT] lines of a crash and of a lost node (README's make demo sample, the user
# guide); checked against what the code prints below, so they cannot drift from it
INJECTING = (r"\[FAULT\] injecting SIG\w+ into rank \d+ \(pid \d+\) at iteration \d+, "
             r"phase [\w-]+(?: \(during its snapshot write\))?(?: \(node loss\))?")
WIPED = r"\[FAULT\] wiped failure domain \d+ \(\S+\)"


def _printed_fault_lines(tmp_path) -> tuple[str, str]:
    """The lines fault_observer.py and faults.py print for a node loss, made by that code
    (SIGCONT to this process: nothing stops; the shared memory wiped is under tmp_path)."""
    import signal
    from types import SimpleNamespace

    from reft_ext.testing.fault_observer import FaultObserver
    from reft_ext.testing.fault_specs import FaultSpec
    from reft_ext.testing.faults import ReftFaults

    session = SimpleNamespace(
        snap=SimpleNamespace(store=SimpleNamespace(job="docs-node2")),
        cfg=SimpleNamespace(shm_dir=str(tmp_path), node_of=lambda rank: 2),
        adapter=SimpleNamespace(rank=2))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ReftFaults(session).wipe_node()
        FaultObserver([], 2).fire(FaultSpec(2, 250, signal.SIGCONT, "node"))
    wiped, injecting = out.getvalue().splitlines()
    return injecting, wiped


def test_fault_lines_in_docs_are_what_a_run_prints(tmp_path, monkeypatch):
    monkeypatch.delenv("REFT_EVENTS_FILE", raising=False)
    injecting, wiped = _printed_fault_lines(tmp_path)
    assert re.fullmatch(INJECTING, injecting), injecting
    prefix = wiped[:wiped.index("[FAULT]")]  # what reft_print puts before it, if anything
    assert re.fullmatch(re.escape(prefix) + WIPED, wiped), wiped
    patterns = {"[FAULT] injecting": INJECTING, "[FAULT] wiped": re.escape(prefix) + WIPED}
    problems, seen = [], 0
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for key, pattern in patterns.items():
                    if key in line and not line.lstrip().startswith(("*", "-", "|")):
                        seen += 1
                        sample = re.sub(r"^\d+: ", "", line.strip())  # srun --label
                        if not re.fullmatch(pattern, sample):
                            problems.append(f"{doc}:{n}: not the line a run prints "
                                            f"(like {injecting if 'inj' in key else wiped!r}):"
                                            f" {sample}")
    assert seen >= 3  # README's make demo sample and the user guide's hang
    assert not problems, "\n" + "\n".join(problems)


def test_the_checker_sees_what_a_user_would_hit():
    """The reader itself: continuations, prompts, placeholders, optional groups,
    launchers, wrappers; a wrong flag is named with its doc and line."""
    lines = ["```console",
             "$ OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 pretrain_llama.py \\",
             "    --model-size tiny --no-such-flag --save <dir> ...   # a comment",
             "python -m reft_ext.plan --hardware v100 [--json] [--plot out.png]",
             "srun --jobid=<job id> python tools/reft_status.py --job <job id> --bogus",
             "python - <<'EOF' /tmp/x",
             "import torch  # --not-a-flag: Python, not shell",
             "EOF",
             "[FAULT] injecting SIGKILL into rank 1 (output, not a command)",
             "```",
             "Prose with `tools/launch_nodes.py --nnodes 2 --",
             "pretrain_llama.py --reft-protect arc --typo` inline."]
    cmds = _fenced_commands("x.md", lines) + _inline_commands("x.md", lines)
    assert [c.line for c in cmds] == [2, 4, 5, 6, 11]
    problems = [p for c in cmds for p in checked(c).problems]
    assert [p.split("  [")[0] for p in problems] == [
        "x.md:2: --no-such-flag: not a flag of pretrain_llama.py "
        "(megatron/training/arguments.py)",
        "x.md:5: --bogus: not a flag of tools/reft_status.py",
        "x.md:11: --typo: not a flag of pretrain_llama.py (megatron/training/arguments.py)"]
    plan = checked(cmds[1]).invocations[0]
    assert _required(plan) == ["--hardware", "v100"]
    assert not _complete(checked(cmds[0]).invocations[0].args)


def test_planner_hardware_names_ignore_case():
    """README's ``--hardware v100``: profiles match case-insensitively; unknown names
    are still refused with the list."""
    from reft_ext.plan.common import PlanConfigError
    from reft_ext.plan.hardware import HardwareConfig

    assert HardwareConfig("v100").hardware == "V100"
    assert HardwareConfig("mi250x").hardware == "MI250X"
    assert HardwareConfig("CPU").hardware == "cpu"
    with pytest.raises(PlanConfigError, match=r"--hardware: unknown profile 'v1000'; "
                                              r"choose from V100, "):
        HardwareConfig("v1000")


def test_planner_precision_flags_are_used():
    """docs/planner.md plans this machine with --fp32 (4-byte parameters: slot 169.92 MB);
    the flag was parsed and then dropped, planning bf16."""
    from reft_ext.plan.cli import plan

    base = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "64", "--vocab-size", "1024", "--data-parallel-size", "2",
            "--hardware", "cpu"]
    assert plan(base + ["--fp32"]).plan.model.precision == "fp32"
    assert plan(base + ["--fp16"]).plan.model.precision == "fp16"
    assert plan(base).plan.model.precision == "bf16"


# ---- slow: the real processes ------------------------------------------------------------
def _mentioned_scripts() -> list[str]:
    out = set()
    for cmd in all_commands():
        out |= {inv.program for inv in Checker(cmd).run().invocations
                if inv.program.startswith(tuple(d + "/" for d in SCRIPT_DIRS))}
    return sorted(out)


@pytest.mark.slow
@pytest.mark.parametrize("script", _mentioned_scripts())
def test_mentioned_script_help_runs(script):
    r = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, f"python {script} --help: exit {r.returncode}\n{r.stderr[-2000:]}"


@pytest.mark.slow
def test_planner_examples_run_as_processes():
    for cmd, args in _planner_runs():
        r = subprocess.run([sys.executable, "-m", "reft_ext.plan", *args], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd.where()}: exit {r.returncode}\n{r.stderr[-2000:]}"
