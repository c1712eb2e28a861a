"""The dead-letter stream keeps the newest `dead_letter_limit` jobs (workers/fleet.py): each dead-lettered job
holds its whole graph, so a flood of bad jobs (a broken build submitting thousands) must not fill Redis, which
would then refuse the fleet's every write."""

from __future__ import annotations

import json

import pytest
import redis

from cachestore.settings import SettingsError, load_settings
from workers.fleet import DEAD_LETTER_MESSAGE_LUA, FAIL_JOB_LUA

LIMIT = 3


def test_failed_jobs_past_the_limit_trim_the_oldest_dead_letters(
    redis_client: redis.Redis, redis_namespace: str
) -> None:
    fail = redis_client.register_script(FAIL_JOB_LUA)
    stream, dead, counts = f"{redis_namespace}jobs", f"{redis_namespace}dead", f"{redis_namespace}counts"
    redis_client.xgroup_create(stream, "nkicache-workers", id="0", mkstream=True)
    for n in range(LIMIT + 4):
        job = {"id": f"job-{n}", "file": f"g{n}.json", "graph": "{}" + " " * 1000}
        message = redis_client.xadd(stream, {"job": json.dumps(job)})
        redis_client.xreadgroup("nkicache-workers", "w", {stream: ">"}, count=1)
        keys = [f"{redis_namespace}result:{n}", counts, f"{redis_namespace}failures", stream, dead]
        assert fail(keys=keys, args=[job["id"], message, "boom", 1, json.dumps(job), "w", 60, job["file"], LIMIT]) == 1
    kept = [fields[b"job"].decode() for _, fields in redis_client.xrange(dead)]
    assert kept == [f"job-{n}" for n in range(4, LIMIT + 4)]  # the newest, in order
    assert int(redis_client.hget(counts, "dead_letter")) == LIMIT + 4  # every one counted all the same
    assert json.loads(redis_client.get(f"{redis_namespace}result:0"))["status"] == "dead_letter"  # its result stays


def test_messages_that_are_no_job_trim_the_dead_letters_too(redis_client: redis.Redis, redis_namespace: str) -> None:
    dead_letter = redis_client.register_script(DEAD_LETTER_MESSAGE_LUA)
    stream, dead, counts = f"{redis_namespace}jobs", f"{redis_namespace}dead", f"{redis_namespace}counts"
    redis_client.xgroup_create(stream, "nkicache-workers", id="0", mkstream=True)
    for n in range(LIMIT + 2):
        message = redis_client.xadd(stream, {"job": f"not json {n}"})
        redis_client.xreadgroup("nkicache-workers", "w", {stream: ">"}, count=1)
        dead_letter(keys=[stream, dead, counts], args=[message, "no job", f"not json {n}", LIMIT])
    assert redis_client.xlen(dead) == LIMIT and int(redis_client.hget(counts, "dead_letter")) == LIMIT + 2


@pytest.mark.parametrize("value", [0, -1])
def test_the_limit_must_be_positive(value: int) -> None:
    with pytest.raises(SettingsError, match="dead_letter_limit"):
        load_settings({"dead_letter_limit": value})
