"""The one logging setup: a tagged, flushed stdout line per record, configured once per process."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO
from prl.log import ROOT, _Stdout, get_logger, init_logging

LINE = re.compile(r"^\[prl (?P<tag>\S+)\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d (?P<level>[A-Z]+) (?P<message>.*)$")


@pytest.fixture(autouse=True)
def fresh_prl_logger():
    """Each test starts from an unconfigured `prl` logger and leaves none behind."""
    logger = logging.getLogger(ROOT)
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers.clear()
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def test_init_logging_is_idempotent(capsys, fresh_prl_logger, monkeypatch):
    monkeypatch.delenv("PRL_LOG_LEVEL", raising=False)
    init_logging("launcher")
    init_logging("launcher")
    init_logging("inference", 3)
    get_logger("prl.job.role").info("ready")
    get_logger("job.role").debug("not shown at INFO")
    lines = capsys.readouterr().out.splitlines()
    # prl's own handler, once (pytest 9.2 adds capture handlers of its own to the logger: not ours to count).
    assert len([h for h in fresh_prl_logger.handlers if isinstance(h, _Stdout)]) == 1
    assert len(lines) == 1, lines
    m = LINE.match(lines[0])
    assert m and m["tag"] == "inference.3" and m["level"] == "INFO" and m["message"] == "ready", lines[0]


def test_level_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("PRL_LOG_LEVEL", "debug")
    init_logging("orchestrator")
    get_logger(__name__).debug("details")
    assert LINE.match(capsys.readouterr().out.strip())["tag"] == "orchestrator"
    init_logging("orchestrator", level="WARNING")
    get_logger(__name__).info("hidden")
    assert capsys.readouterr().out == ""


def test_get_logger_names_descend_from_prl():
    assert get_logger("prl.ops.status").name == "prl.ops.status"
    assert get_logger("tests.test_log").name == "prl.tests.test_log"
    assert get_logger("prl").name == "prl"


def test_records_do_not_reach_the_root_logger_twice(capsys):
    """A library's basicConfig on the root logger (uvicorn, vLLM) must not print prl's lines again."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    root.addHandler(handler)
    try:
        init_logging("router")
        get_logger("prl.inference.router").warning("backend down")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().out.count("backend down") == 1


def test_a_line_is_out_before_the_process_ends():
    """Flushed per record: a task killed right after logging still leaves the line in its log."""
    code = ("import os; from prl.log import init_logging, get_logger; init_logging('trainer', 1); "
            "get_logger('prl.trainer').info('exited 0'); os._exit(9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 9 and LINE.match(out.stdout.strip())["message"] == "exited 0", out


def test_throttled_warnings_are_one_line_per_interval_and_count_what_they_left_out(prl_caplog):
    import time

    from prl.log import Throttled

    throttled = Throttled(get_logger("tests.throttled"), every_s=0.2)
    assert [throttled.warning("refused %s", n) for n in range(5)] == [True, False, False, False, False]
    time.sleep(0.25)
    assert throttled.warning("refused %s", 5)
    assert [r.getMessage() for r in prl_caplog.records] == ["refused 0", "refused 5 (and 4 more like it in the last 0.2 s)"]
