"""The CLI drops library log lines a user cannot act on, and only those."""

from __future__ import annotations

import logging

import pytest

from trainforge.library_logs import quiet_library_logs


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_liger_and_triton_wrapper_noise_is_dropped_and_dynamo_keeps_its_other_warnings():
    import torch._higher_order_ops.triton_kernel_wrap as triton_wrap

    quiet_library_logs()
    quiet_library_logs()  # main() may run twice in one process (tests): still one filter
    dynamo = logging.getLogger("torch._dynamo")
    # the filter sits on the logger torch's Triton-kernel wrapper writes through; a rename in torch must show here
    assert triton_wrap.log is dynamo
    kept = _Kept()
    dynamo.addHandler(kept)
    try:
        triton_wrap.log.warning("Encountered an exception in identify_mutated_tensors, assuming every input is mutated")
        dynamo.warning("torch._dynamo hit config.recompile_limit (8)")
    finally:
        dynamo.removeHandler(kept)
    assert kept.messages == ["torch._dynamo hit config.recompile_limit (8)"]
    registry = pytest.importorskip("liger_kernel.backends.registry")
    assert registry.logger.name == "liger_kernel.backends.registry"
    assert not logging.getLogger("liger_kernel.backends.registry").isEnabledFor(logging.WARNING)
    assert logging.getLogger("liger_kernel.backends.registry").isEnabledFor(logging.ERROR)


def test_the_dynamo_warning_about_ligers_cached_swiglu_check_is_dropped_and_others_stay():
    import warnings

    quiet_library_logs()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_library_logs()  # its filter goes in front of the "default" above, as in the CLI's process
        warnings.warn("Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'swiglu.py:34'. Dynamo "
                      "ignores the cache wrapper", UserWarning)
        warnings.warn("Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'mine.py:3'.", UserWarning)
    assert [str(w.message) for w in seen] == ["Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'mine.py:3'."]
