"""Where torch is not installed (``pip install layertap`` without the ``torch`` extra), writing,
reading, following and the command line work, with numpy arrays (bfloat16 from ml_dtypes); and
the production path never imports the pure-Python reference implementation (``layertap._py``).

Each test runs in a fresh interpreter; an import hook there makes ``import torch`` fail as it
does where torch is not installed."""

from __future__ import annotations

import json
import textwrap

from helpers import run_python

NO_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    """
)


def test_write_read_follow_and_the_command_line_without_torch(tmp_path):
    code = NO_TORCH + textwrap.dedent(
        """
        import contextlib, io, json, sys
        import ml_dtypes, numpy as np
        import layertap
        from layertap.cli import main

        out = {}
        path = sys.argv[1]
        hidden = np.arange(24, dtype=np.float32).reshape(3, 2, 4).astype(ml_dtypes.bfloat16)
        ids = np.arange(3, dtype=np.int64)
        for writer_id in ("a", "b"):
            with layertap.ShardWriter(path, writer_id=writer_id) as w:
                w.submit(writer_id, {"hidden_states": hidden, "token_ids": ids})
        for backend in ("rust", "python"):
            with layertap.open(path, backend=backend) as ds:
                recs = list(ds)
                assert [r.key for r in recs] == ["a", "b"], [r.key for r in recs]
                for r in recs:
                    assert isinstance(r.hidden_states, np.ndarray), type(r.hidden_states)
                    assert r.hidden_states.dtype == ml_dtypes.bfloat16 and r.hidden_states.shape == (3, 2, 4)
                    assert (r.hidden_states.astype(np.float32) == hidden.astype(np.float32)).all()
                    assert r.token_ids.tolist() == [0, 1, 2]
        with layertap.follow(path, timeout=0) as records:
            out["followed"] = [type(r.hidden_states).__name__ for r in records]
        try:
            layertap.open(path, tensors="torch")
        except ImportError as e:
            out["torch_asked"] = str(e)
        for command in (["inspect", path], ["verify", path], ["inspect", path, "--json"]):
            with contextlib.redirect_stdout(io.StringIO()) as text:
                out[command[0] + ("-json" if len(command) > 2 else "")] = main(command)
        out["torch_loaded"] = "torch" in sys.modules
        print(json.dumps(out))
        """
    )
    proc = run_python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["followed"] == ["ndarray", "ndarray"]
    assert "tensors='torch' needs torch" in out["torch_asked"]
    assert out["inspect"] == out["verify"] == out["inspect-json"] == 0
    assert out["torch_loaded"] is False


def test_the_production_path_does_not_import_the_reference_implementation(tmp_path):
    """Writing with ShardWriter, reading with the Rust backend, following, the command line and
    the connector's option parsing load nothing of ``layertap._py``; choosing the Python reader
    does."""
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        import numpy as np
        import layertap
        from layertap.cli import main
        from layertap.vllm.config import parse_options

        def loaded():
            return sorted(m for m in sys.modules if m.startswith("layertap._py"))

        path = sys.argv[1]
        parse_options({"output_dir": path, "codec": "zstd"})
        with layertap.ShardWriter(path, writer_id="w") as w:
            w.submit("k", {"x": np.ones(4, dtype=np.float32)})
            w.submit_buffers([("k2", [("x", b"abcd", "U8", [4])], None, 0)])
        with layertap.open(path, backend="rust") as ds:
            assert [r.key for r in ds.iter(errors="skip")] == ["k", "k2"]
        with layertap.follow(path, timeout=0) as records:
            assert len(list(records)) == 2
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["inspect", path]) == main(["verify", path]) == 0
        production = loaded()
        layertap.open(path, backend="python").close()  # the reference reader, asked for
        print(json.dumps({"production": production, "asked": loaded()}))
        """
    )
    proc = run_python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["production"] == []
    assert "layertap._py.reader" in out["asked"]
