import pytest

from fleetbox.errors import UserError
from fleetbox.image import matrix


def test_matrix_has_the_required_variants():
    m = matrix.load()
    assert {"cpu", "cu118", "cu126", "cu129", "dcu"} <= set(m.variants)
    assert m.default == "cpu"
    cpu = m.get(None)
    assert cpu.paddle == "paddlepaddle==3.3.1" and cpu.python_version == "3.11" and cpu.base.suite == "bookworm"
    assert cpu.paddle_index == "" and cpu.index_for("paddlepaddle") == "https://pypi.org/simple"


@pytest.mark.parametrize("name,cuda,cudnn,index", [
    ("cu118", "11.8", "8.9", "https://www.paddlepaddle.org.cn/packages/stable/cu118/"),
    ("cu126", "12.6", "9.5", "https://www.paddlepaddle.org.cn/packages/stable/cu126/"),
    ("cu129", "12.9", "9.9", "https://www.paddlepaddle.org.cn/packages/stable/cu129/"),
])
def test_gpu_variants_pin_paddle_to_paddles_index_and_the_rest_to_pypi(name, cuda, cudnn, index):
    v = matrix.load().get(name)
    assert v.device == "cuda" and v.accel == {"cuda": cuda, "cudnn": cudnn}
    assert v.paddle_name == "paddlepaddle-gpu" and v.index_for("paddlepaddle_gpu") == index
    assert v.index_for("scipy") == v.pypi == "https://pypi.org/simple"


def test_every_variant_installs_scipy_and_opencv_and_pins_exactly():
    for v in matrix.load().variants.values():
        names = {r.split("==")[0] for r in v.requirements}
        assert {"scipy", "opencv-python-headless", "pip"} <= names, v.name
        assert all("==" in r for r in v.requirements), v.name


def test_dcu_records_what_containers_need():
    v = matrix.load().get("dcu")
    assert v.device == "rocm" and v.python_version == "3.10" and v.paddle_name == "paddlepaddle-dcu"
    assert v.runtime["devices"] == ["/dev/kfd", "/dev/dri"] and v.runtime["group_add"] == ["video"]
    assert "/opt/hyhal:/opt/hyhal:ro" in v.runtime["mounts"]
    assert not v.base.bootstrappable and "dtk24.04.1" in v.base.os_image


def test_unknown_variant_lists_valid_ones():
    with pytest.raises(UserError, match=r"unknown variant 'cu999'; valid variants: cpu, cu118, cu126, cu129, dcu"):
        matrix.load().get("cu999")


def test_bad_matrix_is_a_user_error(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text("[bases.b]\npython='x'\n[variants.v]\nbase='b'\ndevice='cpu'\npython_version='3.11'\n"
                 "platform='manylinux_2_36_x86_64'\npaddle='paddlepaddle'\n")
    with pytest.raises(UserError, match="must pin paddle exactly"):
        matrix.load(p)
    p.write_text("[variants.v]\nbase='nope'\n")
    with pytest.raises(UserError, match="lacks device"):
        matrix.load(p)
    p.write_text("[bases.b]\npython='x'\n[variants.board]\nbase='b'\ndevice='cpu'\npython_version='3.11'\n"
                 "platform='manylinux_2_36_x86_64'\npaddle='paddlepaddle==3.3.1'\n")
    with pytest.raises(UserError, match="^matrix: a variant may not be named 'board': its wheelhouse folder is the "
                                        "board's$"):
        matrix.load(p)
    p.write_text("[bases.b]\npython='x'\n[variants.v]\nbase='b'\ndevice='cuda'\npython_version='3.11'\n"
                 "platform='manylinux_2_36_x86_64'\npaddle='paddlepaddle-gpu==2.6.2'\n"
                 "published_capabilities=['8.0', 'sm_90']\npublished_source='x'\n")
    with pytest.raises(UserError, match=r"^matrix: variant 'v': compute capability 'sm_90' is not MAJOR.MINOR"):
        matrix.load(p)
    gpu = p.read_text().split("published_capabilities")[0]
    p.write_text(gpu + "published_capabilities=['8.0']\n")
    with pytest.raises(UserError, match=r"^matrix: variant 'v': published_capabilities need their published_source"):
        matrix.load(p)
    p.write_text(gpu + "compute_capabilities=['8.0']\n")   # measured, never typed
    with pytest.raises(UserError, match=r"^matrix: variant 'v': compute_capabilities are measured from the wheel"):
        matrix.load(p)
    p.write_text("not toml [")
    with pytest.raises(UserError):
        matrix.load(p)


def test_base_tag_depends_on_packages_not_mirror():
    b = matrix.load().get("cpu").base
    from dataclasses import replace
    assert replace(b, mirror="http://mirrors.example/debian").tag == b.tag
    assert replace(b, packages=b.packages + ("curl",)).tag != b.tag
    assert b.tag.startswith("bookworm-")


def test_the_variant_help_and_the_cpu_only_error_name_every_variant_the_matrix_has():
    from fleetbox import tasks
    from fleetbox.run import spec as spec_mod
    m = matrix.load()
    assert tasks.VARIANT_HELP == "matrix variant (images/matrix.toml): cpu (default), " + ", ".join(
        name for name in m.variants if name != "cpu")
    assert "cu118-pypi" in tasks.VARIANT_HELP
    with pytest.raises(UserError) as e:
        spec_mod.from_options(m.get("cpu"), nodes=1, gpus_per_node=1)
    assert str(e.value).endswith(f"or choose a GPU variant ({', '.join(matrix.gpu_variants())})")
    assert "cu118-pypi" in str(e.value) and "cpu," not in str(e.value)
