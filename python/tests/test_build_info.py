"""epx.build_info(): what the linked library was built with, consistent with itself."""
import epx


def test_build_info_fields():
    info = epx.build_info()
    assert set(info) == {"cuda", "nccl", "nccl_version", "nccl_version_code", "network"}
    assert isinstance(info["cuda"], bool) and isinstance(info["nccl"], bool)
    assert info["network"] is False  # no network transport is built in this version
    if info["nccl"]:
        major, minor, patch = (int(p) for p in info["nccl_version"].split("."))
        assert (major, minor) >= (2, 28)
        assert info["nccl_version_code"] == major * 10000 + minor * 100 + patch
    else:
        assert info["nccl_version"] == "" and info["nccl_version_code"] == 0


def test_build_info_is_a_fresh_dict():
    a = epx.build_info()
    a["cuda"] = "changed"
    assert epx.build_info()["cuda"] != "changed"
