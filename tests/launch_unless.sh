#!/bin/sh
# A launch command for tests: fails for host index $1 (as an ssh to a host that is down would), else runs the rest.
# launch_unless.sh FAILING_INDEX INDEX HOST COMMAND...
failing=$1 index=$2 host=$3
shift 3
if [ "$index" = "$failing" ]; then
    echo "cannot reach $host" >&2
    exit 3
fi
exec "$@"
