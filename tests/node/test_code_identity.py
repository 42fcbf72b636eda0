"""Code and model digests: the manifest encoding, which files count, and hashing beside the model load."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

from node.code_identity import (
    CODE_DOMAIN,
    MODEL_DOMAIN,
    FileDigest,
    IdentityError,
    compute_code_identity,
    compute_model_identity,
    manifest,
    start_hashing,
)
from node.engine.cpu_kernels import library_path

PYTHON = f"{sys.implementation.name} {platform.python_version()}"
README = Path(__file__).resolve().parents[2] / "README.md"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


MODEL = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x00weights" * 1000,
         "tokenizer.json": b"{}", "chat_template.jinja": b"{{ messages }}", "generation_config.json": b"{}"}


def test_a_model_digest_is_the_documented_manifest_under_its_domain(tmp_path: Path) -> None:
    identity = compute_model_identity("m", write(tmp_path, MODEL))
    lines = "".join(f"{sha(MODEL[name])}  {name}\n" for name in sorted(MODEL))
    assert identity.manifest() == lines.encode()
    assert identity.digest == sha(MODEL_DOMAIN + lines.encode())
    assert identity.describe() == {"model": "m", "digest": identity.digest, "scheme": "tenzro-model-v1",
                                   "bytes": sum(map(len, MODEL.values())),
                                   "files": {name: sha(MODEL[name]) for name in sorted(MODEL)}}


def test_the_digest_does_not_depend_on_the_order_files_were_written_or_listed(tmp_path: Path) -> None:
    forward = compute_model_identity("m", write(tmp_path / "a", MODEL))
    backward = compute_model_identity("m", write(tmp_path / "b", dict(reversed(MODEL.items()))))
    assert forward.digest == backward.digest
    assert manifest(reversed(forward.files)) == manifest(forward.files)


def test_paths_sort_by_their_utf8_bytes_as_c_locale_sort_does() -> None:
    files = [FileDigest(path, "0" * 64, 0) for path in ("é", "a", "_", "B", "a/b", "a.b")]
    assert [line.split("  ")[1] for line in manifest(files).decode().splitlines()] == [
        "B", "_", "a", "a.b", "a/b", "é"]


def test_a_changed_byte_changes_the_digest(tmp_path: Path) -> None:
    before = compute_model_identity("m", write(tmp_path, MODEL)).digest
    weights = bytearray(MODEL["model.safetensors"])
    weights[4321] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(weights))
    assert compute_model_identity("m", tmp_path).digest != before


def test_a_renamed_file_changes_the_digest(tmp_path: Path) -> None:
    before = compute_model_identity("m", write(tmp_path, MODEL)).digest
    (tmp_path / "chat_template.jinja").rename(tmp_path / "chat_template.txt")
    assert compute_model_identity("m", tmp_path).digest != before


def test_every_file_counts_except_hidden_tool_metadata(tmp_path: Path) -> None:
    base = compute_model_identity("m", write(tmp_path, MODEL)).digest
    write(tmp_path, {".gitattributes": b"*.safetensors lfs", ".git/HEAD": b"ref: main",
                     ".cache/huggingface/download/model.safetensors.metadata": b"etag", "sub/.lock": b""})
    assert compute_model_identity("m", tmp_path).digest == base
    write(tmp_path, {"README.md": b"a model"})
    with_readme = compute_model_identity("m", tmp_path)
    assert with_readme.digest != base and "README.md" in with_readme.describe()["files"]
    write(tmp_path, {"custom/modeling.py": b"class Model: ..."})
    assert "custom/modeling.py" in compute_model_identity("m", tmp_path).describe()["files"]


def test_a_linked_file_is_hashed_by_its_content_under_its_own_name(tmp_path: Path) -> None:
    """As in a Hugging Face cache snapshot, whose files link to blobs."""
    blobs = write(tmp_path / "blobs", {"b1": MODEL["model.safetensors"]})
    model = write(tmp_path / "snapshot", {name: data for name, data in MODEL.items() if name != "model.safetensors"})
    (model / "model.safetensors").symlink_to(blobs / "b1")
    copy = write(tmp_path / "copy", MODEL)
    assert compute_model_identity("m", model).digest == compute_model_identity("m", copy).digest


def test_names_a_manifest_cannot_hold_and_directory_loops_are_refused(tmp_path: Path) -> None:
    write(tmp_path / "a", {**MODEL, "bad\nname": b""})
    with pytest.raises(IdentityError, match="a file name holding a newline cannot enter a manifest"):
        compute_model_identity("m", tmp_path / "a")
    write(tmp_path / "b", MODEL)
    (tmp_path / "b" / "loop").symlink_to(tmp_path / "b")
    with pytest.raises(IdentityError, match="links back to a directory already walked"):
        compute_model_identity("m", tmp_path / "b")
    with pytest.raises(IdentityError, match="is not a model directory"):
        compute_model_identity("m", tmp_path / "missing")


def site_packages(root: Path, record: list[str]) -> PathDistribution:
    """A site-packages directory holding package `pkg` and a `tenzro` dist-info whose RECORD lists `record`."""
    write(root, {"pkg/__init__.py": b"", "pkg/mod.py": b"x = 1\n", "pkg/_cpu.so": b"\x7fELF",
                 "pkg/__pycache__/mod.cpython-311.pyc": b"compiled", "pkg/data/policy.yaml": b"a: 1\n"})
    info = write(root / "tenzro-0.1.0.dist-info", {
        "METADATA": b"Metadata-Version: 2.1\nName: tenzro\nVersion: 0.1.0\n", "top_level.txt": b"pkg\n",
        "INSTALLER": b"pip\n", "REQUESTED": b"", "direct_url.json": b'{"url": "file:///somewhere"}'})
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in record))
    return PathDistribution(info)


WHEEL_RECORD = ["pkg/__init__.py", "pkg/mod.py", "pkg/_cpu.so", "pkg/__pycache__/mod.cpython-311.pyc",
                "pkg/data/policy.yaml", "tenzro-0.1.0.dist-info/METADATA", "tenzro-0.1.0.dist-info/top_level.txt",
                "tenzro-0.1.0.dist-info/INSTALLER", "tenzro-0.1.0.dist-info/REQUESTED",
                "tenzro-0.1.0.dist-info/direct_url.json", "tenzro-0.1.0.dist-info/RECORD", "../../../bin/tenzro"]


def test_an_installed_distribution_is_hashed_as_its_record_lists_it(tmp_path: Path) -> None:
    site = tmp_path / "site"
    identity = compute_code_identity(site_packages(site, WHEEL_RECORD), {"pkg": site / "pkg"})
    counted = ["pkg/__init__.py", "pkg/_cpu.so", "pkg/data/policy.yaml", "pkg/mod.py",
               "tenzro-0.1.0.dist-info/METADATA", "tenzro-0.1.0.dist-info/top_level.txt"]
    assert (identity.source, identity.unlisted, [file.path for file in identity.files]) == ("record", (), counted)
    lines = "".join(f"{sha((site / path).read_bytes())}  {path}\n" for path in counted)
    assert identity.digest == sha(CODE_DOMAIN + f"python {PYTHON}\nsource record\n".encode() + lines.encode())
    assert identity.describe()["distribution"] == "tenzro 0.1.0"


def test_a_file_dropped_into_an_installed_package_counts_and_is_named(tmp_path: Path) -> None:
    """An extension module beside a `.py` shadows it on import, so a file RECORD does not list must count."""
    site = tmp_path / "site"
    distribution = site_packages(site, WHEEL_RECORD)
    before = compute_code_identity(distribution, {"pkg": site / "pkg"}).digest
    write(site, {"pkg/mod.cpython-311-x86_64-linux-gnu.so": b"\x7fELF other"})
    after = compute_code_identity(distribution, {"pkg": site / "pkg"})
    assert after.unlisted == ("pkg/mod.cpython-311-x86_64-linux-gnu.so",) and after.digest != before
    assert after.describe()["unlisted"] == ["pkg/mod.cpython-311-x86_64-linux-gnu.so"]


def test_a_file_record_lists_but_the_install_lacks_is_an_error(tmp_path: Path) -> None:
    site = tmp_path / "site"
    distribution = site_packages(site, WHEEL_RECORD)
    (site / "pkg" / "mod.py").unlink()
    with pytest.raises(IdentityError, match=r"cannot hash .*pkg/mod.py: No such file or directory"):
        compute_code_identity(distribution, {"pkg": site / "pkg"})


def test_an_editable_install_hashes_the_package_directories_and_says_so(tmp_path: Path) -> None:
    """Its RECORD lists the finder and path file, no source; the source tree is hashed instead."""
    site = tmp_path / "site"
    distribution = site_packages(site, ["__editable__.tenzro-0.1.0.pth", "tenzro-0.1.0.dist-info/METADATA"])
    source = write(tmp_path / "source", {"pkg/__init__.py": b"", "pkg/mod.py": b"x = 2\n",
                                         "pkg/__pycache__/mod.cpython-311.pyc": b"compiled", "pkg/.orig": b""})
    identity = compute_code_identity(distribution, {"pkg": source / "pkg"})
    assert (identity.source, [file.path for file in identity.files]) == ("tree", ["pkg/__init__.py", "pkg/mod.py"])
    lines = f"{sha(b'')}  pkg/__init__.py\n{sha(b'x = 2' + bytes([10]))}  pkg/mod.py\n"
    assert identity.digest == sha(CODE_DOMAIN + f"python {PYTHON}\nsource tree\n".encode() + lines.encode())
    assert "editable" in identity.describe()["how"]


def test_a_source_tree_ahead_of_the_install_on_the_path_is_what_is_hashed(tmp_path: Path) -> None:
    """RECORD describes site-packages, but the code imported comes from elsewhere: that code is what runs."""
    site = tmp_path / "site"
    distribution = site_packages(site, WHEEL_RECORD)
    source = write(tmp_path / "source", {"pkg/__init__.py": b"", "pkg/mod.py": b"x = 3\n"})
    identity = compute_code_identity(distribution, {"pkg": source / "pkg"})
    assert identity.source == "tree" and [file.path for file in identity.files] == ["pkg/__init__.py", "pkg/mod.py"]


def test_this_process_runs_an_editable_install_with_its_native_library_when_built() -> None:
    identity = compute_code_identity()
    paths = {file.path for file in identity.files}
    assert identity.source == "tree" and identity.python == PYTHON
    assert {"node/code_identity.py", "metering/segment.py", "policies/pricing.yaml"} <= paths
    assert not any("__pycache__" in path or path.endswith(".pyc") for path in paths)
    built = library_path()
    assert identity.native_library == (None if built is None else f"node/engine/{built.name}")


def test_hashing_beside_the_load_gives_the_same_digests(tmp_path: Path) -> None:
    model = write(tmp_path / "model", MODEL)
    pending = start_hashing({"m": model})
    served = pending.result()
    assert served.code.digest == compute_code_identity().digest
    assert served.models == (compute_model_identity("m", model),)
    assert served.model_digests() == {"m": compute_model_identity("m", model).digest}
    assert served.describe() == {"code": served.code.describe(), "models": [served.models[0].describe()]}
    assert served.code_s >= 0 and served.model_s >= 0 and pending.waited_s >= 0


def test_a_hashing_failure_surfaces_where_the_digests_are_needed(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "not-a-dir")
    pending = start_hashing({"m": tmp_path / "not-a-dir"})
    with pytest.raises(IdentityError, match="is not a model directory"):
        pending.result()


def test_the_readme_recipe_recomputes_a_model_digest_with_standard_tools(tmp_path: Path) -> None:
    model = write(tmp_path / "model", {**MODEL, "sub/extra.json": b"{}", ".git/HEAD": b"ref", "B upper": b"b"})
    found = re.search(r"\n    (\(printf 'tenzro-model-v1.*?sha256sum)\n\n", README.read_text(), re.S)
    assert found is not None, "the README's model digest recipe is not where this test looks"
    command = found.group(1).replace("MODEL_DIR", shlex.quote(str(model)))
    printed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True).stdout
    assert printed.split()[0] == compute_model_identity("m", model).digest
