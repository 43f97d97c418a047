"""Report: what a user reads: the reporter that raises and logs, report files, the `report` command's summary."""
