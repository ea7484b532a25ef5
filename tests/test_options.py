"""``WriterOptions``' bound on shard metadata, measured as the shard header stores it."""

from __future__ import annotations

import pytest

import layertap
from helpers import make_tensors, writer_class
from layertap._spec.format import MAX_META_LEN
from layertap.errors import OptionError

LIMIT = MAX_META_LEN // 2
# `{"m":"` and `"}` around the value.
AROUND = 8
# Every kind of escape ('"', '\\', '\x01', '\n') and a 2-byte character: 14 bytes as JSON.
UNIT = '"\\\x01\né'


def at_limit() -> str:
    units = (LIMIT - AROUND) // 14
    return UNIT * units + "x" * (LIMIT - AROUND - 14 * units)


@pytest.mark.parametrize(
    ("value", "json_len"),
    [("\x01" * 200_000, AROUND + 6 * 200_000), (at_limit() + "x", LIMIT + 1)],
    ids=["control-characters", "one-byte-over"],
)
def test_metadata_is_measured_with_its_escapes(tmp_path, value, json_len):
    # 200,000 control characters are 200 KB raw but 1.2 MB in the header: measured raw, they
    # passed, and readers then refused every shard the writer wrote.
    with pytest.raises(OptionError, match=f"metadata is too large: {json_len} bytes as JSON") as info:
        layertap.WriterOptions(metadata={"m": value})
    assert info.value.option == "metadata"


def test_metadata_at_the_limit_is_written_and_read_back(tmp_path):
    value = at_limit()
    with writer_class()(tmp_path, writer_id="m", metadata={"m": value}) as w:
        w.submit("a", make_tensors(0))
    with layertap.open(tmp_path) as ds:
        (shard,) = ds.shards
        assert shard.complete and shard.meta["user"] == {"m": value}
        assert ds.keys() == ["a"]
