
import pytest

from fleetbox.image import images, locks, matrix

LOCK = ("# fleetbox-lock\npip==25.3 \\\n    --hash=sha256:aa\npaddlepaddle==3.3.1 \\\n    --hash=sha256:bb\n")


def _plan(variant="cpu", base_id="sha256:" + "1" * 64, lock_text=LOCK):
    v = matrix.load().get(variant)
    return images.plan(v, base_id, (lock_text, locks.parse(lock_text)), revision="abc123")


def test_build_args_come_from_the_matrix_and_lock():
    p = _plan()
    v = p.variant
    assert p.build_args == {"BASE_IMAGE": v.base_ref, "PYTHON": "/usr/bin/python3",
                            "PIP_WHEEL": "pip-25.3-py3-none-any.whl", "VARIANT": "cpu", "DEVICE": "cpu"}
    dcu = _plan("dcu")
    assert dcu.build_args["PYTHON"] == "/usr/local/bin/python3.10" and dcu.build_args["DEVICE"] == "rocm"
    assert dcu.build_args["BASE_IMAGE"].startswith("fleetbox/base:dtk2404-")


def test_tag_is_content_addressed_and_stable():
    a, b = _plan(), _plan()
    assert a.tag == b.tag and a.tag.startswith("fleetbox/paddle:cpu-") and len(a.tag.split("-")[-1]) == 12
    assert a.tags[1:] == ["fleetbox/paddle:cpu", "fleetbox/paddle:3.3.1-cpu-py311"]


@pytest.mark.parametrize("what", ["dockerfile", "lock", "base_id", "build_arg"])
def test_tag_changes_with_each_input(what):
    base, args = "sha256:" + "1" * 64, _plan().build_args
    v = matrix.load().get("cpu")
    df = images.recipe(v, _plan().layers, locks.parse(LOCK))   # the layer split and scripts
    ref = images.content_hash(df, LOCK, base, args)
    changed = {
        "dockerfile": lambda: images.content_hash(df + "\n# x", LOCK, base, args),
        "lock": lambda: images.content_hash(df, LOCK.replace("aa", "ab"), base, args),
        "base_id": lambda: images.content_hash(df, LOCK, "sha256:" + "2" * 64, args),
        "build_arg": lambda: images.content_hash(df, LOCK, base, {**args, "PYTHON": "/usr/bin/python3.11"}),
    }[what]()
    assert changed != ref


def test_labels_carry_provenance():
    p = _plan()
    lbl = p.labels
    assert lbl["org.opencontainers.image.revision"] == "abc123"
    assert lbl["org.opencontainers.image.base.digest"] == "sha256:" + "1" * 64
    assert lbl["io.fleetbox.lock-sha256"] == locks.lock_hash(LOCK)
    assert lbl["io.fleetbox.pip-freeze"] == "paddlepaddle==3.3.1 pip==25.3"
    assert lbl["io.fleetbox.inputs-sha256"] == p.content_hash


@pytest.mark.parametrize("name", ["cpu", "cu118", "cu126", "cu129", "dcu"])
def test_dry_run_plan_renders_for_every_variant_without_lock_or_base(name):
    v = matrix.load().get(name)
    p = images.plan(v, None, None)
    text = "\n".join(p.describe())
    assert f"variant   {name}" in text and v.paddle in text and "docker run --network none" in text
    assert "MISSING" in text and f"invoke lock --variant {name}" in text
    assert p.tag == images.UNKNOWN
    if v.paddle_index:
        assert v.paddle_index in text


def test_pip_wheel_needs_pip_in_the_lock():
    from fleetbox.errors import UserError
    with pytest.raises(UserError, match="no pip"):
        images.pip_wheel(locks.parse("numpy==1 \\\n  --hash=sha256:a\n"))


def test_the_plan_names_each_layer_and_its_packages():
    lock = LOCK.replace("paddlepaddle==3.3.1 \\\n    --hash=sha256:bb\n",
                        "paddlepaddle==3.3.1 \\\n    --hash=sha256:bb\nscipy==1.17.1 \\\n    --hash=sha256:cc\n")
    text = "\n".join(_plan(lock_text=lock).describe())
    assert "layer     paddle: paddlepaddle, pip\n" in text, text
    assert "layer     scipy: scipy; then the freeze file, the SBOM and bind-mount targets\n" in text, text   # the last
    assert "\nsettings  the environment, working folder, command and labels, committed onto the last layer" in text
