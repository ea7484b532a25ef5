"""``WriterOptions``, the core's options as a frozen class: its defaults, copies and pickling, and
its bound on shard metadata, measured as the shard header stores it."""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

import layertap
from helpers import make_tensors, run_python, writer_class
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


def test_defaults_copies_and_pickling():
    o = layertap.WriterOptions()
    assert o.as_dict() == {
        "codec": "bp16-zstd",
        "level": 1,
        "shard_size": 1 << 30,
        "durability": "close",
        "threads": None,
        "max_inflight_bytes": 1 << 30,
        "batch_bytes": 8 << 20,
        "writer_id": None,
        "io": "auto",
        "direct": False,
        "metadata": {},
        "lossy": None,
        "key_memory": None,
    }
    assert tuple(o.as_dict()) == layertap.WriterOptions.FIELDS
    changed = o.replace(durability=1 << 20, metadata={"run": "7"}, lossy="fp8-e4m3", writer_id="w")
    assert changed.durability == 1 << 20 and dict(changed.metadata) == {"run": "7"} and o.lossy is None
    # A copy is checked again, and the original stays as it was.
    with pytest.raises(OptionError, match="durability must be") as info:
        changed.replace(durability=-1)
    assert info.value.option == "durability" and changed.durability == 1 << 20
    # vLLM sends configurations between processes: the options travel as their values.
    back = pickle.loads(pickle.dumps(changed))
    assert back == changed and back is not changed and type(back) is layertap.WriterOptions
    assert layertap.WriterOptions(**changed.as_dict()) == changed
    assert repr(changed).startswith("WriterOptions(codec='bp16-zstd', level=1,") and "durability=1048576" in repr(
        changed
    )
    assert eval(repr(changed), {"WriterOptions": layertap.WriterOptions}) == changed
    assert (o == object()) is False and o != changed


def test_without_the_extension_the_name_imports_and_says_what_to_do():
    """A checkout not yet built still imports (the pure-Python readers work); making options
    says how to build what they need."""
    code = (
        "import sys; sys.modules['layertap._native'] = None\n"
        "import layertap\n"
        "try:\n    layertap.WriterOptions(codec='zstd')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "layertap.WriterOptions needs the compiled extension layertap._native (build it with `make build`)"
    )


def test_the_written_signatures_hold_the_cores_defaults():
    """The defaults are the core's (``WriterConfig::default``); the signature ``help()`` shows and
    the type stub spell them out again, so both are held to it."""
    defaults = layertap.WriterOptions().as_dict()
    shown = {name: p.default for name, p in inspect.signature(layertap.WriterOptions).parameters.items()}
    assert shown == defaults
    stub = ast.parse(Path(layertap.__file__).with_name("_native.pyi").read_text())
    (cls,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "WriterOptions"]
    (init,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    stubbed = {a.arg: eval(ast.unparse(d), {}) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults)}
    assert stubbed == {**defaults, "metadata": None}  # the stub's None: no metadata
