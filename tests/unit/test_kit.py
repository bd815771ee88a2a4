"""The kit loader's checks on small hand-made archives: unsafe names, links, a bad manifest, a bad
--expect; each refused before anything is extracted outside the staging folder."""
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from fleetbox.ship import kit_load


def make(path, files, extra=None, manifest=None):
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if extra:
            tar.addfile(extra)
        text = manifest if manifest is not None else "".join(
            f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items())
        info = tarfile.TarInfo(kit_load.MANIFEST)
        info.size = len(text.encode())
        tar.addfile(info, io.BytesIO(text.encode()))
    return path


def refused(tmp_path, kit, said, expect=None, outside=()):
    """Refused with `said`, and nothing written where a member's name points: beside the staging folder
    (`../evil`) or at an absolute path (`outside`)."""
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    with pytest.raises(kit_load.Refused) as e:
        kit_load.verify(kit, staging, expect, log=lambda m: None)
    assert said in str(e.value), str(e.value)
    assert not (tmp_path / "evil").exists() and not any(Path(p).exists() for p in outside)


FILES = {"source/fleetbox-src.tar": b"s", "lock/cpu.lock": b"l", "host-wheels/pip.whl": b"p",
         "board-wheels/visualdl.whl": b"v", "wheelhouse/a.whl": b"w", "base/base.tar": b"b"}


def info(**change):
    parts = {"source": {"files": ["source/fleetbox-src.tar"], "bytes": 1},
             "lock": {"files": ["lock/cpu.lock"], "place": "images/locks/cpu.lock", "bytes": 1},
             "host-wheels": {"files": ["host-wheels/pip.whl"], "bytes": 1},
             "board-wheels": {"files": ["board-wheels/visualdl.whl"], "bytes": 1},
             "wheelhouse": {"files": ["wheelhouse/a.whl"], "bytes": 1},
             "base": {"files": ["base/base.tar"], "tags": ["fleetbox/base:bookworm-965f49151f4a"], "bytes": 1}}
    out = {"variant": "cpu", "revision": "a" * 40, "python": "3.11", "machine": "x86_64", "glibc": "2.28",
           "parts": parts, "sizes": {n: len(d) for n, d in FILES.items()}}
    for path, value in change.items():   # "parts.lock.place" -> parts["lock"]["place"]
        *head, last = path.split(".")
        d = out
        for k in head:
            d = d[k]
        if value is DROP:
            del d[last]
        else:
            d[last] = value
    return json.dumps(out).encode()


DROP = object()   # info(): leave the key out


def test_a_good_small_kit_passes_and_is_extracted_only_into_staging(tmp_path):
    kit = make(tmp_path / "k.kit", {"kit.json": info(), **FILES})
    staging = tmp_path / "staging"
    staging.mkdir()
    got = kit_load.verify(kit, staging, hashlib.sha256(kit.read_bytes()).hexdigest(), log=lambda m: None)
    assert got["variant"] == "cpu" and (staging / "wheelhouse" / "a.whl").read_bytes() == b"w"


@pytest.mark.parametrize("path,value", [
    ("parts.lock.place", "/tmp/evil.lock"), ("parts.lock.place", "images/../../evil.lock"),
    ("parts.lock.place", "tasks.py"), ("variant", "../../x"), ("parts.base.files", ["/etc/passwd"]),
    ("parts.base.tags", ["-f"]), ("revision", "HEAD; rm -rf /"), ("glibc", "x"),
    # each ended in a traceback after "verified"
    ("parts.base.tags", DROP), ("parts.base.tags", []), ("parts.base.tags", "fleetbox/base:x"),
    ("parts.base.bytes", "12"), ("parts.wheelhouse.bytes", DROP), ("parts.base.bytes", -1),
    ("sizes", DROP), ("sizes", {n: 1 for n in FILES if n != "lock/cpu.lock"}), ("sizes.extra", 1),
    ("sizes", {**{n: 1 for n in FILES}, "base/base.tar": "1"}), ("sizes", {n: -1 for n in FILES}),
    # an image part's receipts: only their own names, only among the part's files
    ("parts.base.receipts", ["../../evil.sbom.json"]), ("parts.base.receipts", [f"inputs-{'fe' * 32}.sbom.json"]),
    ("parts.base.receipts", f"inputs-{'fe' * 32}.sbom.json"),
])
def test_a_kit_json_whose_values_would_reach_outside_is_refused(tmp_path, path, value):
    refused(tmp_path, make(tmp_path / "k.kit", {"kit.json": info(**{path: value}), **FILES}),
            "kit.json is not one fleetbox makes")


def test_a_file_and_a_folder_of_one_name_is_refused(tmp_path):
    refused(tmp_path, make(tmp_path / "k.kit", {"a": b"x", "a/b": b"y"}), "a file and a folder of the same name")


def test_unsafe_names_links_and_bad_manifests_are_refused(tmp_path):
    refused(tmp_path, make(tmp_path / "1.kit", {"../evil": b"x"}), "unsafe path '../evil'")
    absolute = f"{tmp_path}/abs/evil"   # where an absolute member would land, not under the staging folder
    refused(tmp_path, make(tmp_path / "2.kit", {absolute: b"x"}), f"unsafe path '{absolute}'", outside=[absolute])
    link = tarfile.TarInfo("lnk")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    refused(tmp_path, make(tmp_path / "3.kit", {"a": b"x"}, extra=link), "'lnk', which is not a regular file")
    refused(tmp_path, make(tmp_path / "4.kit", {"a": b"x"}, manifest="nonsense\n"), "is not a sha256 list")
    refused(tmp_path, make(tmp_path / "5.kit", {"a": b"x"}), "not a sha256", expect="xyz")
    refused(tmp_path, make(tmp_path / "6.kit", {"a": b"x"}), "not the expected " + "0" * 64, expect="0" * 64)


def test_make_reuses_unchanged_parts_and_remakes_only_a_changed_one(tmp_path, monkeypatch):
    from fleetbox import engine
    from fleetbox.image import matrix
    from fleetbox.ship import kit
    keys, made = {"loader": "1", "source": "1", "base": "1"}, []

    def maker(name, file):
        def make_part(d):
            made.append(name)
            (d / file).write_text(name + keys[name])
        return make_part

    monkeypatch.setattr(kit, "_parts", lambda *a: [
        kit.Part("loader", keys["loader"], maker("loader", "kit-load.py")),
        kit.Part("source", keys["source"], maker("source", "fleetbox-src.tar"), revision="a" * 40),
        kit.Part("base", keys["base"], maker("base", "base.tar"), tags=["fleetbox/base:x"])])
    monkeypatch.setattr(engine, "client", lambda: None)
    out, v = tmp_path / "k.kit", matrix.load().get("cpu")
    first = kit.make(v, out, log=lambda m: None)
    assert made == ["loader", "source", "base"] and first["written"]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == first["sha256"]
    src = (tmp_path / "k.kit.parts" / "source" / "fleetbox-src.tar").stat()
    made.clear()
    again = kit.make(v, out, log=lambda m: None)
    assert made == [] and not again["written"] and again["sha256"] == first["sha256"]
    assert [r[3] for r in again["parts"]] == ["reused"] * 3
    keys["base"] = "2"   # one input changed: that part alone is made again, and the kit with it
    third = kit.make(v, out, log=lambda m: None)
    assert made == ["base"] and third["written"] and third["sha256"] != first["sha256"]
    assert (tmp_path / "k.kit.parts" / "source" / "fleetbox-src.tar").stat().st_mtime_ns == src.st_mtime_ns
    with tarfile.open(out) as tar:   # fixed metadata: owner 0, time 0
        assert {(m.uid, m.mtime, m.mode) for m in tar.getmembers()} == {(0, 0, 0o644)}
        assert tar.extractfile("base/base.tar").read() == b"base2"
    made.clear()   # a part's file changed behind our back: made again, not trusted by its key
    (tmp_path / "k.kit.parts" / "source" / "fleetbox-src.tar").write_text("tampered")
    kit.make(v, out, log=lambda m: None)
    assert made == ["source"]


def test_with_the_manifest_first_a_changed_file_is_refused_before_the_rest_is_read(tmp_path):
    files = {"a": b"1", "b": b"2", "c": b"3"}
    text = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items()).encode()
    with tarfile.open(tmp_path / "k.kit", "w") as tar:
        for name, data in [(kit_load.MANIFEST, text), ("a", b"1"), ("b", b"changed"), ("c", b"3")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refused(tmp_path, tmp_path / "k.kit", "kit part b does not match the kit's manifest")
    assert not (tmp_path / "staging" / "c").exists()


def sparse_tar(tmp_path, out, name="big"):
    """A real GNU sparse archive: 1 GiB of holes in a few KiB."""
    import subprocess
    (tmp_path / "src").mkdir(exist_ok=True)
    with open(tmp_path / "src" / name, "wb") as f:
        f.truncate(1 << 30)
    subprocess.run(["tar", "-S", "-cf", str(out), "-C", str(tmp_path / "src"), name], check=True)
    assert out.stat().st_size < 64 << 10
    return out


def test_a_sparse_member_is_refused_before_it_is_written(tmp_path):
    kit = sparse_tar(tmp_path, tmp_path / "sparse.kit")
    refused(tmp_path, kit, "the kit holds 'big', which is not a regular file")
    assert not (tmp_path / "staging" / "big").exists()


def test_a_sparse_file_in_the_kits_source_is_refused_before_it_is_written(tmp_path):
    """The source is a tar inside the kit: its members are held to the same rule as the kit's own."""
    files = {**FILES, "source/fleetbox-src.tar": sparse_tar(tmp_path, tmp_path / "src.tar").read_bytes()}
    sizes = {n: len(d) for n, d in files.items()}
    kit_json = json.loads(info(**{"parts.source.bytes": sizes["source/fleetbox-src.tar"]}))
    kit_json["sizes"] = sizes
    kit = make(tmp_path / "k.kit", {"kit.json": json.dumps(kit_json).encode(), **files})
    with pytest.raises(kit_load.Refused, match="the kit's source holds 'big', which is not a regular file or folder"):
        kit_load.load(kit, tmp_path / "dest", no_expect=True, skip_images=True, log=lambda m: None)
    assert not (tmp_path / "dest").exists() and not list(tmp_path.glob(".dest*"))


def test_a_member_claiming_more_than_the_kit_holds_is_refused_before_it_is_written(tmp_path):
    kit = tmp_path / "liar.kit"
    with tarfile.open(kit, "w") as tar:
        info = tarfile.TarInfo("huge.bin")
        info.size = 10 ** 9
        tar.addfile(info)   # the header only: what follows is not 1 GB
    refused(tmp_path, kit, "the kit's huge.bin says it holds 1000000000 bytes, more than the kit's")
    assert not (tmp_path / "staging" / "huge.bin").exists()


def test_a_member_the_manifest_does_not_list_is_refused_before_it_is_written(tmp_path):
    kit = tmp_path / "extra.kit"
    with tarfile.open(kit, "w") as tar:
        text = f"{hashlib.sha256(b'a').hexdigest()}  a\n".encode()
        for name, data in ((kit_load.MANIFEST, text), ("a", b"a"), ("unlisted.bin", b"x" * 4096)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refused(tmp_path, kit, "holds unlisted.bin, which its manifest does not list")
    assert not (tmp_path / "staging" / "unlisted.bin").exists()


def ordered_kit(path, members, listed=None, sizes=None):
    """A kit in our order: the manifest, kit.json (with `sizes`), then the members as given; the manifest lists
    `listed` (default: the members as they are)."""
    listed = dict(members if listed is None else listed)
    kit_json = json.dumps({"sizes": {n: len(d) for n, d in listed.items()} if sizes is None else sizes}).encode()
    text = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n"
                   for n, d in {**listed, kit_load.KIT_JSON: kit_json}.items()).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in [(kit_load.MANIFEST, text), (kit_load.KIT_JSON, kit_json), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_member_larger_than_kit_json_declares_is_refused_before_it_is_written(tmp_path):
    # the manifest lists 1 byte, kit.json declares 1 byte; the archive's member is 64 KiB
    kit = ordered_kit(tmp_path / "k.kit", {"a": b"1", "big.bin": b"x" * (64 << 10)},
                      listed={"a": b"1", "big.bin": b"x"})
    refused(tmp_path, kit, "the kit's big.bin says it holds 65536 bytes; its kit.json declares 1")
    assert (tmp_path / "staging" / "a").exists() and not (tmp_path / "staging" / "big.bin").exists()


def test_a_kit_json_without_sizes_is_refused_before_the_parts_are_written(tmp_path):
    kit = ordered_kit(tmp_path / "k.kit", {"a": b"1"}, sizes="none")
    refused(tmp_path, kit, "kit.json is not one fleetbox makes (no size for each file)")
    assert not (tmp_path / "staging" / "a").exists()


def test_a_large_member_before_kit_json_is_refused_before_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(kit_load, "HEAD_LIMIT", 1000)
    refused(tmp_path, make(tmp_path / "k.kit", {"early.bin": b"x" * 1001}),
            "the kit's early.bin (1001 bytes) comes before its kit.json declares the sizes")
    assert not (tmp_path / "staging" / "early.bin").exists()


def test_an_image_parts_receipts_are_checked_then_placed_in_the_sites_receipts_folder(tmp_path):
    held = [f"image-{'ab' * 32}.provenance.json", f"image-{'ab' * 32}.provenance.json.sig",
            f"inputs-{'fe' * 32}.sbom.json"]
    files = {**FILES, "image/image.tar": b"i", **{f"image/{n}": n.encode() for n in held}}
    text = json.loads(info())
    text["parts"]["image"] = {"files": sorted(n for n in files if n.startswith("image/")), "bytes": 1,
                              "tags": ["fleetbox/paddle:cpu-0123456789ab"], "receipts": held}
    text["sizes"] = {n: len(d) for n, d in files.items()}
    kit = make(tmp_path / "k.kit", {"kit.json": json.dumps(text).encode(), **files})
    staging = tmp_path / "staging"
    staging.mkdir()
    got = kit_load.verify(kit, staging, None, log=lambda m: None)
    src = tmp_path / "site" / "fleetbox"
    src.mkdir(parents=True)
    assert kit_load.place_receipts(got, staging, src) == held
    assert sorted(p.name for p in (src / "receipts").iterdir()) == held
    assert (src / "receipts" / held[2]).read_bytes() == held[2].encode()


def test_the_loader_asks_the_fleetbox_it_installed_who_signed_the_loaded_images_statement(tmp_path, monkeypatch):
    """kit --load --trusted-keys: the rules are receipts.py's, run by the fleetbox the kit just installed (here,
    this one): the statement must be of the image the kit loaded, and signed by a key the site trusts."""
    import subprocess
    import sys

    from fleetbox.image import receipts
    from tests.unit.test_receipts import inputs, statement
    src = tmp_path / "fleetbox"
    mine, other = "sha256:" + "ab" * 32, "sha256:" + "cd" * 32
    monkeypatch.setenv("FLEETBOX_RECEIPTS", str(src / "receipts"))
    for name in ("site", "other"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    with pytest.raises(kit_load.Refused, match="the kit carries no provenance statement of the image it loaded"):
        kit_load.signed_by(Path(sys.executable), src, tmp_path / "site.pub", mine)
    receipts.keep("f" * 64, "{}", statement(*inputs("cpu"), image_id=mine), mine)
    receipts.sign(receipts.provenance_path(mine), tmp_path / "site")
    assert kit_load.signed_by(Path(sys.executable), src, tmp_path / "site.pub", mine).startswith("fleetbox (SHA256:")
    with pytest.raises(kit_load.Refused, match=r"^--trusted-keys: image-(ab)+.provenance.json.sig is not by a key of "
                                               r".*other.pub$"):
        kit_load.signed_by(Path(sys.executable), src, tmp_path / "other.pub", mine)
    # a statement of another image, signed, carried under the loaded image's name: not the loaded image's
    receipts.keep("f" * 64, "{}", statement(*inputs("cpu"), image_id=other), mine)
    receipts.sign(receipts.provenance_path(mine), tmp_path / "site")
    with pytest.raises(kit_load.Refused, match=r"provenance.json: its subject is not this image \(sha256:(ab){6}\)$"):
        kit_load.signed_by(Path(sys.executable), src, tmp_path / "site.pub", mine)
