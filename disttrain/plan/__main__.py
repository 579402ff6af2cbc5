"""``python -m disttrain.plan --calibrate``: measure this machine for the planner and store its profile;
``python -m disttrain.plan``: list the profiles."""

from __future__ import annotations

import argparse

from disttrain.plan.hardware import PROFILES, load_profile, profile_path, save_profile


def main(argv: list[str] | None = None) -> None:
    """Calibrate, or print the profiles the planner knows."""
    parser = argparse.ArgumentParser(prog="python -m disttrain.plan", description=__doc__)
    parser.add_argument("--calibrate", action="store_true", help="measure compute per core and gloo links here")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per compute measurement")
    parser.add_argument("--watts", type=float, default=None,
                        help="the machine's power under load (a meter's reading, or the CPU's TDP), for predicted "
                             "energy per token; this CPU's counters are not readable from here")
    args = parser.parse_args(argv)
    path = profile_path()
    if args.calibrate:
        from disttrain.plan.calibrate import calibrate

        profile = calibrate(args.seconds, args.watts)
        save_profile(profile, path)
        print(f"profile {profile.name}: " + ", ".join(f"{k} {v / 1e9:.3g} GFLOP/s per core"
                                                      for k, v in profile.flops.items())
              + f"; memory {profile.memory_bandwidth / 1e9:.3g} GB/s; {profile.op_overhead * 1e6:.3g} us per operator"
              + f"; gloo loopback {profile.intra_node.bandwidth / 1e9:.3g} GB/s, "
              f"{profile.intra_node.latency * 1e6:.3g} us per message")
        print(f"written to {path} (plan.profile=machine uses it)")
        return
    stored = f"calibrated, {path}" if path.exists() else "not calibrated: run with --calibrate"
    print(f"machine: this machine ({stored})")
    if path.exists():
        print(f"  {load_profile(path).name}")
    for name, profile in PROFILES.items():
        print(f"{name}: {profile.source}")


if __name__ == "__main__":
    main()
