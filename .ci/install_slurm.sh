#!/usr/bin/env bash
# SLURM and munge for the slow SLURM tests (Debian/Ubuntu): slurmctld, slurmd, the client
# commands (sbatch, srun, squeue, scontrol, scancel, sinfo) and munge. Nothing is done when
# they are there already. Never fails: where apt is missing, or it is not root and sudo cannot
# run without a password, it says so and the tests skip (or fail under SATURATE_REQUIRE_SLURM=1).
# The daemons are not started here: scripts/local_slurm.py starts its own, on its own ports,
# with its own munge key; the packages' services are kept from starting (policy-rc.d).
set -u
packages=(slurmctld slurmd slurm-client munge)
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
if have slurmctld && have slurmd && have sbatch && have munged; then
    echo "install_slurm.sh: SLURM and munge are installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: no apt-get here; install ${packages[*]} by hand to run the SLURM tests" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
else
    echo "install_slurm.sh: not root and no password-less sudo; the SLURM tests will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d: where an init system is running, do not let the packages start their own
# daemons (the fixture starts private ones); removed again afterwards if we made it
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee /usr/sbin/policy-rc.d >/dev/null && "${sudo[@]}" chmod +x /usr/sbin/policy-rc.d && made_policy=1
fi
ok=0
for attempt in 1 2; do
    if "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}"; then
        ok=1
        break
    fi
    sleep 5
done
[ "$made_policy" -eq 1 ] && "${sudo[@]}" rm -f /usr/sbin/policy-rc.d
if [ "$ok" -eq 1 ]; then
    echo "install_slurm.sh: installed $(dpkg-query -W -f='${Package} ${Version}  ' "${packages[@]}" 2>/dev/null)"
else
    echo "install_slurm.sh: apt-get could not install ${packages[*]}; the SLURM tests will be skipped" >&2
fi
exit 0
