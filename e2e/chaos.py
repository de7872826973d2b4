"""The fault suite as a benchmark: every fault kind, many trials, against one private control plane.

    python e2e/chaos.py [--trials 3] [--kill-trials 10] [--seed S] [--kinds K,...] [--replay KIND:SEED,...]

One rig (`e2e.faults.Rig`: its own etcd, kube-apiserver and controller-manager, the operator,
two agents over fixture nodes, a KubeVirt CR) takes the trials one after another, in an
order shuffled by the seed. Each trial injects one fault, then waits for the invariant
(`e2e.invariants`) to hold. It prints each trial with its own seed (replay trials, in order, with
`--replay KIND:SEED,...`), then: trials, faults injected, invariant violations (goal 0), time
to converge after each fault kind (p50/max), and processes that exited on their own (goal 0).
The exit status is 1 when a trial broke the invariant or a process exited.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e import faults  # noqa: E402


def schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(kind, seed) for every trial, in the order they run; every seed drawn from the base seed."""
    if args.replay:
        return [(kind, int(seed)) for kind, _, seed in (step.partition(":") for step in args.replay.split(","))]
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",") if args.kinds else list(faults.KINDS)
    trials = [(kind, rng.randrange(1, 2**31)) for kind in kinds
              for _ in range(args.kill_trials if kind == "operator-kill" else args.trials)]  # fmt: skip
    rng.shuffle(trials)
    return trials


async def chaos(workdir: Path, plan: list[tuple[str, int]]) -> list[faults.Trial]:
    started = time.monotonic()
    rig = await faults.Rig.up(workdir)
    print(f"rig up in {time.monotonic() - started:.1f}s: {len(rig.node_names)} agent nodes x {rig.devices_per_node} devices, "
          f"tenants {', '.join(rig.tenants)}, not-found grace {faults.NOT_FOUND_GRACE}s; logs in {rig.logs}", flush=True)  # fmt: skip
    done: list[faults.Trial] = []
    try:
        for i, (kind, seed) in enumerate(plan, 1):
            trial = await faults.run_trial(rig, kind, seed)
            done.append(trial)
            verdict = "ok" if trial.ok else f"{len(trial.violations)} VIOLATIONS, {len(trial.exits)} EXITS"
            converged = f"{trial.converge_s:5.1f}s" if trial.violations == [] else "  -   "
            print(f"[{i:2}/{len(plan)}] {kind:16} seed {seed:10}  faults {trial.faults}  converged {converged}  "
                  f"{verdict}  ({trial.note})", flush=True)  # fmt: skip
            for line in trial.violations + trial.exits:
                print(f"        {line}", flush=True)
    finally:
        await rig.close()
    return done


def summary(trials: list[faults.Trial], seed: int | None) -> None:
    kinds = list(dict.fromkeys(t.kind for t in trials))
    print()
    print(f"seed:                 {seed}" if seed is not None else "seed:                 (replay)")
    print(f"trials:               {len(trials)} ({', '.join(f'{k} {sum(t.kind == k for t in trials)}' for k in kinds)})")
    print(f"faults injected:      {sum(t.faults for t in trials)}")
    print(f"invariant violations: {sum(len(t.violations) for t in trials)} in {sum(bool(t.violations) for t in trials)} trials")
    print(f"process exits:        {sum(len(t.exits) for t in trials)} (each restarted)")
    print("converge after fault: p50 / max")
    for kind in kinds:
        times = [t.converge_s for t in trials if t.kind == kind and not t.violations]
        failed = sum(1 for t in trials if t.kind == kind and t.violations)
        shown = f"{statistics.median(times):5.1f} s / {max(times):5.1f} s" if times else "    -   /   -   "
        print(f"  {kind:18} {shown}  ({len(times)} converged{f', {failed} did not' if failed else ''})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials of each fault kind but operator-kill (default 3)")
    parser.add_argument("--kill-trials", type=int, default=10, help="operator-kill trials, each with its own seed (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="base seed the trials' seeds and order are drawn from (default: random)")
    parser.add_argument("--kinds", default="", help=f"comma-separated fault kinds (default all: {', '.join(faults.KINDS)})")
    parser.add_argument("--replay", default="", metavar="KIND:SEED,...",
                        help="run these trials in this order, as an earlier run or a failed test printed them")
    args = parser.parse_args()
    if args.seed is None and not args.replay:
        args.seed = random.randrange(1, 2**31)
    plan = schedule(args)
    unknown = sorted({kind for kind, _ in plan} - set(faults.KINDS))
    if unknown:
        parser.error(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(faults.KINDS)}")
    print(f"chaos: {len(plan)} trials, seed {args.seed if not args.replay else '(replay ' + args.replay + ')'}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="passthrough-chaos-"))
    trials = asyncio.run(chaos(workdir, plan))
    summary(trials, None if args.replay else args.seed)
    clean = all(t.ok for t in trials)
    if clean:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs kept in {workdir / 'logs'}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
