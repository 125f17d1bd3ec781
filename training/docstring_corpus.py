"""The default corpus: the English docstrings every Python installation carries (standard library and
site-packages), read with `ast` — nothing is imported — and cached as a .jsonl that `training.corpus`
reads like any other corpus.

One docstring (module, class or function) is one document; doctest examples and reST markup are
dropped, short ones skipped, identical ones kept once.
"""
from __future__ import annotations

import ast
import gc
import multiprocessing
import hashlib
import json
import logging
import os
import re
import site
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)

MIN_WORDS = 10
# Generated sources (lookup tables, vendored stubs) are big and hold little prose.
MAX_FILE_BYTES = 2_000_000
_FORMAT = 1  # bump when the cleaning changes, so that cached corpora are rebuilt

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "node_modules"})


# --- which files --------------------------------------------------------------------------------

def default_source_roots() -> list[Path]:
    """The standard library (without the base interpreter's own site-packages) and this interpreter's
    site-packages folders."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for p in [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]:
        roots.append(Path(p))
    return [r for r in dict.fromkeys(r.resolve() for r in roots) if r.is_dir()]


def python_files(roots: Iterable[Path]) -> list[Path]:
    """Every .py file under `roots`, sorted; a root's nested site-packages belong to another root."""
    files: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(dict.fromkeys(files))


def fingerprint(files: list[Path]) -> str:
    """Changes when the interpreter, a file or the cleaning code changes."""
    h = hashlib.sha256(f"{sys.version}|{_FORMAT}|{MIN_WORDS}|{MAX_FILE_BYTES}".encode())
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f}|{st.st_mtime_ns}|{st.st_size}\n".encode())
    return h.hexdigest()[:16]


# --- docstrings ---------------------------------------------------------------------------------

def _docstrings(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of the module and every class/function, visiting statements only
    (expressions hold no docstrings, and walking them would double the time)."""
    stack: list[tuple[str, list[ast.stmt]]] = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        yield "", doc
    stack.append(("", tree.body))
    while stack:
        prefix, body = stack.pop()
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{node.name}"
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield name, doc
                stack.append((name + ".", node.body))
            else:  # if / try / with / for blocks may define functions too
                for attr in ("body", "orelse", "finalbody"):
                    inner = getattr(node, attr, None)
                    if isinstance(inner, list):
                        stack.append((prefix, inner))
                for handler in getattr(node, "handlers", ()):
                    stack.append((prefix, handler.body))


_ROLE = re.compile(r":[\w:+-]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")      # :class:`~a.B` -> a.B
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_{1,2}")                  # `text <url>`_ -> text
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"`([^`]+)`_{0,2}")
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^*\s](?:[^*]*[^*\s])?)\*{1,2}(?![\w*])")
_FIELD = re.compile(r"^:(param|parameter|arg|argument|key|keyword|type|raises?|except|exception|var|ivar|cvar"
                    r"|vartype|returns?|rtype|yields?)\b\s*([^:]*):\s*", re.IGNORECASE)
_UNDERLINE = re.compile(r"^([=\-~^*+#`'\".:_])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::(.*)$")
# Directives whose body is prose; the rest (code, math, tables of contents, images) are dropped.
_PROSE_DIRECTIVES = frozenset({"note", "warning", "seealso", "attention", "caution", "danger", "hint",
                               "important", "tip", "admonition", "deprecated", "versionadded",
                               "versionchanged", "rubric"})


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def clean_docstring(doc: str) -> str:
    """Prose paragraphs of a (cleandoc'ed) docstring, one per line; "" when nothing is left.

    Drops doctest examples (`>>>` lines and their output, up to the next blank line), literal
    blocks after `::`, code directives, section underlines; unwraps roles, links and emphasis."""
    lines = doc.expandtabs().splitlines()
    kept: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith((">>>", "In [")):
            while i < n and lines[i].strip():  # the example and its output
                i += 1
            continue
        m = _DIRECTIVE.match(stripped)
        if m or stripped.startswith(".. "):
            body_indent, i = _indent(line), i + 1
            prose = bool(m) and m.group(1) in _PROSE_DIRECTIVES
            if prose and m.group(2).strip() and m.group(1) not in ("versionadded", "versionchanged"):
                kept.append(m.group(2).strip())
            while i < n and (not lines[i].strip() or _indent(lines[i]) > body_indent):
                if prose:
                    kept.append(lines[i].strip())
                i += 1
            kept.append("")
            continue
        if stripped.endswith("::"):  # a literal block follows
            text = stripped[:-2].rstrip()
            if text:
                kept.append(text + ":")
            base, i = _indent(line), i + 1
            while i < n and (not lines[i].strip() or _indent(lines[i]) > base):
                i += 1
            kept.append("")
            continue
        if _UNDERLINE.match(stripped):
            if kept and kept[-1]:  # the title above an underline is a heading, not prose
                kept[-1] = ""
            i += 1
            continue
        kept.append(stripped)
        i += 1

    paragraphs, current = [], []
    for line in [*kept, ""]:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(_clean_inline(" ".join(current)))
            current = []
    return "\n".join(p for p in paragraphs if p)


def _clean_inline(text: str) -> str:
    text = _FIELD.sub(lambda m: f"{m.group(2).strip() or m.group(1).capitalize()}: ", text)
    text = _ROLE.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\1", text)
    return " ".join(text.split())


def file_documents(path: Path) -> list[tuple[str, str]]:
    """(source, cleaned text) of every docstring in one file; [] when the file does not parse."""
    try:
        source = path.read_bytes()
        if len(source) > MAX_FILE_BYTES or (b'"""' not in source and b"'''" not in source):
            return []  # no triple-quoted string: no docstring worth keeping
        gc_was_on = gc.isenabled()
        gc.disable()  # an AST is millions of fresh objects: the cycle collector would double the time
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old code
                tree = ast.parse(source, filename=str(path))
        finally:
            if gc_was_on:
                gc.enable()
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError, RecursionError, MemoryError):
        return []
    out = []
    for name, doc in _docstrings(tree):
        text = clean_docstring(doc)
        if len(text.split()) >= MIN_WORDS:
            out.append((f"{path}:{name}" if name else str(path), text))
    return out


def _default_workers() -> int:
    # Every core up to 8: nothing else runs while the corpus is made (training waits for it), and the
    # parent only hashes and writes. On 2 cores: 95 s with one worker, 44 s with two (19,761 files).
    return max(1, min(8, os.cpu_count() or 1))


def extract_docstrings(files: list[Path], show_progress: bool = True, workers: int | None = None) -> Iterator[dict]:
    """{"text", "source"} per distinct docstring of `files`, in file order (whatever `workers` is)."""
    workers = _default_workers() if workers is None else workers
    seen: set[bytes] = set()
    with tqdm(total=len(files), desc="docstrings", unit="file", disable=None if show_progress else True,
              mininterval=1.0) as bar:
        if workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(workers)
            per_file = pool.imap(file_documents, files, chunksize=32)
        else:
            pool, per_file = None, map(file_documents, files)
        try:
            for docs in per_file:
                bar.update()
                for source, text in docs:
                    key = hashlib.blake2b(text.encode(), digest_size=16).digest()
                    if key not in seen:
                        seen.add(key)
                        yield {"text": text, "source": source}
        finally:
            if pool is not None:
                pool.terminate()


def docstring_corpus_path(cache_dir: Path | str, roots: list[Path] | None = None) -> Path:
    """Where the default corpus of this Python is (or will be) cached; cheap (stats files only)."""
    files = python_files(roots if roots is not None else default_source_roots())
    return Path(cache_dir) / f"docstrings-{fingerprint(files)}.jsonl"


def docstring_corpus(cache_dir: Path | str, roots: list[Path] | None = None, show_progress: bool = True,
                     workers: int | None = None) -> Path:
    """The cached .jsonl of the default corpus, extracted first if this Python has none yet."""
    files = python_files(roots if roots is not None else default_source_roots())
    out = Path(cache_dir) / f"docstrings-{fingerprint(files)}.jsonl"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    started, documents = time.perf_counter(), 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in extract_docstrings(files, show_progress, workers):
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
                documents += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("extracted %d docstrings from %d files in %.1fs -> %s",
             documents, len(files), time.perf_counter() - started, out)
    return out
