"""An image's receipts (image/receipts.py): the CycloneDX SBOM from the lock, the wheelhouse and the base's dpkg
database (tests/recorded/dpkg/status: four stanzas of the bookworm base's, and one package removed), held to
CycloneDX's own schema; the in-toto statement held to in-toto's library."""
import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest

from fleetbox.errors import UserError
from fleetbox.image import locks, matrix, receipts

STATUS = (Path(__file__).parent.parent / "recorded" / "dpkg" / "status").read_text()


def inputs(name="cu118-pypi"):
    v = matrix.load().get(name)
    _, entries = locks.read(v)
    wheels = {f"{e.name.replace('-', '_')}-{e.version}-py3-none-any.whl": e.hashes[-1] for e in entries}
    return v, entries, wheels


def test_the_installed_debian_packages_are_read_from_dpkgs_database():
    debs = receipts.debian_packages(STATUS)
    assert [(d.name, d.arch, d.source) for d in debs] == [
        ("adduser", "all", ""), ("libc6", "amd64", "glibc"), ("python3.11-minimal", "amd64", "python3.11"),
        ("zlib1g", "amd64", "zlib")]   # the removed one, with only its configuration left, is not installed
    assert debs[1].version.startswith("2.36-9")


def test_the_sbom_is_valid_cyclonedx_and_holds_every_locked_package_with_its_wheels_hash():
    v, entries, wheels = inputs()
    text = receipts.sbom(v, "0123456789ab" * 5 + "0123", entries, wheels,
                         receipts.debian_packages(STATUS), "http://deb.debian.org/debian", "bookworm",
                         "6.1,7.0 measured")
    doc = receipts.check_sbom(text)   # CycloneDX 1.6's schema
    comps = {c["bom-ref"]: c for c in doc["components"]}
    for e in entries:
        c = comps[f"pypi:{e.name}"]
        assert (c["version"], c["hashes"]) == (e.version, [{"alg": "SHA-256", "content": e.hashes[-1]}])
        assert c["purl"].startswith(f"pkg:pypi/{e.name}@{e.version}")
    props = {c["name"]: {p["name"]: p["value"] for p in c.get("properties", [])} for c in doc["components"]}
    assert props["paddlepaddle-gpu"]["fleetbox:gpu-architectures"] == "6.1,7.0 measured"
    gpu_libraries = {n for n, p in props.items() if p.get("fleetbox:gpu-library") == "true"}
    assert gpu_libraries == {n.split("==")[0] for n in v.libraries} and len(gpu_libraries) > 5
    libc = comps["deb:libc6:amd64"]
    assert libc["purl"].startswith("pkg:deb/debian/libc6@2.36-9") and "arch=amd64" in libc["purl"] and \
        "distro=debian-bookworm" in libc["purl"]
    assert libc["externalReferences"] == [{"type": "distribution", "url": "http://deb.debian.org/debian"}]
    assert (doc["metadata"]["component"]["name"], doc["metadata"]["component"]["version"]) == \
        ("fleetbox-paddle-cu118-pypi", "0123456789ab")   # by its inputs, not by what the image is called
    assert receipts.expected(doc)["python"] == {e.name: e.version for e in entries}
    assert receipts.expected(doc)["deb"]["zlib1g"].startswith("1:1.2.13")
    # the same inputs, the same bytes (no time, no random serial): the label of a build elsewhere matches
    assert text == receipts.sbom(v, "0123456789ab" * 5 + "0123", entries, wheels,
                                 receipts.debian_packages(STATUS), "http://deb.debian.org/debian", "bookworm",
                                 "6.1,7.0 measured")


def test_a_wheelhouse_without_the_locked_wheel_or_a_broken_sbom_is_one_line():
    v, entries, wheels = inputs("cpu")
    wheels.popitem()
    with pytest.raises(UserError, match=r"^the wheelhouse has no wheel of .* run `invoke wheels --variant cpu`$"):
        receipts.sbom(v, "0123456789ab" * 5 + "0123", entries, wheels, [])
    doc = json.loads(receipts.sbom(*inputs("cpu")[:1], "0" * 64, *inputs("cpu")[1:], []))
    doc["components"][0]["hashes"][0]["alg"] = "SHA-257"
    with pytest.raises(UserError, match="^the SBOM is not valid CycloneDX 1.6: "):
        receipts.check_sbom(json.dumps(doc))


def statement(v, entries, wheels, image_id="sha256:" + "ab" * 32):
    return receipts.provenance(
        image="fleetbox/paddle:cpu-0123456789ab", image_id=image_id, layers=["sha256:" + "cd" * 32],
        variant=v, lock_sha256=locks.lock_hash(v.lock_path.read_text()), lock_path="images/locks/cpu.lock",
        base_ref="fleetbox/base:bookworm-1",
        base_id="sha256:" + "ef" * 32, dockerfile="FROM x\n", sbom_text="{}", wheels=wheels, engine="Docker 27",
        started=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), finished=dt.datetime(2026, 1, 1, 0, 5, tzinfo=dt.UTC),
        invocation="build-cpu-1", force=False)


def test_the_provenance_is_an_in_toto_statement_of_the_image_with_what_it_was_made_from():
    v, entries, wheels = inputs("cpu")
    s = receipts.check_statement(statement(v, entries, wheels))
    assert receipts.subject_digests(s) == {"sha256:" + "ab" * 32}
    deps = {d["name"]: d for d in s["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["lock"]["digest"]["sha256"] == locks.lock_hash(v.lock_path.read_text())
    assert deps["base"]["digest"] == {"sha256": "ef" * 32}
    assert {n for n in deps if n.endswith(".whl")} == set(wheels)
    assert s["predicate"]["runDetails"]["metadata"]["finishedOn"] == "2026-01-01T00:05:00Z"
    bad = statement(v, entries, wheels, image_id="not-a-digest!")
    bad["subject"][0]["digest"] = {}
    with pytest.raises(UserError, match="^the provenance statement is not a valid in-toto statement: "):
        receipts.check_statement(bad)


def test_beside_an_export_go_its_sbom_and_its_statement_with_the_export_as_a_second_subject(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RECEIPTS", str(tmp_path / "receipts"))
    v, entries, wheels = inputs("cpu")
    receipts.keep("f" * 64, "{\"sbom\": 1}\n", statement(v, entries, wheels), "sha256:" + "ab" * 32)
    out = tmp_path / "fleetbox-paddle-cpu-ffff.tar"
    made = receipts.beside(out, "f" * 64, "sha256:" + "ab" * 32, "12" * 32)
    assert [p.name for p in made] == [f"{out.name}.sbom.json", f"{out.name}.provenance.json"]
    assert made[0].read_text() == "{\"sbom\": 1}\n"
    s = receipts.check_statement(json.loads(made[1].read_text()))
    assert s["subject"][1] == {"name": out.name, "digest": {"sha256": "12" * 32}}
    assert receipts.beside(out, "e" * 64, "sha256:" + "ab" * 32, None) == []   # another image's inputs: none


def _key(folder, name):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(folder / name)], check=True)
    return folder / name


def test_a_signed_statement_verifies_with_its_key_and_not_once_changed_or_with_another(tmp_path):
    """OpenSSH's own signatures (ssh-keygen -Y), offline; trusted keys as .pub lines or an allowed_signers file."""
    mine, other = _key(tmp_path, "site"), _key(tmp_path, "other")
    statement = tmp_path / "image-x.provenance.json"
    statement.write_text('{"_type": "https://in-toto.io/Statement/v1"}\n')
    with pytest.raises(UserError, match=r"^image-x.provenance.json is not signed \(no image-x.provenance.json.sig\)$"):
        receipts.signer(statement, Path(f"{mine}.pub"))
    assert receipts.sign(statement, mine) == Path(f"{statement}.sig")
    assert receipts.signer(statement, Path(f"{mine}.pub")).startswith("fleetbox (SHA256:")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f'admin@site namespaces="fleetbox-provenance" {Path(f"{mine}.pub").read_text()}')
    assert receipts.signer(statement, allowed).startswith("admin@site (SHA256:")
    with pytest.raises(UserError, match=r"^image-x.provenance.json.sig is not by a key of .*other.pub$"):
        receipts.signer(statement, Path(f"{other}.pub"))
    receipts.sign(statement, mine)   # again, over its own signature
    statement.write_text('{"_type": "https://in-toto.io/Statement/v1", "changed": 1}\n')
    with pytest.raises(UserError, match=r"does not verify: the statement changed after it was signed"):
        receipts.signer(statement, Path(f"{mine}.pub"))
    with pytest.raises(UserError, match=r"^--sign-key .*/none: no such key file$"):
        receipts.sign(statement, tmp_path / "none")


def test_a_site_that_trusts_only_signed_images_fails_one_fleetbox_did_not_build():
    """verify --trusted-keys: an image with no inputs label (not fleetbox's, or its label emptied) has no statement
    to check, which fails it; without --trusted-keys it is not held to receipts at all."""
    from types import SimpleNamespace

    from fleetbox.commands import verify
    v = matrix.load().get("cpu")
    image = SimpleNamespace(id="sha256:" + "ab" * 32, labels={"io.fleetbox.inputs-sha256": ""})
    assert verify.receipt_checks(None, image, v) == ([], "")
    rows, expect = verify.receipt_checks(None, image, v, Path("site.pub"))
    assert [(r["check"], r["ok"]) for r in rows] == [("signature", False)] and expect == ""
