"""The kit loader's checks on small hand-made archives: unsafe names, links, a bad manifest, a bad
--expect; each refused before anything is extracted outside the staging folder."""
import hashlib
import io
import tarfile

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


def refused(tmp_path, kit, said, expect=None):
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    with pytest.raises(kit_load.Refused) as e:
        kit_load.verify(kit, staging, expect, log=lambda m: None)
    assert said in str(e.value), str(e.value)
    assert not (tmp_path / "evil").exists()


def test_a_good_small_kit_passes_and_is_extracted_only_into_staging(tmp_path):
    kit = make(tmp_path / "k.kit", {"kit.json": b'{"variant": "cpu", "revision": "abc"}', "a/b.txt": b"x"})
    staging = tmp_path / "staging"
    staging.mkdir()
    assert kit_load.verify(kit, staging, hashlib.sha256(kit.read_bytes()).hexdigest(), log=lambda m: None) == {
        "variant": "cpu", "revision": "abc"}
    assert (staging / "a" / "b.txt").read_bytes() == b"x"


def test_unsafe_names_links_and_bad_manifests_are_refused(tmp_path):
    refused(tmp_path, make(tmp_path / "1.kit", {"../evil": b"x"}), "unsafe path '../evil'")
    refused(tmp_path, make(tmp_path / "2.kit", {"/evil": b"x"}), "unsafe path '/evil'")
    link = tarfile.TarInfo("lnk")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    refused(tmp_path, make(tmp_path / "3.kit", {"a": b"x"}, extra=link), "'lnk', which is not a regular file")
    refused(tmp_path, make(tmp_path / "4.kit", {"a": b"x"}, manifest="nonsense\n"), "is not a sha256 list")
    refused(tmp_path, make(tmp_path / "5.kit", {"a": b"x"}), "not a sha256", expect="xyz")
    refused(tmp_path, make(tmp_path / "6.kit", {"a": b"x"}), "not the expected " + "0" * 64, expect="0" * 64)
