"""System base plans: what a --mirror turns into, and what of it is recorded in the base image."""
import re
import subprocess

import pytest

from fleetbox.errors import UserError
from fleetbox.image import bases, matrix

SECRET_MIRROR = "http://user:secret@mirror.example/debian"


def cpu():
    return matrix.load().get("cpu")


def recorded(p):
    """Everything of a plan that ends up in the image, its metadata or the build's output."""
    return "\n".join([*bases.labels(p).values(), *bases.build_args(p).values(), *p.describe(), repr(p)])


def test_a_credentialed_mirror_is_used_for_the_download_only():
    p = bases.plan(cpu(), bootstrap=True, mirror=SECRET_MIRROR)
    assert p.method == "debootstrap" and p.mirror == "http://mirror.example/debian"
    assert "secret" not in recorded(p) and "user" not in recorded(p)
    assert bases.labels(p)["io.fleetbox.base.mirror"] == "http://mirror.example/debian"
    assert p.download_mirror == SECRET_MIRROR   # debootstrap still gets what it needs to log in


def test_a_bootstrapped_rootfs_keeps_no_credentials(tmp_path):
    """As debootstrap leaves it: its sources.list and log name the download URL; after the trim, no file does."""
    p = bases.plan(cpu(), bootstrap=True, mirror=SECRET_MIRROR)
    rootfs = tmp_path / "rootfs"
    for rel in ("etc/apt/sources.list", "var/log/bootstrap.log", "var/lib/apt/lists/x_Packages",
                "var/cache/apt/archives/python3.deb"):
        (rootfs / rel).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / rel).write_text(f"deb {SECRET_MIRROR} bookworm main\n")
    (rootfs / "etc/hostname").write_text("kept\n")
    bases._trim(rootfs, p.mirror, p.base.suite)
    left = {f.relative_to(rootfs).as_posix(): f.read_text() for f in rootfs.rglob("*") if f.is_file()}
    assert left == {"etc/apt/sources.list": "deb http://mirror.example/debian bookworm main\n",
                    "etc/hostname": "kept\n"}


def test_an_os_image_build_refuses_credentials_it_would_record():
    with pytest.raises(UserError, match=r"^mirror credentials can be used only with --bootstrap") as e:
        bases.plan(cpu(), mirror=SECRET_MIRROR)
    assert "secret" not in str(e.value)
    p = bases.plan(cpu(), mirror="https://mirror.example:8443/debian")
    assert p.method == "os-image" and bases.build_args(p)["MIRROR"] == "https://mirror.example:8443/debian"


@pytest.mark.parametrize("url", ["http://mirror.example/debian", "https://mirror.example:8443/de~b_i.a%20n+x-y@z"])
def test_base_dockerfiles_sed_writes_the_mirror_as_given(tmp_path, url):
    """The sed that rewrites the OS image's apt sources, run as the build's bash runs it."""
    sed = re.search(r'sed -i "[^"]*" /etc/apt/sources.list.d/debian.sources', bases.BASE_DOCKERFILE.read_text())
    sources = tmp_path / "debian.sources"
    sources.write_text("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n")
    p = bases.plan(cpu(), mirror=url)
    cmd = sed.group(0).replace("/etc/apt/sources.list.d/debian.sources", str(sources))
    subprocess.run(["bash", "-o", "pipefail", "-c", cmd], env={"MIRROR": bases.build_args(p)["MIRROR"]},
                   check=True)
    assert sources.read_text() == f"Types: deb\nURIs: {url}\nSuites: bookworm\n"


@pytest.mark.parametrize("url", [
    "ftp://x/debian", "http://", "http:///debian", "http://host/de bian", "http://host/a|b", "http://host/a;rm -rf /",
    "http://host/a&b", "http://host/a\nb", "http://host/a\\1", "http://host/$(id)", "http://host:port/debian",
    "file:///srv/debian", "mirror.example/debian",
])
def test_bad_mirror_urls_are_refused_in_one_line(url):
    with pytest.raises(UserError) as e:
        bases.plan(cpu(), bootstrap=True, mirror=url)
    assert str(e.value).startswith("mirror ") and "\n" not in str(e.value)


@pytest.mark.parametrize("mirror", ["http://user:secret@host/a|b", "http://user:se/cret@host/debian"])
def test_a_refused_mirror_does_not_echo_its_credentials(mirror):
    with pytest.raises(UserError, match=r"mirror 'http://\*\*\*@host/.*' is not usable") as e:
        bases.plan(cpu(), bootstrap=True, mirror=mirror)
    assert "secret" not in str(e.value) and "cret" not in str(e.value)


def test_a_bad_mirror_is_refused_even_when_the_base_exists():
    class Images:
        def get(self, ref):
            return type("Image", (), {"id": "sha256:" + "1" * 64})()

    client = type("Client", (), {"images": Images()})()
    assert bases.ensure(client, cpu(), log=lambda m: None) == "sha256:" + "1" * 64   # reused, as before
    with pytest.raises(UserError, match=r"^mirror 'http://host/a;b' is not usable"):
        bases.ensure(client, cpu(), mirror="http://host/a;b", log=lambda m: None)
