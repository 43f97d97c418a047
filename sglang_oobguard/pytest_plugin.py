"""The pytest plugin (entry point `pytest11: oobguard`), inert unless asked for.

`pytest --oobguard[=strict|raise|warn]` guards the whole test session: it sets
SGLANG_OOBGUARD_MODE and SGLANG_OOBGUARD_REPORT_DIR in os.environ, so every process
the tests start (servers, engines and their schedulers) inherits them, arms the
guard in the pytest process too (it installs when sglang's memory_pool is imported
there), and at the end prints the report folder's summary and fails the run when
any process reported a violation or when no process was guarded at all.

Without the option this module only adds its options: nothing is imported or set.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Optional

import pytest

if TYPE_CHECKING:
    from .report.summary import Summary

MODES = ("strict", "raise", "warn")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("oobguard", "sglang-oobguard: bounds-check every sglang KV-cache write")
    group.addoption("--oobguard", nargs="?", const="strict", default=None, choices=MODES, metavar="MODE",
                    help="guard sglang in this process and in every process the tests start, in MODE: "
                         "strict (the default), raise or warn; fail the run on any violation, or when no "
                         "process was guarded")
    group.addoption("--oobguard-report-dir", default=None, metavar="DIR",
                    help="the folder for the guarded processes' reports (default: a new temporary folder); "
                         "made if missing, refused if it holds reports of an earlier run")
    group.addoption("--oobguard-checks", default=None, metavar="LIST",
                    help="which checks run (SGLANG_OOBGUARD_CHECKS), e.g. all,-reads or +liveness,+finite: "
                         "`python -m sglang_oobguard help` lists them")


def pytest_configure(config: pytest.Config) -> None:
    mode: Optional[str] = config.getoption("oobguard")
    folder: Optional[str] = config.getoption("oobguard_report_dir")
    checks: Optional[str] = config.getoption("oobguard_checks")
    if mode is None:
        for given, name in ((folder, "--oobguard-report-dir"), (checks, "--oobguard-checks")):
            if given is not None:
                raise pytest.UsageError(f"{name} needs --oobguard[=strict|raise|warn]")
        return
    config.pluginmanager.register(GuardedSession(mode, _report_folder(folder), checks), "oobguard-session")


def _report_folder(given: Optional[str]) -> str:
    from .report.files import PREFIX, SUFFIX
    from .report.summary import plural

    if given is None:
        return tempfile.mkdtemp(prefix="oobguard-report-")
    folder = os.path.abspath(given)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"--oobguard-report-dir={given}: cannot make the folder ({exc})") from None
    earlier = [name for name in os.listdir(folder) if name.startswith(PREFIX) and name.endswith(SUFFIX)]
    if earlier:
        raise pytest.UsageError(f"--oobguard-report-dir={given} holds the reports of an earlier run "
                                f"({plural(len(earlier), 'file')}, e.g. {earlier[0]}): remove them, or name an "
                                "empty folder")
    return folder


class GuardedSession:
    """The session's guard: the variables it set (put back at the end), its folder
    and, after the tests, the folder's summary."""

    def __init__(self, mode: str, folder: str, checks: Optional[str] = None) -> None:
        from .model import config as config_mod

        self.folder = folder
        self.summary: Optional[Summary] = None
        wanted = {config_mod.MODE_VAR: mode, config_mod.REPORT_DIR_VAR: folder}
        if checks is not None:
            wanted[config_mod.CHECKS_VAR] = checks
        self.saved = {name: os.environ.get(name) for name in wanted}
        os.environ.update(wanted)
        try:
            config_mod.from_env()  # the other guard variables the user set must be valid too
        except config_mod.ConfigError as exc:
            self._restore()
            raise pytest.UsageError(str(exc)) from None
        from .autoload import arm

        arm()  # this process: the guard installs when sglang's memory_pool is imported (now, if it is)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from .report import summary
        from .report.reporter import KVOutOfBoundsError

        if session.config.option.collectonly:
            return
        if _guard_imported():
            import sglang_oobguard

            try:
                sglang_oobguard.check()  # what this process's GPU probes recorded and not yet reported
            except KVOutOfBoundsError:
                pass  # filed in the report folder as it was raised
        self.summary = summary.read(self.folder)
        if self.summary.exit_code and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.summary is None:
            return
        from .report.summary import render

        terminalreporter.write_sep("=", "sglang-oobguard")
        for line in render(self.summary).splitlines():
            terminalreporter.write_line(line)

    def pytest_unconfigure(self) -> None:
        if _guard_imported():
            import sglang_oobguard

            sglang_oobguard.uninstall()
        self._restore()

    def _restore(self) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _guard_imported() -> bool:
    """Whether the guard's install machinery was ever loaded in this process (only
    then can it hold anything to check or uninstall)."""
    return "sglang_oobguard.activate.instrument" in sys.modules
