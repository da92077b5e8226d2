"""A healthy cuda start logs no ERROR: numba's driver logger reports a not-ready event or stream poll
(a normal answer that numba reads as "not done yet") as an ERROR; the cli's logging drops exactly
that record, and every real driver fault still gets through."""
from __future__ import annotations

import logging

import pytest

from moebus.cli import NUMBA_DRIVER_LOGGERS, _logging


@pytest.fixture
def driver_logger(caplog):
    _logging()
    _logging()  # set up twice (a worker started by hand, then a fork): one filter, not two
    logger = logging.getLogger(NUMBA_DRIVER_LOGGERS[0])
    assert len(logger.filters) == 1
    caplog.set_level(logging.WARNING)
    return logger


def test_the_not_ready_poll_is_dropped(driver_logger, caplog):
    driver_logger.error("Call to %s results in %s" % ("cuEventQuery", "CUDA_ERROR_NOT_READY"))
    driver_logger.error("Call to cuStreamQuery results in CUDA_ERROR_NOT_READY")
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("message", ["Call to cuEventQuery results in CUDA_ERROR_ILLEGAL_ADDRESS",
                                     "Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY",
                                     "Call to cuCtxSynchronize results in CUDA_ERROR_NOT_READY",
                                     "Call to cuEventQuery results in CUDA_ERROR_NOT_READY (and more)"])
def test_real_faults_still_get_through(driver_logger, caplog, message):
    driver_logger.error(message)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [message]


def test_numbas_own_query_path_is_filtered(driver_logger, caplog):
    """The record as numba's driver builds it (its logger, its message), whichever module name the
    numba-cuda redirect gives the driver."""
    for name in NUMBA_DRIVER_LOGGERS:
        logging.getLogger(name).error("Call to %s results in %s" % ("cuEventQuery", "CUDA_ERROR_NOT_READY"))
    assert not caplog.records
