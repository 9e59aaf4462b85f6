"""``specstack doctor [-m MODEL]``: checks that matter for CPU inference on this machine."""

from __future__ import annotations

import json

from pathlib import Path

from ..errors import InvalidParameterError
from .common import at_least
from ..host.doctor import Check, llamafile_in, render, row_cost_check, run_doctor, to_dict


def row_cost(model: str, threads: int, system_info: str | None) -> Check:
    """The row-cost check of ``model``: its t(n) as the cost policy measures and caches it (a load, then
    seconds; nothing to measure where the cache has it)."""
    from ..draft_length import DEFAULT_K_MAX
    from ..loading import TargetSpec, load_calibrated
    from ..modelfile.meta import read_gguf

    costs = load_calibrated(TargetSpec(model=Path(model), threads=threads), n_max=DEFAULT_K_MAX + 1,
                            prefix="specstack doctor").costs
    target = costs.curve
    return row_cost_check(lambda n: target[min(n, len(target)) - 1], llamafile_in(system_info),
                          f"{Path(model).name} at -t {threads or 'its default'}", read_gguf(model).output_share,
                          (costs.depth0, costs.row_depth_s))


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this machine for CPU inference (cores, NUMA, huge pages, CPU features, memory bandwidth and "
        "int8 peak, memory)",
        description="Report what matters for llama.cpp on CPUs, each with a status (ok/info/warn/"
        "fail) and the command that would fix it. Changes nothing. Exit status 1 if a check fails.",
    )
    p.add_argument("-m", "--model", default=None, help="GGUF model to check the memory for")
    p.add_argument("--row-cost", action="store_true",
                   help="with -m: load the model and measure what a verified row costs here, t(n)/t(1) at 2-16 rows "
                   "(cached, as generate's cost policy measures it), and say which llama.cpp build suits it")
    p.add_argument("-t", "--threads", type=at_least(1), default=0, help="the threads the run you are preparing uses: "
                   "what the threads and load checks judge, and --row-cost measures at (default: one per physical "
                   "core)")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline probe (about a second: the cores' "
                   "streaming read bandwidth and int8 multiply-add peak, at one thread and at -t)")
    p.add_argument("--json", action="store_true", help="print checks and facts as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.row_cost and args.model is None:
        raise InvalidParameterError("--row-cost measures a model: give it with -m MODEL")
    checks, facts = run_doctor(args.model, args.threads, probe=not args.no_roofline)
    if args.row_cost and not any(c.status == "fail" for c in checks):
        checks.append(row_cost(args.model, args.threads, facts["llama_system_info"]))
    if args.json:
        print(json.dumps(to_dict(checks, facts), indent=2))
    else:
        print(render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
