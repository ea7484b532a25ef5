"""``layertap.generate.engine.shutdown``: the ZeroMQ context is destroyed only once vLLM's output
thread has closed its own sockets.

vLLM's sync client (``SyncMPClient``) hands its output socket to a thread, which closes it when
the client's shutdown signals it; the shutdown returns without waiting. Destroying the context
closes every socket still open from the calling thread, and libzmq does not allow one socket
closed from two threads: a fresh-clone CI saw a ``layertap generate`` abort after its last row
(SIGABRT, ``Assertion failed: ... (src/pipe.cpp:355)``). The race is rare with a real engine
(tests/vllm/test_values.py checks the thread is over after a real shutdown); here a client of
vLLM's shape holds its output thread until the test lets it go, so the order is certain.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import zmq

from layertap.generate.engine import shutdown

#: How long the test gives a shutdown that does not wait to return (it returns at once): a
#: shutdown that waits is never wrongly caught however loaded the machine.
RETURNS_WITHIN = 1.0


class Client:
    """vLLM's sync client as shutdown sees it: ``shutdown`` signals the output thread and
    returns; the thread closes its socket when the test sets ``release``."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.PAIR)
        self.signalled = threading.Event()
        self.release = threading.Event()
        self.output_queue_thread = threading.Thread(target=self._outputs, daemon=True)
        self.output_queue_thread.start()

    def _outputs(self) -> None:
        self.signalled.wait()
        self.release.wait()
        self.socket.close(linger=0)

    def shutdown(self, timeout=None) -> None:
        self.signalled.set()


def test_the_context_outlives_the_output_threads_sockets():
    client = Client()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
    stopping = threading.Thread(target=shutdown, args=(llm,))
    stopping.start()
    assert client.signalled.wait(60)
    # A shutdown that did not wait would have destroyed the context, closing the thread's
    # socket from here, within this time.
    stopping.join(RETURNS_WITHIN)
    assert stopping.is_alive(), "shutdown returned while vLLM's output thread still held its socket"
    assert not client.ctx.closed and not client.socket.closed
    client.release.set()
    stopping.join()
    assert not client.output_queue_thread.is_alive()
    assert client.ctx.closed


def test_a_thread_that_does_not_end_keeps_its_context(monkeypatch):
    """The context of an output thread that outlives the wait is left open (vLLM's, to collect)."""
    monkeypatch.setattr("layertap.generate.engine.OUTPUT_THREAD_SECONDS", 0.01)
    client = Client()
    shutdown(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client)))
    assert client.output_queue_thread.is_alive()
    assert not client.ctx.closed and not client.socket.closed
    client.release.set()
    client.output_queue_thread.join()
    client.ctx.destroy(linger=0)
