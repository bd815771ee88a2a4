"""`invoke verify`'s pure parts: how its container is run, and what it says of a GPU image where there is no GPU."""
import pytest

from fleetbox.commands import verify
from fleetbox.image import matrix

GPU = matrix.load().get("cu118-pypi")
# Docker Engine's refusal on this machine (no NVIDIA runtime or hook), as docker.errors.APIError.explanation; the
# NVIDIA hook's where the host has no driver loaded, as reported in NVIDIA/nvidia-docker#1629 (toolkit 1.9.0)
NO_DRIVER = 'could not select device driver "" with capabilities: [[gpu]]'
NO_NVML = ("failed to create shim: OCI runtime create failed: container_linux.go:380: starting container process "
           "caused: process_linux.go:545: container init caused: Running hook #0:: error running hook: exit status 1, "
           "stdout: , stderr: nvidia-container-cli: initialization error: nvml error: driver not loaded: unknown.")
# a GPU machine whose driver fails (NVIDIA/nvidia-container-toolkit#183): not a machine without a GPU
DRIVER_ERROR = ("OCI runtime create failed: ... stderr: nvidia-container-cli: initialization error: driver error: "
                "failed to process request")


@pytest.mark.parametrize("answer", [NO_DRIVER, NO_NVML])
def test_an_engine_with_no_gpu_to_give_is_named_and_any_other_refusal_is_not(answer):
    why = verify.no_gpu_reason(answer)
    assert why.startswith("the engine has no GPU to give (") and "\n" not in why and len(why) < 200
    assert verify.no_gpu_reason("No such image: fleetbox/paddle:cu118-pypi") == ""
    assert verify.no_gpu_reason(DRIVER_ERROR) == ""


def test_without_a_gpu_the_probe_is_told_why_and_asks_for_none():
    given = verify.container_kwargs(GPU, {})
    assert given["device_requests"][0]["Count"] == -1 and given["environment"]["FLEETBOX_NO_GPU"] == ""
    none = verify.container_kwargs(GPU, {}, no_gpu="the engine has no GPU to give (x)")
    assert "device_requests" not in none and none["network_mode"] == "none"
    assert none["environment"]["FLEETBOX_NO_GPU"] == "the engine has no GPU to give (x)"
    assert none["environment"]["FLEETBOX_DEVICE"] == "cuda"   # the image is still checked as a CUDA build


def test_the_verdict_names_what_was_not_run_on_a_gpu_and_a_failure_is_a_failure():
    checks = [{"check": "compiled device", "ok": True}, {"check": "device count", "ok": True, "no_gpu": True},
              {"check": "paddle.utils.run_check()", "ok": True, "no_gpu": True}]
    assert verify.verdict({"ok": True, "checks": checks}) == \
        "PASSED without a GPU (not run on one: device count, paddle.utils.run_check())"
    assert verify.verdict({"ok": True, "checks": checks[:1]}) == "PASSED"
    assert verify.verdict({"ok": False, "checks": checks}) == "FAILED"
    assert [verify.status(c) for c in [*checks[:2], {"ok": False}]] == ["PASS", "NO GPU", "FAIL"]
