"""`zerodp doctor`: the OOM doctor's reports of a run that ran out of device memory (zerodp/plan/doctor.py)."""

from __future__ import annotations

import argparse
import json
import sys

from zerodp.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`zerodp doctor`."""
    doctor = sub.add_parser("doctor", help="show the OOM doctor's reports of a run that ran out of device memory")
    doctor.add_argument("path", metavar="LOGDIR_OR_REPORT",
                        help="a report (rank0.json) or the directory of them ($ZERODP_DOCTOR_DIR, default ./zerodp_oom)")
    doctor.add_argument("--json", action="store_true", help="print the reports as JSON")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print every rank's report, as text or JSON."""
    from zerodp.plan.doctor import ReportDamaged, format_report, load_reports

    try:
        reports = load_reports(args.path)
    except ReportDamaged as err:  # bad data
        print(f"zerodp doctor: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:
        print(f"zerodp doctor: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(reports, indent=1) if args.json else "\n\n".join(format_report(r) for r in reports))
    return EXIT_OK
