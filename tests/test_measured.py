"""Records measured once per machine (mtp_viz.measured): where they lie, when one is trusted, when
it is measured again, and that a write is whole or absent."""

import hashlib
import json
import time

import pytest
from conftest import tiny_model

from mtp_viz import kernel_plan, measured
from mtp_viz.kernels import plain_linears
from mtp_viz.machine import machine_key

NOW = time.time()


def record(**changes) -> dict:
    return {"version": 3, "measured_at": measured.stamp(NOW), "settled": True, "chosen": "q4", **changes}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    return tmp_path


def test_records_lie_per_machine_and_key_where_they_always_did(cache):
    path = measured.record_path("weights", "tiny", "abc", prefix="auto-")
    assert path == cache / "weights" / f"auto-{machine_key()}-tiny-abc.json"
    model = tiny_model("llama-2l")
    shapes = sorted({tuple(m.weight.shape) for m in plain_linears(model)})
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:10]
    assert kernel_plan.plan_path(model) == cache / "kernels" / f"{machine_key()}-{digest}.json"
    measured.write(path, record())
    (cache / "weights" / "auto-another-machine-tiny-abc.json").write_text(json.dumps(record()))
    assert measured.machine_paths("weights", prefix="auto-") == [path]


def test_a_record_is_trusted_only_whole_of_its_version_and_kind(cache):
    path = cache / "r.json"
    check = lambda r: r["chosen"] in ("fp32", "q4")  # noqa: E731
    assert measured.read(path, 3) is None  # none yet
    for bad in (record(version=2), record(measured_at="yesterday"), record(chosen="q2")):
        measured.write(path, bad)
        assert measured.read(path, 3, ("settled",), check) is None
    measured.write(path, {k: v for k, v in record().items() if k != "settled"})
    assert measured.read(path, 3, ("settled",), check) is None  # a required key missing
    measured.write(path, record())
    assert measured.read(path, 3, ("settled",), check) == record()
    path.write_text("[1, 2]")
    assert measured.read_raw(path) == {} and measured.read(path, 3) is None
    path.write_text('{"version": 3, "measured_at"')  # cut short
    assert measured.read_raw(path) == {}


def test_an_unsettled_record_serves_an_hour_and_a_settled_one_until_measured_again():
    hours = [measured.stamp(NOW - h * 3600 - 1) for h in (0, 1)]
    assert measured.still_good(record(measured_at=hours[0], settled=False), NOW)
    assert not measured.still_good(record(measured_at=hours[1], settled=False), NOW)
    assert measured.still_good(record(measured_at=hours[1]), NOW)
    assert measured.still_good(record(measured_at=hours[1], settled=False), NOW, retry_after_s=7200)


def test_a_write_keeps_the_named_sections_and_an_entry_leaves_the_rest(cache):
    path = cache / "kernels" / "plan.json"
    measured.write(path, record(padded=[1]))
    measured.write_entry(path, "rows", "q4", {"plan": "as is"})
    measured.write_entry(path, "rows", "int8", {"plan": "padded"})
    stored = measured.read_raw(path)
    assert stored["padded"] == [1] and stored["rows"] == {"q4": {"plan": "as is"}, "int8": {"plan": "padded"}}
    measured.write(path, record(padded=[2]), keep=("rows",))  # measured again: the row plans stay
    assert measured.read_raw(path)["rows"] == stored["rows"] and measured.read_raw(path)["padded"] == [2]
    measured.write(path, record(padded=[3]))
    assert "rows" not in measured.read_raw(path)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary file left


def test_a_write_that_fails_says_so_and_leaves_the_old_record_whole(cache, caplog):
    path = cache / "codes.bin"
    assert measured.write_atomically(path, lambda tmp: tmp.write_bytes(b"old"))

    def broken(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    assert not measured.write_atomically(path, broken, "the codes")
    assert path.read_bytes() == b"old" and [p.name for p in cache.iterdir()] == ["codes.bin"]
    assert "could not cache the codes" in caplog.text
