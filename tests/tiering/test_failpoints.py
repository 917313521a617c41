"""Failpoints: unarmed they do nothing; armed (in-process or from PLANEKV_FAILPOINTS) they fail
where and when they are told; a misspelt point or action is refused, not silently ignored."""

from __future__ import annotations

import errno

import pytest

from planekv.tiering import failpoints


def test_an_unarmed_point_does_nothing_and_an_armed_one_fails_as_told():
    failpoints.hit("file.write")
    with failpoints.armed("file.write", "oserror:ENOSPC"), pytest.raises(OSError) as e:
        failpoints.hit("file.write")
    assert e.value.errno == errno.ENOSPC and "failpoint file.write" in str(e.value)
    failpoints.hit("file.write")  # disarmed on leaving the block
    with failpoints.armed("put.after_publish", "error"), pytest.raises(failpoints.FailpointError):
        failpoints.hit("put.after_publish")


def test_a_point_armed_from_the_environment_fires_from_its_nth_hit():
    try:
        failpoints.arm_from_env("delete.after_index=oserror:EROFS@3, file.delete=error")
        failpoints.hit("delete.after_index")
        failpoints.hit("delete.after_index")
        for _ in range(2):  # the third hit and every one after it
            with pytest.raises(OSError, match="Read-only file system"):
                failpoints.hit("delete.after_index")
        with pytest.raises(failpoints.FailpointError):
            failpoints.hit("file.delete")
    finally:
        failpoints.disarm("delete.after_index")
        failpoints.disarm("file.delete")


@pytest.mark.parametrize("spec, words", [
    ("put.after_pubish=kill", "unknown failpoint"),
    ("file.write=explode", "use kill, error or oserror"),
    ("file.write=oserror:ENOTANERRNO", "use kill, error or oserror"),
    ("file.write=kill@0", "hit number"),
    ("file.write", "not name=action"),
])
def test_a_misspelt_point_or_action_is_refused(spec, words):
    with pytest.raises(ValueError, match=words):
        failpoints.arm_from_env(spec)
    failpoints.disarm("file.write")
