"""The connector against vLLM's connector interface of every supported version, 0.26 to 0.33
(``vllm_interfaces.json``, read from each version's source by ``vllm_interface.py snapshot``),
and driven through the installed vLLM's own metrics and factory code (``vllm_interface.py
check``, which also runs by hand against the source of other versions)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from vllm_interface import SNAPSHOT, check, parse_signature, read_classes

from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS

VERSIONS = json.loads(SNAPSHOT.read_text())


def connector_class():
    from layertap.vllm.connector import LayertapConnector

    return LayertapConnector


def test_the_snapshot_reads_the_installed_vllm_as_it_is():
    """The parser gives, for the installed source, what the snapshot holds for its version: the
    snapshot of the other versions was made the same way."""
    import vllm

    assert vllm.__version__ in VERSIONS
    assert read_classes(Path(vllm.__file__).parent.parent) == VERSIONS[vllm.__version__]


def test_every_supported_version_is_in_the_snapshot():
    assert {"0.26.0", "0.32.0", "0.33.0"} <= set(VERSIONS)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_the_connector_implements_the_interface_of(version):
    """Each hook the connector defines takes the parameters vLLM passes in that version, with
    the same kind (a classmethod stays one), and nothing abstract is left."""
    cls = connector_class()
    base = VERSIONS[version]["KVConnectorBase_V1"]
    for name, text in base.items():
        kind, params, abstract = parse_signature(text)
        ours = inspect.getattr_static(cls, name, None)
        if name not in vars(cls):
            assert not abstract, f"{version}: abstract {name} not implemented"
            continue
        if kind == "property":
            assert isinstance(ours, property), name
            continue
        assert kind == ("classmethod" if isinstance(ours, classmethod) else "method"), f"{version}: {name} is a {kind}"
        fn = ours.__func__ if isinstance(ours, classmethod) else ours
        mine = list(inspect.signature(fn).parameters)
        if "**" in params:  # vLLM passes extra keywords: the hook must take them
            assert any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()), name
            params = [p for p in params if p != "**"]
            mine = mine[: len(params)]
        assert mine == params, f"{version}: {name}{tuple(mine)} but vLLM's is {name}{tuple(params)}"


def test_the_sleep_hooks_are_those_of_033_and_unknown_before():
    """vLLM 0.33 added supports_sleep_mode, unregister_kv_caches and restore_kv_caches; the
    versions before it never call them."""
    hooks = {
        "supports_sleep_mode": "classmethod(cls, kv_transfer_config)",
        "unregister_kv_caches": "method(self)",
        "restore_kv_caches": "method(self)",
    }
    for version, classes in VERSIONS.items():
        base = classes["KVConnectorBase_V1"]
        present = {name: base[name] for name in hooks if name in base}
        assert present == (hooks if version >= "0.33" else {}), version
    cls = connector_class()
    assert all(name in vars(cls) for name in hooks)
    assert cls.supports_sleep_mode(None) is True


def test_the_metrics_classes_are_those_of_every_version():
    """The stats class implements what ``KVConnectorStats`` leaves abstract (raises
    NotImplementedError) in every version, and the Prometheus class takes the arguments
    ``KVConnectorPromMetrics`` takes."""
    from layertap.vllm.metrics import LayertapConnectorStats, LayertapPromMetrics

    for version, classes in VERSIONS.items():
        for name in ("reset", "aggregate", "reduce", "is_empty"):
            assert name in classes["KVConnectorStats"] and name in vars(LayertapConnectorStats), (version, name)
        _, params, _ = parse_signature(classes["KVConnectorPromMetrics"]["__init__"])
        assert list(inspect.signature(LayertapPromMetrics.__init__).parameters) == params, version


def test_the_installed_vllm_drives_the_connector_hooks(capsys):
    """``vllm_interface.py check``: vLLM's factory, KVConnectorLogging and KVConnectorProm with
    the connector's classes. In this process (vLLM is imported here already: a process of its own
    imported it again, 10 s of CPU); layertap's metrics are taken out of Prometheus' global
    registry after it, as vLLM takes its own out before registering them again."""
    from layertap.vllm.metrics import unregister_layertap_metrics

    try:
        check(None)
    finally:
        unregister_layertap_metrics()
    out = capsys.readouterr().out
    assert "connector signatures match" in out and "records_written=4" in out, out
