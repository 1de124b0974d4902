"""The API reference of the documentation site, found by walking the package (``hooks.py`` calls ``build``).

Every public module of ``k2lab`` gets a page: a module whose name has no leading underscore, inside a package that is
public too (``__main__`` and ``_private`` modules are not). A module's public names are its ``__all__``, else the
names it defines without a leading underscore (not the names it imports). Each public name is documented once, on
its *home*: the shallowest module that makes it public, so ``K2Model`` reads as ``k2lab.K2Model`` (``import k2lab``),
``Router`` as ``k2lab.model.Router``, and a name only its own module makes public lives there. Every other module
that makes it public links to that entry. A class gets a page of its own (``api/<home>.<Class>.md``); functions and
documented constants are entries of their module's page (anchor ``<home>.<name>``).

The docstring rule: a public module, class, function, method or property of a public class (its own members; names
with a leading underscore and ``__dunder__`` methods aside), and a constant named in an ``__all__``, has a docstring.
``build`` returns every one that has none, with its file and line; the hook turns each into a warning, which fails
``mkdocs build --strict``. Attributes without a docstring (dataclass fields, module constants nobody exports) are not
shown (mkdocs.yml: ``show_if_no_docstring: false``); a class's fields still show in its signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import griffe

MODULE, CLASS, FUNCTION, ATTRIBUTE = "module", "class", "function", "attribute"


@dataclass
class Entry:
    """One public name of one module, and where it is documented."""

    module: str  # the module that makes it public: "k2lab.model"
    name: str  # its name there: "Router"
    obj: griffe.Object  # the object itself (an alias followed to its target)
    identifier: str  # what mkdocstrings renders: "k2lab.model.Router"
    home: Entry | None = None  # the entry that documents the object (itself on its home); None for a module

    @property
    def kind(self) -> str:
        return self.obj.kind.value

    @property
    def public(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class Reference:
    """What ``build`` gives: the pages, the navigation, the anchors to check, and the undocumented public names."""

    pages: dict[str, str] = field(default_factory=dict)  # src_uri -> Markdown
    nav: list = field(default_factory=list)  # MkDocs nav items, under "API reference"
    anchors: dict[str, str] = field(default_factory=dict)  # public dotted name -> the page (src_uri) with its anchor
    undocumented: list[str] = field(default_factory=list)  # "k2lab/x.py:12: the function k2lab.x.f has no docstring"
    modules: int = 0


# ---------------------------------------------------------------------------------------------------------------------
# What is public


def load(repo: Path, package: str = "k2lab") -> griffe.Module:
    """The package as griffe reads it from the source in ``repo`` (nothing is imported)."""
    return griffe.load(package, search_paths=[str(repo)], resolve_aliases=True, resolve_external=False)


def public_modules(package: griffe.Module) -> list[griffe.Module]:
    """The package and every public module below it, in the order of their dotted paths."""
    found = [package]
    for name, sub in package.modules.items():
        if not name.startswith("_") and not sub.is_alias:  # an alias: a module imported into a package's namespace
            found += public_modules(sub)
    return sorted(found, key=lambda m: m.path)


def public_names(module: griffe.Module) -> list[str]:
    """``__all__``, else the names the module defines (classes, functions, attributes) without a leading underscore."""
    if module.exports is not None:
        return [str(name) for name in module.exports]
    return [name for name, member in module.members.items()
            if not name.startswith("_") and not member.is_alias and not member.is_module]


def _entry(module: griffe.Module, name: str, modules: set[str]) -> Entry:
    """The entry for ``module.name``. A function re-exported under the name of the submodule that defines it
    (``k2lab.generate``, from ``k2lab/model/generate.py``) reads to griffe as that submodule, though Python binds the
    function there; the object meant is the function inside it."""
    member = module.members.get(name)
    if member is None:
        raise KeyError(f"{module.path}.__all__ names {name!r}, which {module.relative_filepath} does not define")
    try:
        obj = member.final_target if member.is_alias else member
    except (griffe.AliasResolutionError, griffe.CyclicAliasError) as err:
        raise ValueError(f"{module.path} makes {name!r} public, imported from {member.target_path}, outside the "
                         "package: the API reference documents the package's own objects only") from err
    public = f"{module.path}.{name}"
    if obj.is_module and name in obj.members and not obj.members[name].is_alias:
        return Entry(module.path, name, obj.members[name], f"{obj.path}.{name}")
    if obj.is_module and obj.path in modules:
        return Entry(module.path, name, obj, obj.path)  # a module: its own page
    return Entry(module.path, name, obj, public)


def _rank(entry: Entry, path: str) -> tuple:
    """How well ``entry`` serves as the home of the object at ``path`` (lower is better)."""
    above = path == entry.module or path.startswith(entry.module + ".")
    return entry.module.count("."), not above, entry.module


def _homes(entries: list[Entry]) -> None:
    """Each object's home: of the modules that make it public, the shallowest; between equals, the one that defines
    it or a package above it; then by name."""
    by_object: dict[str, list[Entry]] = {}
    for entry in entries:
        if entry.kind != MODULE:
            by_object.setdefault(entry.obj.path, []).append(entry)
    for path, found in by_object.items():
        home = min(found, key=lambda entry, path=path: _rank(entry, path))
        for entry in found:
            entry.home = home


# ---------------------------------------------------------------------------------------------------------------------
# The docstring rule


def _missing(obj: griffe.Object, what: str) -> tuple[str, int, str]:
    return str(obj.relative_package_filepath), obj.lineno or 1, f"the {what} {obj.path} has no docstring"


def _undocumented_members(cls: griffe.Class) -> list[tuple[str, int, str]]:
    out = []
    for name, member in cls.members.items():
        if name.startswith("_") or member.is_alias:
            continue
        if member.is_function and not member.docstring:
            out.append(_missing(member, "method"))
        elif member.is_attribute and "property" in member.labels and not member.docstring:
            out.append(_missing(member, "property"))
        elif member.is_class:
            if not member.docstring:
                out.append(_missing(member, "class"))
            out += _undocumented_members(member)
    return out


def undocumented(modules: list[griffe.Module], entries: list[Entry]) -> list[str]:
    """Every public module, class, function, method and property (and exported constant) without a docstring."""
    out, seen = [], set()
    for module in modules:
        if not module.docstring:
            out.append(_missing(module, "module"))
    for entry in entries:
        obj = entry.obj
        if obj.path in seen or obj.is_module:
            continue
        seen.add(obj.path)
        if obj.is_class:
            if not obj.docstring:
                out.append(_missing(obj, "class"))
            out += _undocumented_members(obj)
        elif obj.is_function and not obj.docstring:
            out.append(_missing(obj, "function"))
        elif obj.is_attribute and not obj.docstring and _exported(entry, modules):
            out.append(_missing(obj, f"constant (in {entry.module}.__all__)"))
    return [f"{file}:{line}: {what}" for file, line, what in sorted(set(out))]


def _exported(entry: Entry, modules: list[griffe.Module]) -> bool:
    module = next(m for m in modules if m.path == entry.module)
    return module.exports is not None


# ---------------------------------------------------------------------------------------------------------------------
# The pages


def summary(obj: griffe.Object) -> str:
    """The first paragraph of a docstring, on one line, cut at about 160 characters."""
    doc = obj.docstring
    if not doc or not doc.value.strip():
        return ""
    first = " ".join(doc.value.strip().split("\n\n")[0].split())
    return first if len(first) <= 160 else first[:157].rsplit(" ", 1)[0] + " ..."


def _shown(entry: Entry) -> bool:
    """Whether the entry has a heading of its own: every class and function; a constant only with a docstring."""
    return entry.kind != ATTRIBUTE or bool(entry.obj.docstring)


def _uri(entry: Entry) -> str:
    """The page (and anchor) of an entry's home."""
    home = entry.home
    if home is None:
        return f"{entry.obj.path}.md"
    if entry.kind == CLASS:
        return f"{home.public}.md"
    return f"{home.module}.md#{home.public}"


def _anchor(entry: Entry) -> str:
    """An anchor for the public spelling where mkdocstrings' heading carries another one (see ``_entry``)."""
    return "" if entry.identifier == entry.public else f'<span id="{entry.public}"></span>\n'


def _directive(identifier: str, **options: object) -> list[str]:
    lines = [f"::: {identifier}"]
    if options:
        lines.append("    options:")
        lines += [f"      {key}: {str(value).lower() if isinstance(value, bool) else value}"
                  for key, value in options.items()]
    return lines + [""]


def _module_page(module: griffe.Module, entries: list[Entry], children: list[griffe.Module]) -> list[str]:
    here = [e for e in entries if e.home is e]
    classes = [e for e in here if e.kind == CLASS]
    others = [e for e in here if e.kind != CLASS and _shown(e)]
    elsewhere = [e for e in entries if e.home is not None and e.home is not e and _shown(e.home)]
    submodules = {m.path: m for m in children}
    for entry in entries:
        if entry.kind == MODULE:
            submodules.setdefault(entry.obj.path, entry.obj)
    body = [f"# `{module.path}`", ""]
    body += _directive(module.path, show_root_heading=False, members=False)
    if submodules:
        body += ["## Modules", ""]
        body += [f"- [`{path}`]({path}.md): {summary(sub)}" for path, sub in sorted(submodules.items())] + [""]
    if classes:
        body += ["## Classes", ""]
        body += [f"- [`{e.name}`]({e.public}.md): {summary(e.obj)}" for e in classes] + [""]
    if others:
        body += ["## Functions and constants" if any(e.kind == ATTRIBUTE for e in others) else "## Functions", ""]
        for entry in others:
            body += [_anchor(entry)] + _directive(entry.identifier, heading_level=3)
    if elsewhere:
        body += ["## Documented elsewhere", "",
                 "Public here too, documented where they are first made public:", ""]
        body += [f"- `{e.name}`: [`{e.home.public}`]({_uri(e)})" for e in elsewhere] + [""]
    return body


def _class_page(entry: Entry) -> str:
    return "\n".join([_anchor(entry)] + _directive(entry.identifier, heading_level=1, show_root_heading=True,
                                                    show_root_full_path=True))


def build(repo: Path, package_name: str = "k2lab") -> Reference:
    """The API pages (``api/...``) of the package in ``repo``, their navigation and checks."""
    package = load(repo, package_name)
    modules = public_modules(package)
    paths = {m.path for m in modules}
    by_module = {m.path: [_entry(m, name, paths) for name in public_names(m)] for m in modules}
    entries = [e for found in by_module.values() for e in found]
    _homes(entries)
    ref = Reference(undocumented=undocumented(modules, entries), modules=len(modules))
    children = {m.path: [c for c in modules if c.path.rpartition(".")[0] == m.path] for m in modules}

    index = ["# API reference", "", " ".join([
        f"Every public module of `{package_name}` and every public name, from their docstrings (shapes as they give",
        "them: `[B, T, D]` is batch, tokens, the residual width). A module's public names are its `__all__`, else the",
        "names it defines without a leading underscore; each is documented once, where it is first made public",
        "(`k2lab.K2Model`, not `k2lab.model.transformer.K2Model`), and linked from the other modules that export it.",
    ]), ""]
    for module in modules:
        uri = f"api/{module.path}.md"
        ref.pages[uri] = "\n".join(_module_page(module, by_module[module.path], children[module.path]))
        links = []
        for entry in by_module[module.path]:
            if entry.home is None or not _shown(entry.home):
                continue
            links.append(f"[`{entry.name}`]({_uri(entry)})")
            if entry.home is entry:
                ref.anchors[entry.public] = f"api/{entry.public}.md" if entry.kind == CLASS else uri
                if entry.kind == CLASS:
                    ref.pages[f"api/{entry.public}.md"] = _class_page(entry)
        level = "#" * min(2 + max(module.path.count(".") - 1, 0), 4)  # k2lab and its top packages alike: ##
        index += [f"{level} [`{module.path}`]({module.path}.md)", "", summary(module), ""]
        if links:
            index += [", ".join(links), ""]
    ref.pages["api/index.md"] = "\n".join(index) + "\n"
    ref.nav = [{"Overview": "api/index.md"}] + _nav(package, children, by_module)
    return ref


def _nav(module: griffe.Module, children: dict[str, list[griffe.Module]], by_module: dict[str, list[Entry]],
         depth: int = 0) -> list:
    """The navigation under "API reference": a section per package (its page, then its modules), a section per
    module with classes (its page, then a page per class), titled by their last dotted name below the top."""
    classes = [{e.name: f"api/{e.public}.md"} for e in by_module[module.path] if e.kind == CLASS and e.home is e]
    title = module.path if depth <= 1 else module.path.rpartition(".")[2]
    page = [{title: f"api/{module.path}.md"}]
    subs = [item for sub in children[module.path] for item in _nav(sub, children, by_module, depth + 1)]
    if depth == 0:  # the root's page and its classes, then each top package, straight under the reference
        return ([{title: page + classes}] if classes else page) + subs
    items = page + classes + subs
    return [{title: items}] if len(items) > 1 else page
