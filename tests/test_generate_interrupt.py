"""Ctrl-C stops ``layertap generate`` as an interrupt (exit 130, the summary of what was written)
even when it lands in vLLM code whose cleanup then fails: vLLM 0.32's tokenizer pool
(``vllm/tokenizers/hf.py``, ``_borrow_from_pool``) puts back a tokenizer it never took, and the
UnboundLocalError replaced the KeyboardInterrupt, so the run ended as failed (exit 1, "the run
failed: UnboundLocalError"; seen in test_ctrl_c_then_the_documented_command_resumes)."""

from __future__ import annotations

import queue

import pytest

from layertap.generate.run import is_interrupt


def _borrow_from_pool(pool: queue.Queue):
    """vLLM 0.32's ``_borrow_from_pool``, its shape kept: the interrupt lands in ``get_nowait``."""
    try:
        tok = pool.get_nowait()
        yield tok
    finally:
        pool.put(tok)  # unbound when get_nowait was interrupted


class _InterruptedQueue(queue.Queue):
    def get_nowait(self):
        raise KeyboardInterrupt  # Ctrl-C, as the signal handler raises it


def test_an_error_of_vllms_cleanup_after_ctrl_c_is_the_interrupt():
    with pytest.raises(UnboundLocalError) as caught:
        next(_borrow_from_pool(_InterruptedQueue()))
    assert isinstance(caught.value.__context__, KeyboardInterrupt)
    assert is_interrupt(caught.value)
    assert is_interrupt(KeyboardInterrupt())


def test_other_errors_are_not_interrupts():
    assert not is_interrupt(UnboundLocalError("cannot access local variable 'tok'"))
    try:
        try:
            raise ValueError("first")
        except ValueError:
            raise RuntimeError("while handling it") from None
    except RuntimeError as e:
        assert not is_interrupt(e)
