"""The learner's own module: every "write it yourself" answer of the course, kept in one file, ``mine.py``, so that a
later notebook runs the learner's own pieces (09 assembles K2 from them, 10 trains it) without copy and paste.

An exercise's stub carries the decorator; running the cell checks the function and records it:

    @lab.mine                                  # checks it, then keeps it in mine.py
    def my_rms_norm(x, weight, eps):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

A later notebook loads the module; every piece the learner skipped (or whose answer fails its check) is k2lab's
reference, and the cell's output says which is which:

    mine = lab.mine.load("my_rms_norm", "my_mla")   # prints where each of these comes from
    mine.my_mla(w, cfg, hidden, cos, sin)

Where the file lives: ``K2LAB_MINE`` if set, else ``mine.py`` in the working folder (the notebooks' folder in
JupyterLab). It is plain Python, one block per piece, each block self-contained: the imports, notebook helpers and
plain constants the function reads, then the function. Running the exercise's cell again replaces its block;
editing the file by hand works too (an edited block is checked again when it is loaded). A stub that still raises
``NotImplementedError`` is never recorded, so it cannot replace an earlier answer.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import functools
import hashlib
import importlib
import inspect
import os
import re
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .exercises.checking import Verdict
from .own_training import Observed, observe
from .pieces import PIECES, Piece

MODULE_NAME = "mine"  # the name of the learner's module, also bound inside it to the module itself
_HEADER = '''"""Your own K2: every piece you wrote in the k2lab course, one block per piece, kept by @lab.mine.

Run an exercise's cell again to replace its block, or edit a block here: the notebooks load this file with
lab.mine.load(), check an edited block again, and use k2lab's reference for every piece that is missing or fails.
Inside a block, `mine` is this module (your other pieces, or the references that stand in for them)."""
'''
_BLOCK = re.compile(r"^# >>> (?P<name>\w+) \| (?P<where>[^|]*) \| (?P<mark>[✓✗]) (?P<check>\S+) \| (?P<digest>\w+)\n"
                    r"(?P<body>.*?)^# <<< (?P=name)\n", re.S | re.M)


class RecordingError(ValueError):
    """A function ``@lab.mine`` cannot keep in a file of its own (it reads a notebook variable that is neither a
    module, a function nor a plain constant): the message says which and what to do."""


@dataclass
class Block:
    """One recorded piece as the file holds it: its source, where it sits in the file, and its check at recording."""

    name: str
    where: str
    passed: bool
    check: str
    digest: str
    body: str
    line: int = 0  # the line of the file where the body starts (1-based), so tracebacks point into mine.py

    def text(self) -> str:
        """The block as mine.py holds it: its header line (name, notebook, verdict, digest), the body, its end line."""
        mark = "✓" if self.passed else "✗"
        return (f"# >>> {self.name} | {self.where} | {mark} {self.check} | {self.digest}\n{self.body.rstrip()}\n"
                f"# <<< {self.name}\n")

    @property
    def edited(self) -> bool:
        """Whether the body was changed by hand since it was recorded (its check is then stale)."""
        return digest(self.body) != self.digest


def digest(body: str) -> str:
    """A short fingerprint of a block's source, blank lines at its ends ignored."""
    return hashlib.sha256(body.strip().encode()).hexdigest()[:12]


def read_blocks(path: Path) -> list[Block]:
    """The blocks of a mine.py file, in file order; [] for a missing file."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("body")) + 1
        blocks.append(Block(match["name"], match["where"].strip(), match["mark"] == "✓", match["check"],
                            match["digest"], match["body"], line))
    return blocks


def write_blocks(path: Path, blocks: list[Block]) -> None:
    """Write the whole file at once: a temporary sibling, then a rename, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(_HEADER + "".join("\n\n" + block.text() for block in blocks), encoding="utf-8")
    os.replace(partial, path)


# --- what a function needs to live in a file of its own --------------------------------------------------------------


def is_stub(fn: Callable) -> bool:
    """Whether ``fn``'s body (its docstring aside) is only ``raise NotImplementedError``: an unwritten exercise."""
    import ast

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if node is None:
        return False
    body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
        getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else node.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _definition(fn: Callable) -> str:
    """The source of ``fn``'s definition without its decorators (``@lab.mine`` must not run again on import)."""
    import ast

    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    node = tree.body[0]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "\n".join(source.splitlines()[node.lineno - 1:]) + "\n"
    return source  # a lambda bound by an assignment: the statement itself


def _global_names(fn: Callable) -> list[str]:
    """The globals ``fn`` reads: in its body (and nested functions, comprehensions), its defaults and annotations."""
    import ast

    names: list[str] = []

    def walk(code: types.CodeType) -> None:
        for instruction in dis.get_instructions(code):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and instruction.argval not in names:
                names.append(instruction.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    walk(fn.__code__)
    try:  # the signature is evaluated where the function is defined: its names must exist in the file too
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, SyntaxError, IndexError):
        return names
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        signature = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.annotation]
        signature += [*args.defaults, *[d for d in args.kw_defaults if d is not None]]
        signature += [node.returns] if node.returns is not None else []
        for part in signature:
            for sub in ast.walk(part):
                if isinstance(sub, ast.Name) and sub.id not in names:
                    names.append(sub.id)
    return names


_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _is_plain(value: object) -> bool:
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN) and not (isinstance(value, float) and value != value)  # nan has no literal


def _import_line(name: str, value: object) -> str | None:
    """``import x`` / ``from m import y as name`` for a module, function or class importable by name; else None."""
    if isinstance(value, types.ModuleType):
        if value.__name__ == name:
            return f"import {name}"
        parent, _, leaf = value.__name__.rpartition(".")
        if parent and leaf == name:
            return f"from {parent} import {leaf}"
        return f"import {value.__name__} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "." in qualname or "<" in qualname:
        return None
    try:
        if getattr(importlib.import_module(module), qualname) is not value:
            return None
    except (ImportError, AttributeError):
        return None
    return f"from {module} import {qualname}" + ("" if qualname == name else f" as {name}")


def module_source(fn: Callable) -> str:
    """A block that defines ``fn`` on its own: the imports, plain constants and notebook helpers it reads (helpers
    transitively), then ``fn``. The course's other pieces are not copied: inside mine.py they are resolved to the
    learner's own or the reference at load time. Raises RecordingError for anything else a function reads."""
    imports: list[str] = []
    constants: list[str] = []
    helpers: list[str] = []
    seen: set[int] = set()

    def visit(f: Callable) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        for name in _global_names(f):
            if name in PIECES or name == MODULE_NAME:
                continue  # resolved inside mine.py
            if name not in f.__globals__:
                if hasattr(builtins, name):
                    continue
                continue  # undefined in the notebook as well: the function would fail there too
            value = f.__globals__[name]
            if isinstance(value, types.ModuleType) and value.__name__ == MODULE_NAME:
                constants.append(f"{name} = {MODULE_NAME}  # your module itself")
                continue
            own = getattr(value, "__module__", None) == f.__globals__.get("__name__")  # defined beside it
            line = None if own else _import_line(name, value)
            if line is not None:
                if line not in imports:
                    imports.append(line)
            elif own and isinstance(value, types.FunctionType):
                visit(value)  # a helper defined in the notebook: keep its source
            elif _is_plain(value):
                constants.append(f"{name} = {value!r}")
            else:
                raise RecordingError(
                    f"{fn.__name__} reads the notebook's variable `{name}` (a {type(value).__name__}), which mine.py "
                    f"cannot keep: pass it as an argument, or compute it inside the function")
        helpers.append(_definition(f))

    visit(fn)
    parts = ["\n".join(imports), "\n".join(dict.fromkeys(constants)), *helpers]
    return "\n\n\n".join(part.strip("\n") for part in parts if part.strip()) + "\n"


# --- the module itself --------------------------------------------------------------------------------------------


@dataclass
class Provenance:
    """Where one piece of the loaded module comes from, and why."""

    name: str
    yours: bool
    reason: str  # "✓ check_x", "not written yet", "✗ check_x: ...", "does not run: ..."

    def __str__(self) -> str:
        piece = PIECES[self.name]
        if self.yours:
            return f"{self.name:<26} yours          ({piece.where}; {self.reason})"
        return f"{self.name:<26} the reference  ({piece.where}: {self.reason})"


class Mine:
    """``@lab.mine`` records an exercise's function in the learner's module; ``lab.mine.load()`` loads that module
    with k2lab's references standing in for the pieces the learner did not write (or that fail their check)."""

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, str], Verdict] = {}  # (name, digest) -> verdict, for this session

    @property
    def path(self) -> Path:
        """The learner's module: ``K2LAB_MINE`` if set, else ``mine.py`` in the working folder."""
        return Path(os.environ.get("K2LAB_MINE") or Path.cwd() / "mine.py")

    def __call__(self, fn: Callable) -> Callable:
        """Check ``fn`` (an exercise's function, named as its stub names it) with its exercise's checker, show the
        verdict, and keep it in mine.py (unless it is still the stub). Returns ``fn`` unchanged."""
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"@lab.mine decorates an exercise's function (def my_...), got {type(fn).__name__}")
        if fn.__name__ not in PIECES:
            raise ValueError(f"@lab.mine keeps the course's exercises; {fn.__name__!r} is none of them "
                             f"(they are {', '.join(sorted(PIECES))})")
        piece = PIECES[fn.__name__]
        verdict = self._check(piece, fn)
        _show(verdict)
        if is_stub(fn):
            earlier = next((b for b in read_blocks(self.path) if b.name == piece.name), None)
            if earlier is not None:
                print(f"  (mine.py keeps your earlier {piece.name}, {'✓' if earlier.passed else '✗'} when recorded)")
            return fn
        try:
            body = module_source(fn)
        except (RecordingError, OSError, TypeError) as err:
            print(f"  not kept in mine.py: {err}")
            return fn
        block = Block(piece.name, piece.where, verdict.ok, piece.check_name, digest(body), body)
        blocks = read_blocks(self.path)
        if any(b.name == piece.name for b in blocks):
            blocks = [block if b.name == piece.name else b for b in blocks]
        else:
            blocks.append(block)
        write_blocks(self.path, blocks)
        self._verdicts[piece.name, block.digest] = verdict
        after = "the notebooks after this one use it" if verdict.ok else \
            "until it passes, the notebooks after this one use k2lab's reference"
        print(f"  kept in {_shown(self.path)} as {piece.name}: {after}")
        return fn

    @staticmethod
    def _check(piece: Piece, fn: Callable) -> Verdict:
        try:
            return piece.check(fn)
        except Exception as err:  # a checker must not take the notebook down with it
            return Verdict(False, f"{piece.what}: the check could not run your function: {type(err).__name__}: {err}")

    def load(self, *names: str, quiet: bool = False) -> types.ModuleType:
        """The learner's module (mine.py), every piece of the course in it: the learner's own where it was recorded
        and passed its check, k2lab's reference otherwise. Prints where each of ``names`` comes from (every piece
        the file holds, when none are named), unless ``quiet``. A block edited by hand since it was recorded is
        checked again here."""
        unknown = [n for n in names if n not in PIECES]
        if unknown:
            raise ValueError(f"no exercise of the course is called {unknown}; the pieces are {sorted(PIECES)}")
        module = types.ModuleType(MODULE_NAME, "Your own K2, loaded by lab.mine.load() (see k2lab.lab.learner).")
        module.__file__ = str(self.path)
        blocks = {b.name: b for b in read_blocks(self.path) if b.name in PIECES}
        namespaces: dict[str, dict] = {}
        provenance: dict[str, Provenance] = {}
        for name, block in blocks.items():
            namespace = {"__name__": MODULE_NAME, "__builtins__": builtins, MODULE_NAME: module}
            try:
                code = compile("\n" * (block.line - 1) + block.body, str(self.path), "exec")
                exec(code, namespace)
                if not callable(namespace.get(name)):
                    raise NameError(f"the block defines no function {name}")
            except Exception as err:  # the learner's file: anything may be wrong in it
                provenance[name] = Provenance(name, False, f"your block in mine.py does not run: "
                                                           f"{type(err).__name__}: {err}")
                continue
            namespaces[name] = namespace
        references = {name: piece.reference(module) for name, piece in PIECES.items()}
        chosen = dict(references)
        # Recorded verdicts first; then the edited blocks, checked with every other piece already in place.
        for name, block in blocks.items():
            if name in provenance:
                continue
            if not block.edited:
                verdict_text = f"{'✓' if block.passed else '✗'} {block.check}"
                provenance[name] = Provenance(name, block.passed, verdict_text if block.passed else
                                              f"yours fails {block.check}; run its cell to see why")
                if block.passed:
                    chosen[name] = namespaces[name][name]
        self._bind(module, namespaces, chosen)
        for name, block in blocks.items():
            if name in provenance:
                continue
            fn = namespaces[name][name]
            key = (name, digest(block.body))
            if key not in self._verdicts:
                self._verdicts[key] = self._check(PIECES[name], fn)
            verdict = self._verdicts[key]
            provenance[name] = Provenance(name, verdict.ok, f"edited in mine.py, checked again: {verdict!r}"
                                          if verdict.ok else f"edited in mine.py and fails: {verdict!r}")
            if verdict.ok:
                chosen[name] = fn
                self._bind(module, namespaces, chosen)
        for name in PIECES:
            provenance.setdefault(name, Provenance(name, False, "not written yet"))
        module.__provenance__ = provenance
        module.__references__ = references
        module.__namespaces__ = namespaces
        module.__rebind__ = functools.partial(self._bind, module, namespaces)  # for own_training.observe
        if not quiet:
            shown = names or [n for n in PIECES if n in blocks]
            print(f"your module: {_shown(self.path)}" + ("" if blocks else " (nothing recorded yet)"))
            for name in shown:
                print(f"  {provenance[name]}")
        return module

    @staticmethod
    def _bind(module: types.ModuleType, namespaces: dict[str, dict], chosen: dict[str, Callable]) -> None:
        """Make every piece resolve to its chosen function: as the module's attribute, and as a global of every
        block (a block keeps its own definition under its own name)."""
        for name, fn in chosen.items():
            setattr(module, name, fn)
            for owner, namespace in namespaces.items():
                if owner != name:
                    namespace[name] = fn

    def yours(self, module: types.ModuleType, name: str) -> bool:
        """Whether ``name`` in a loaded module is the learner's own (False: the reference stands in)."""
        return module.__provenance__[name].yours

    @staticmethod
    def observe(module: types.ModuleType) -> contextlib.AbstractContextManager[Observed]:
        """``with lab.mine.observe(mine) as seen:``: every call of the module's ``my_mla`` records each head's largest
        logit (``seen.max_logits``) and every call of ``my_router`` its expert counts (``seen.counts``), as
        ``k2lab.lab.own_training.observe`` does."""
        return observe(module)


def _shown(path: Path) -> str:
    """The module's path as the learner knows it: relative to the working folder when it lies inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _show(verdict: Verdict) -> None:
    """The verdict as a cell shows an object (with its rich display, when it has one)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(repr(verdict))
        return
    if get_ipython() is None:
        print(repr(verdict))
    else:
        display(verdict)


mine = Mine()
"""The learner's module: ``@lab.mine`` checks an exercise's function and keeps it in mine.py; ``lab.mine.load(...)``
gives the pieces back (see ``Mine``)."""
