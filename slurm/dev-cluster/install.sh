#!/usr/bin/env bash
# Debian packages of a throw-away Slurm (+ slurmdbd/MariaDB for accounting: without it a cancelled job
# leaves submitit waiting forever). Idempotent; needs root and the Debian archive. WITH_DBD=0: no accounting;
# EXTRA_PACKAGES: more Debian packages to install in the same apt-get.
set -euo pipefail
WITH_DBD=${WITH_DBD:-1}
PKGS="munge slurmctld slurmd slurm-client iproute2"  # (iproute2: start.sh NODES=K, network namespaces)
[ "$WITH_DBD" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
PKGS="$PKGS ${EXTRA_PACKAGES:-}"  # (scripts/setup.sh: the tests' other Debian packages, in the same apt-get)
missing=""
for p in $PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; done
[ -z "$missing" ] && exit 0
[ "$(id -u)" = 0 ] || { echo "install.sh: root needed to apt-get install$missing" >&2; exit 1; }
echo "eaglelab: apt-get install$missing" >&2
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then   # keep postinst scripts from starting services
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
fi
trap '[ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends $missing >/dev/null
