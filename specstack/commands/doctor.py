"""``specstack doctor [-m MODEL]``: checks that matter for CPU inference on this machine."""

from __future__ import annotations

import json

from ..host.doctor import render, run_doctor, to_dict


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this machine for CPU inference (cores, NUMA, huge pages, CPU features, memory)",
        description="Report what matters for llama.cpp on CPUs, each with a status (ok/info/warn/"
        "fail) and the command that would fix it. Changes nothing. Exit status 1 if a check fails.",
    )
    p.add_argument("-m", "--model", default=None, help="GGUF model to check the memory for")
    p.add_argument("--json", action="store_true", help="print checks and facts as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    checks, facts = run_doctor(args.model)
    if args.json:
        print(json.dumps(to_dict(checks, facts), indent=2))
    else:
        print(render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
