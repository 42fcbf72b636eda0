"""What a node start runs: a digest of its code and of each model directory it serves, so that a caller can pin
both (`GET /v1/node`, every ledger segment header, and the attestation binding).

Both digests hash a manifest of per-file SHA-256, one line per file, sorted by the path's UTF-8 bytes:

    <SHA-256 of the file, 64 lowercase hex> "  " <path relative to the root, "/"-separated> "\\n"

    model digest = SHA-256("tenzro-model-v1\\0" || manifest)
    code digest  = SHA-256("tenzro-code-v1\\0" || "python " <implementation> " " <version> "\\n"
                           || "source " ("record" | "tree") "\\n" || manifest)

The line is `sha256sum`'s, so anyone recomputes a model's digest with standard tools (names holding a backslash
aside, which `sha256sum` escapes):

    (printf 'tenzro-model-v1\\0'; cd DIR && find -L . -type f ! -path '*/.*' -printf '%P\\0' | LC_ALL=C sort -z \\
        | xargs -0 sha256sum) | sha256sum

Which files count. A model: every regular file under its directory (symbolic links followed, as the loader
follows them), except those under a hidden name (`.git`, `.cache/huggingface`): tool metadata that changes while
the model does not. Not an allow-list of weights, config, tokenizer and templates, because transformers reads more
than any such list names (custom code, processor configs), and a file left out would change what serves without
changing the digest; an extra README only changes the digest, which the operator sees when pinning.

The code: every file of the installed `tenzro` distribution as its RECORD lists it (the native library included)
that lies inside site-packages, and every file found in its top-level packages that RECORD does not list (a
dropped-in extension module would shadow the `.py` beside it), named in `describe()`. Left out: compiled bytecode
(`__pycache__`: it embeds each source's mtime, so it differs between installs of the same wheel; the interpreter
recompiles one whose header does not match its source, but would run a forged one whose header does, so a read-only
image is what keeps it honest), RECORD itself, the installer's INSTALLER, REQUESTED and direct_url.json (they name the
installation, not the code), and the console script outside site-packages (it names the install's interpreter
path). In an editable or source-tree install RECORD lists no source file: the digest then covers every file of the
directories the top-level packages are imported from (the same exclusions), and says so (`source: tree`). The
interpreter enters by implementation and version; its binary and the dependencies are the image's, which the
TEE's launch measurement covers.

Hashing reads every byte, so `start_hashing` runs it on threads started before the model loads: the loader and the
hash read the same files, one of them from the page cache, and the node joins the result after the load, before
anything names the digests.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Literal

CODE_DOMAIN = b"tenzro-code-v1\0"
MODEL_DOMAIN = b"tenzro-model-v1\0"
DISTRIBUTION = "tenzro"
NATIVE_LIBRARY_PREFIX = "node/engine/_cpu_kernels"
INSTALL_RECORDS = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})
"""A dist-info's files that describe the installation rather than the code."""
HASH_THREADS = 4
"""Files hashed at once: SHA-256 releases the interpreter lock, so a sharded model hashes on several cores."""

CodeSource = Literal["record", "tree"]
HOW = {
    "record": "the files the installed distribution's RECORD lists, and any file of its packages RECORD does not",
    "tree": "an editable or source-tree install, whose RECORD lists no source file: every file of the "
            "directories its top-level packages are imported from",
}


class IdentityError(Exception):
    """A code or model digest cannot be computed; the message names the file and what to change."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    path: str
    """Relative to the root hashed, "/"-separated; never holds a newline (the manifest is line-based)."""
    sha256: str  # 64 lowercase hex
    size: int  # bytes


def manifest(files: Iterable[FileDigest]) -> bytes:
    """The manifest lines of `files`, sorted by the path's UTF-8 bytes (what `LC_ALL=C sort` does)."""
    ordered = sorted(files, key=lambda file: file.path.encode())
    return b"".join(f"{file.sha256}  {file.path}\n".encode() for file in ordered)


@dataclass(frozen=True, slots=True)
class CodeIdentity:
    python: str  # "cpython 3.11.9"
    source: CodeSource
    distribution: str  # "tenzro 0.1.0"
    files: tuple[FileDigest, ...]  # sorted by path
    unlisted: tuple[str, ...]
    """Files of the packages that RECORD does not list (always empty for `source == "tree"`); counted all the same."""

    @property
    def native_library(self) -> str | None:
        """The CPU kernels' shared library among the files, when the install built it."""
        return next((file.path for file in self.files if file.path.startswith(NATIVE_LIBRARY_PREFIX)), None)

    def manifest(self) -> bytes:
        return (f"python {self.python}\nsource {self.source}\n".encode()) + manifest(self.files)

    @property
    def digest(self) -> str:
        return hashlib.sha256(CODE_DOMAIN + self.manifest()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"digest": self.digest, "scheme": CODE_DOMAIN[:-1].decode(), "source": self.source,
                "how": HOW[self.source], "python": self.python, "distribution": self.distribution,
                "files": len(self.files), "bytes": sum(file.size for file in self.files),
                "native_library": self.native_library, "unlisted": list(self.unlisted)}


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    model_id: str
    files: tuple[FileDigest, ...]  # sorted by path

    def manifest(self) -> bytes:
        return manifest(self.files)

    @property
    def digest(self) -> str:
        return hashlib.sha256(MODEL_DOMAIN + self.manifest()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"model": self.model_id, "digest": self.digest, "scheme": MODEL_DOMAIN[:-1].decode(),
                "bytes": sum(file.size for file in self.files),
                "files": {file.path: file.sha256 for file in self.files}}


def hash_files(root: Path, paths: Iterable[str], threads: int = HASH_THREADS) -> tuple[FileDigest, ...]:
    """Each relative path's SHA-256 and size, sorted by path; raises IdentityError for one that cannot be read."""
    def one(path: str) -> FileDigest:
        if "\n" in path:
            raise IdentityError(f"{root / path}: a file name holding a newline cannot enter a manifest; rename it")
        try:
            with open(root / path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                return FileDigest(path, hashlib.file_digest(file, "sha256").hexdigest(), size)
        except OSError as exc:
            raise IdentityError(f"cannot hash {root / path}: {exc.strerror or exc}") from exc

    ordered = sorted(set(paths), key=str.encode)
    with ThreadPoolExecutor(max(1, min(threads, len(ordered)))) as pool:
        return tuple(pool.map(one, ordered))


def tree_files(root: Path, skip: Callable[[PurePosixPath], bool] = lambda path: False) -> list[str]:
    """Relative paths of the regular files under `root`, symbolic links followed, hidden names and `skip` left out.

    Raises IdentityError on a directory loop (a link to an ancestor), where a walk would never end."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    for directory, subdirectories, names in os.walk(root, followlinks=True):
        status = os.stat(directory)
        if (status.st_dev, status.st_ino) in seen:
            raise IdentityError(f"{directory} links back to a directory already walked; remove the link")
        seen.add((status.st_dev, status.st_ino))
        relative = PurePosixPath(Path(directory).relative_to(root).as_posix())
        subdirectories[:] = [name for name in subdirectories
                             if not name.startswith(".") and not skip(relative / name)]
        for name in names:
            path = relative / name
            if not name.startswith(".") and not skip(path) and os.path.isfile(Path(directory) / name):
                found.append(str(path))
    return found


def compute_model_identity(model_id: str, directory: Path, threads: int = HASH_THREADS) -> ModelIdentity:
    """The digest of a served model directory (which files count: the module docstring)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise IdentityError(f"{directory} is not a model directory")
    files = hash_files(directory, tree_files(directory), threads)
    if not files:
        raise IdentityError(f"{directory} holds no file to hash")
    return ModelIdentity(model_id, files)


def _bytecode(path: PurePosixPath) -> bool:
    return "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo")


def python_version() -> str:
    return f"{sys.implementation.name} {platform.python_version()}"


def top_level_packages(distribution: metadata.Distribution) -> list[str]:
    listed = distribution.read_text("top_level.txt")
    if listed is None:
        raise IdentityError(f"the {distribution.metadata['Name']} distribution names no top-level packages "
                            "(top_level.txt); reinstall it")
    return sorted(name for name in listed.split() if name)


def imported_package_dirs(names: Iterable[str]) -> dict[str, Path]:
    """Where each top-level package is imported from in this process (the code that runs)."""
    import importlib.util

    dirs = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if len(locations) != 1:
            raise IdentityError(f"package {name!r} is not importable from one directory ({locations})")
        dirs[name] = Path(locations[0])
    return dirs


def compute_code_identity(distribution: metadata.Distribution | None = None,
                          package_dirs: Mapping[str, Path] | None = None,
                          threads: int = HASH_THREADS) -> CodeIdentity:
    """The digest of the code this process runs: the `tenzro` distribution and the interpreter's version.

    `distribution` and `package_dirs` (top-level package -> the directory it is imported from) default to what
    this process finds; tests pass their own. RECORD is used when it lists the very package directories the code
    is imported from; otherwise (an editable install, a source tree ahead on sys.path) the directories are hashed.
    """
    distribution = distribution or metadata.distribution(DISTRIBUTION)
    packages = top_level_packages(distribution)
    package_dirs = dict(package_dirs) if package_dirs is not None else imported_package_dirs(packages)
    named = f"{distribution.metadata['Name']} {distribution.version}"
    site = Path(str(distribution.locate_file("")))
    listed = _record_files(distribution)
    if listed is not None and all(
            f"{name}/__init__.py" in listed and _same_dir(site / name, package_dirs[name]) for name in packages):
        walked = {f"{name}/{path}" for name in packages
                  for path in tree_files(package_dirs[name], _bytecode)}
        unlisted = tuple(sorted(walked - listed, key=str.encode))
        return CodeIdentity(python_version(), "record", named, hash_files(site, listed | walked, threads), unlisted)
    files: list[FileDigest] = []
    for name in packages:
        here = hash_files(package_dirs[name], tree_files(package_dirs[name], _bytecode), threads)
        files.extend(FileDigest(f"{name}/{file.path}", file.sha256, file.size) for file in here)
    return CodeIdentity(python_version(), "tree", named, tuple(sorted(files, key=lambda f: f.path.encode())), ())


def _record_files(distribution: metadata.Distribution) -> set[str] | None:
    """RECORD's files inside site-packages that are code (see the module docstring); None without a RECORD."""
    if distribution.read_text("RECORD") is None or distribution.files is None:
        return None
    kept = set()
    for entry in distribution.files:
        path = PurePosixPath(entry.as_posix())
        if path.parts[0] == ".." or path.is_absolute() or _bytecode(path):
            continue
        if path.parent.name.endswith(".dist-info") and path.name in INSTALL_RECORDS:
            continue
        kept.add(str(path))
    return kept


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve(strict=True) == b.resolve(strict=True)
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class ServedIdentity:
    """The code and model digests of a node start, and how long hashing them took."""

    code: CodeIdentity
    models: tuple[ModelIdentity, ...]
    code_s: float
    model_s: float

    def model_digests(self) -> dict[str, str]:
        """Model id -> digest, as a ledger segment's header names them."""
        return {model.model_id: model.digest for model in self.models}

    def describe(self) -> dict[str, Any]:
        """For `GET /v1/node`: the code's and each model's digest and what it covers."""
        return {"code": self.code.describe(), "models": [model.describe() for model in self.models]}


class PendingIdentity:
    """Code and model hashing on a thread of its own, started before the model loads; `result` joins it."""

    def __init__(self, models: Mapping[str, Path], threads: int = HASH_THREADS) -> None:
        self._models = dict(models)
        self._threads = threads
        self._result: ServedIdentity | None = None
        self._error: BaseException | None = None
        self.waited_s = 0.0
        """How long `result` blocked: what hashing added to the start beyond the work it overlapped."""
        self._thread = threading.Thread(target=self._run, name="identity-hashing", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            started = time.perf_counter()
            code = compute_code_identity(threads=self._threads)
            hashed_code = time.perf_counter()
            models = tuple(compute_model_identity(model_id, path, self._threads)
                           for model_id, path in self._models.items())
            self._result = ServedIdentity(code, models, hashed_code - started, time.perf_counter() - hashed_code)
        except BaseException as exc:  # re-raised by `result`, on the thread that needs the digests
            self._error = exc

    def result(self) -> ServedIdentity:
        """Wait for the digests; raises what hashing raised (IdentityError for a file that cannot be read)."""
        waiting = time.perf_counter()
        self._thread.join()
        self.waited_s += time.perf_counter() - waiting
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def start_hashing(models: Mapping[str, Path], threads: int = HASH_THREADS) -> PendingIdentity:
    """Begin hashing the code and each served model directory (model id -> directory) in the background."""
    return PendingIdentity(models, threads)
